"""`--record DIR`: keep what a session heard and said, to replay it later (`kame replay`).

Per session, DIR/<session id>/: `input.wav` (the user's audio, 24 kHz), `output.wav` (the
assistant's), `events.jsonl` (transcripts, LLM attempts, oracle updates with their frames, the
assistant's text pieces, each with its time; an `end` event once the session is over; while the
session runs, the recorder holds a lock on `events.jsonl`, which a crash lets go of: `recording`). It
stores people's voices and words: off by default; tell your users when you turn it on.

The recorder observes a tandem session; its disk writes run on a thread of their own, in order,
never on the event loop.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import soundfile

from kame.clock import Clock
from kame.protocol import SAMPLE_RATE, wire_event
from kame.session_events import AssistantAudio, AssistantText, SessionEvent

logger = logging.getLogger(__name__)


class SessionRecorder:
    def __init__(self, root: Path, session_id: str, clock: Clock, meta: dict) -> None:
        self.folder = root / session_id
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"kame-record-{session_id}")
        self.clock = clock  # the session's: a line's `t` is seconds on it since the recording began
        self._started = clock.now()
        self._failed = False
        self._submit(self._open, meta)

    def _submit(self, fn, *args) -> None:
        """Run `fn` on the writer thread, in order; a failure is logged once and ends the recording
        (never the session)."""
        def run() -> None:
            if self._failed:
                return
            try:
                fn(*args)
            except Exception:  # a full disk, a folder that cannot be written: contained on this thread
                self._failed = True
                logger.exception("recording %s failed; it stops here, the session goes on", self.folder)
        self._writer.submit(run)

    def _open(self, meta: dict) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._input = soundfile.SoundFile(self.folder / "input.wav", "w", SAMPLE_RATE, 1, "PCM_16")
        self._output = soundfile.SoundFile(self.folder / "output.wav", "w", SAMPLE_RATE, 1, "PCM_16")
        self._events = (self.folder / "events.jsonl").open("w", buffering=1)  # line by line: readable live
        fcntl.flock(self._events.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # "running", for any process (`running`)
        self._write_line({"t": 0.0, "type": "session", **meta})

    def _write_line(self, line: dict) -> None:
        self._events.write(json.dumps(line) + "\n")

    def write_event(self, event: dict) -> None:
        line = {"t": round(self.clock.now() - self._started, 3), **event}
        self._submit(self._write_line, line)

    # ---------------------------------------------------------------- a session observer

    def on_input(self, pcm: np.ndarray) -> None:
        self._submit(lambda samples: self._input.write(samples), np.clip(pcm, -1, 1))

    def on_event(self, event: SessionEvent) -> None:
        if isinstance(event, AssistantAudio):
            self._submit(lambda samples: self._output.write(samples), np.clip(event.pcm, -1, 1))
        elif isinstance(event, AssistantText):
            self.write_event({"type": "text", "frame": event.frame, "text": event.text})
        elif (wire := wire_event(event)) is not None:
            self.write_event(wire.model_dump(exclude_none=True))

    def close(self) -> None:
        """Finish the files (blocking until every write is done: call it off the event loop); after a
        failure, only close them (and so let go of the lock: the recording is not running, nor whole)."""
        self._submit(self._close)
        self._writer.shutdown(wait=True)
        if self._failed:
            self._close_files()

    def discard(self) -> None:
        """The session never started (refused, or the client left during the upgrade): no recording
        at all, so that `kame replay DIR` finds only real sessions (blocking)."""
        self._failed = True  # what is still queued is not written
        self._writer.shutdown(wait=True)
        self._close_files()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _close_files(self) -> None:
        for name in ("_input", "_output", "_events"):
            if hasattr(self, name):
                try:
                    getattr(self, name).close()
                except Exception:  # a file the failure left unwritable: closed as far as it goes
                    logger.debug("closing %s of %s failed", name, self.folder, exc_info=True)

    def _close(self) -> None:
        self._input.close()
        self._output.close()
        self._write_line({"t": round(self.clock.now() - self._started, 3), "type": "end"})  # the WAVs are final
        self._events.close()


def running(events: Path) -> bool:
    """Whether a recorder (in any process on this host) still writes the recording of `events.jsonl`."""
    with events.open("rb") as file:
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False
