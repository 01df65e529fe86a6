"""A transcript stream whose engine runs on a worker thread and reports to an asyncio queue."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

import numpy as np

from kame.asr.events import AsrFailure, TranscriptEvent, drain_events
from kame.queues import post

logger = logging.getLogger(__name__)

_FLUSH = object()
_CLOSE = object()


class ThreadedStream:
    """Subclasses implement `_feed(pcm)` and `_finish()`, calling `_emit(event)` from the thread."""

    name = "asr"

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._inbox: queue.Queue = queue.Queue()  # unbounded: the worker drains it in whole
        self._events: asyncio.Queue[TranscriptEvent | None] = asyncio.Queue()
        self._flushed = threading.Event()
        self._closed = False
        self._waiting_since: float | None = None
        self._thread = threading.Thread(target=self._run, name=f"kame-{self.name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ asyncio side

    def push_pcm(self, pcm: np.ndarray) -> None:
        if not self._closed:
            if self._waiting_since is None:
                self._waiting_since = time.monotonic()
            self._inbox.put(np.asarray(pcm, dtype=np.float32))

    def stalled_for_s(self) -> float:
        """How long the oldest audio not yet taken by the worker has waited (0 when none waits)."""
        since = self._waiting_since
        return 0.0 if since is None else time.monotonic() - since

    async def flush(self) -> None:
        self._flushed.clear()
        self._inbox.put(_FLUSH)
        await asyncio.to_thread(self._flushed.wait)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inbox.put(_CLOSE)
        await asyncio.to_thread(self._thread.join, 10)
        self._events.put_nowait(None)

    def __aiter__(self) -> AsyncIterator[TranscriptEvent]:
        return drain_events(self._events)

    # ------------------------------------------------------------ worker side

    def _emit(self, event: TranscriptEvent) -> None:
        post(self._loop, self._events.put_nowait, event)

    def _drain(self) -> list:
        items = [self._inbox.get()]
        self._waiting_since = None  # the worker has everything queued so far
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                return items

    def _run(self) -> None:
        try:
            while True:
                for item in self._drain():
                    if item is _CLOSE:
                        return
                    if item is _FLUSH:
                        self._finish()
                        self._flushed.set()
                    else:
                        self._feed(item)
                self._idle()
        except Exception as exc:  # the session goes on without ASR; it is told why
            logger.exception("%s stream failed", self.name)
            self._emit(AsrFailure(f"{self.name} failed: {exc}"))
        finally:
            self._flushed.set()

    def _feed(self, pcm: np.ndarray) -> None:
        raise NotImplementedError

    def _idle(self) -> None:
        """Called when the inbox is empty: a good time for work that may lag (decoding)."""

    def _finish(self) -> None:
        raise NotImplementedError
