"""A session's outgoing message queue: bounded for audio (the oldest frame is dropped when a
client falls behind), never dropping text, events or errors."""

from __future__ import annotations

import asyncio
from collections import deque


class SendQueue:
    def __init__(self, max_messages: int) -> None:
        self.max_messages = max_messages
        self._items: deque[tuple[bytes, bool]] = deque()
        self._ready = asyncio.Event()
        self.dropped = 0  # audio messages dropped

    def put(self, message: bytes, droppable: bool = False) -> None:
        if len(self._items) >= self.max_messages:
            for index, (_, can_drop) in enumerate(self._items):
                if can_drop:
                    del self._items[index]
                    self.dropped += 1
                    break
            else:
                if droppable:
                    self.dropped += 1
                    return
        self._items.append((message, droppable))
        self._ready.set()

    async def get(self) -> bytes:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()[0]

    def __len__(self) -> int:
        return len(self._items)
