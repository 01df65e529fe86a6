"""`--record DIR`: keep what a session heard and said, to replay it later (`kame replay`).

Per session, DIR/<session id>/: `input.wav` (the user's audio, 24 kHz), `output.wav` (the
assistant's), `events.jsonl` (transcripts, LLM attempts, oracle updates with their frames, the
assistant's text pieces, each with its time; an `end` event once the session is over). It
stores people's voices and words: off by default; tell your users when you turn it on.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import soundfile

from kame.protocol import SAMPLE_RATE


class SessionRecorder:
    def __init__(self, root: Path, session_id: str, meta: dict) -> None:
        self.folder = root / session_id
        self.folder.mkdir(parents=True, exist_ok=True)
        self._input = soundfile.SoundFile(self.folder / "input.wav", "w", SAMPLE_RATE, 1, "PCM_16")
        self._output = soundfile.SoundFile(self.folder / "output.wav", "w", SAMPLE_RATE, 1, "PCM_16")
        self._events = (self.folder / "events.jsonl").open("w", buffering=1)  # line by line: readable live
        self._started = time.monotonic()
        self.write_event({"type": "session", **meta})

    def write_input(self, pcm: np.ndarray) -> None:
        self._input.write(np.clip(pcm, -1, 1))

    def write_output(self, pcm: np.ndarray) -> None:
        self._output.write(np.clip(pcm, -1, 1))

    def write_event(self, event: dict) -> None:
        self._events.write(json.dumps({"t": round(time.monotonic() - self._started, 3), **event}) + "\n")

    def close(self) -> None:
        self._input.close()
        self._output.close()
        self.write_event({"type": "end"})  # the recording is complete: the WAV files are final
        self._events.close()
