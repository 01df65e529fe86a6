"""A bounded queue for realtime streams: when full, the oldest droppable item (audio) goes first;
the others (text, events, errors, control) are never dropped."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class DropOldestQueue(Generic[T]):
    def __init__(self, max_items: int) -> None:
        self.max_items = max_items
        self._items: deque[tuple[T, bool]] = deque()
        self._ready = asyncio.Event()
        self.dropped = 0  # droppable items dropped

    def put(self, item: T, droppable: bool = False) -> None:
        if len(self._items) >= self.max_items:
            for index, (_, can_drop) in enumerate(self._items):
                if can_drop:
                    del self._items[index]
                    self.dropped += 1
                    break
            else:
                if droppable:
                    self.dropped += 1
                    return
        self._items.append((item, droppable))
        self._ready.set()

    async def get(self) -> T:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()[0]

    def get_nowait(self) -> T:
        """The next item; IndexError when empty."""
        return self._items.popleft()[0]

    def __len__(self) -> int:
        return len(self._items)


def post(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """Run `fn(*args)` on `loop`, from any thread: the one bridge from worker threads (engine, ASR,
    embedded LLM, audio device) to asyncio. False when the loop is closed: nobody listens any more."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True
