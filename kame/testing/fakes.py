"""Scripted stand-ins for the vendors, for unit tests and demos: an LLM that streams on a clock."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kame.backend.llm import ChatMessage, LLMError
from kame.clock import Clock, MonotonicClock


@dataclass(frozen=True)
class FakeReply:
    deltas: tuple[str, ...] = ("The capital", " of France", " is Paris.")
    delay_s: float = 0.0  # clock time before each delta
    error: LLMError | None = None  # raised after `error_after` deltas
    error_after: int = 0


class FakeLLM:
    """Streams scripted replies in order (the last one repeats); records every request."""

    def __init__(self, replies: list[FakeReply] | None = None, clock: Clock | None = None, name: str = "fake") -> None:
        self._replies = deque(replies or [FakeReply()])
        self.clock = clock or MonotonicClock()
        self.name = name
        self.calls: list[list[ChatMessage]] = []

    async def stream_chat(self, messages: list[ChatMessage]) -> AsyncIterator[str]:
        self.calls.append(messages)
        reply = self._replies.popleft() if len(self._replies) > 1 else self._replies[0]
        for index, delta in enumerate(reply.deltas):
            if reply.error is not None and index == reply.error_after:
                raise reply.error
            await self.clock.sleep(reply.delay_s)
            yield delta
        if reply.error is not None and reply.error_after >= len(reply.deltas):
            raise reply.error
