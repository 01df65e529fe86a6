"""Where a session's events go: to every observer when they happen, and to the one reader through a
bounded queue that drops the oldest audio frame first, so a slow reader never holds the session up."""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np

from kame.queues import DropOldestQueue
from kame.session_events import AssistantAudio, SessionEvent

logger = logging.getLogger(__name__)

_END = object()


class SessionObserver(Protocol):
    """Sees the user's audio and every event when it happens (metrics, recording)."""

    def on_input(self, pcm: np.ndarray) -> None: ...

    def on_event(self, event: SessionEvent) -> None: ...


class EventOutlet:
    """A session's events on their way out: observers first, then the reader's queue; `end` closes it."""

    def __init__(self, observers, max_events: int, session_id: str) -> None:
        self._observers = list(observers)
        self._queue: DropOldestQueue = DropOldestQueue(max_events)
        self._session_id = session_id

    def put(self, event: SessionEvent) -> None:
        self._observe("on_event", event)
        self._queue.put(event, droppable=isinstance(event, AssistantAudio))

    def heard(self, pcm: np.ndarray) -> None:
        """The user's audio, for the observers."""
        self._observe("on_input", pcm)

    def end(self) -> None:
        """No event follows: the reader ends after those queued (ending twice is harmless)."""
        self._queue.put(_END)

    def __aiter__(self) -> EventOutlet:
        return self

    async def __anext__(self) -> SessionEvent:
        """The next event; the iteration stops once the session has ended (for every later reader too)."""
        event = await self._queue.get()
        if event is _END:
            self._queue.put(_END)
            raise StopAsyncIteration
        return event

    def __len__(self) -> int:
        """Events queued for the reader."""
        return len(self._queue)

    @property
    def dropped(self) -> int:
        """Audio frames dropped because the reader fell behind."""
        return self._queue.dropped

    def _observe(self, method: str, value: object) -> None:
        """Tell every observer; a failing one (metrics, a recorder) is logged and dropped, the
        conversation goes on."""
        for observer in list(self._observers):
            try:
                getattr(observer, method)(value)
            except Exception:
                logger.exception("session %s: observer %r failed; it is dropped", self._session_id, observer)
                self._observers.remove(observer)
