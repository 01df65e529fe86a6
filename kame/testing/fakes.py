"""Scripted stand-ins for the vendors, for unit tests and demos: an LLM on a clock, a scripted ASR."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kame.asr.events import AsrFailure, drain_events
from kame.audio import SAMPLE_RATE
from kame.backend.llm import ChatMessage, LLMError, ToolCalls
from kame.clock import Clock, MonotonicClock
from kame.tools.base import ToolCall


@dataclass(frozen=True)
class FakeReply:
    deltas: tuple[str, ...] = ("The capital", " of France", " is Paris.")
    delay_s: float = 0.0  # clock time before each delta
    error: LLMError | None = None  # raised after `error_after` deltas
    error_after: int = 0
    first_delay_s: float | None = None  # clock time before the first delta; None: delay_s
    tool_calls: tuple[ToolCall, ...] = ()  # after the deltas, this round ends with these calls

    @classmethod
    def of_words(cls, text: str, first_delay_s: float = 0.0, delay_s: float = 0.0) -> FakeReply:
        """`text` streamed one whole word per delta (each ends with a space, so it is complete on
        arrival): the first after `first_delay_s`, then one every `delay_s`."""
        return cls(tuple(f"{word} " for word in text.split()), delay_s, first_delay_s=first_delay_s)


class FakeLLM:
    """Streams scripted replies in order (the last one repeats); records every request (and the
    tools offered with it)."""

    def __init__(self, replies: list[FakeReply] | None = None, clock: Clock | None = None, name: str = "fake",
                 supports_tools: bool = True) -> None:
        self._replies = deque(replies or [FakeReply()])
        self.clock = clock or MonotonicClock()
        self.name = name
        self.supports_tools = supports_tools
        self.calls: list[list[ChatMessage]] = []
        self.tools_offered: list[list | None] = []
        self.tool_choices: list[str | None] = []

    async def stream_chat(self, messages: list[ChatMessage], tools: list | None = None,
                          tool_choice: str | None = None) -> AsyncIterator:
        self.calls.append(list(messages))
        self.tools_offered.append(None if tool_choice == "none" else tools)  # "none": listed, not offered
        self.tool_choices.append(tool_choice)
        reply = self._replies.popleft() if len(self._replies) > 1 else self._replies[0]
        for index, delta in enumerate(reply.deltas):
            if reply.error is not None and index == reply.error_after:
                raise reply.error
            first = index == 0 and reply.first_delay_s is not None
            await self.clock.sleep(reply.first_delay_s if first else reply.delay_s)
            yield delta
        if reply.error is not None and reply.error_after >= len(reply.deltas):
            raise reply.error
        if reply.tool_calls:
            yield ToolCalls(reply.tool_calls)


class ScriptedAsr:
    """An ASR engine that emits scripted transcript events once enough audio was pushed.

    `script` is a list of (audio seconds, event); `fail_at_s` raises (as an AsrFailure event);
    `stall` makes the stream stop consuming audio (its `stalled_for_s` grows).
    """

    name = "scripted-asr"

    def __init__(self, script: list[tuple[float, object]] = (), fail_at_s: float | None = None,
                 stall: bool = False, clock: Clock | None = None) -> None:
        self.script, self.fail_at_s, self.stall = list(script), fail_at_s, stall
        self.clock = clock or MonotonicClock()  # what `stalled_for_s` counts on

    def open_stream(self) -> _ScriptedStream:
        return _ScriptedStream(self)

    def close(self) -> None:
        pass


class _ScriptedStream:
    def __init__(self, asr: ScriptedAsr) -> None:
        self.asr = asr
        self._events: asyncio.Queue = asyncio.Queue()
        self._heard = 0.0
        self._pending = list(asr.script)
        self._failed = False
        self._stalled_since: float | None = None

    def push_pcm(self, pcm) -> None:
        if self.asr.stall:
            self._stalled_since = self._stalled_since or self.asr.clock.now()
            return
        self._heard += len(pcm) / SAMPLE_RATE
        while self._pending and self._pending[0][0] <= self._heard:
            self._events.put_nowait(self._pending.pop(0)[1])
        if self.asr.fail_at_s is not None and self._heard >= self.asr.fail_at_s and not self._failed:
            self._failed = True
            self._events.put_nowait(AsrFailure("scripted ASR failure"))

    def stalled_for_s(self) -> float:
        return 0.0 if self._stalled_since is None else self.asr.clock.now() - self._stalled_since

    async def flush(self) -> None:
        pass

    async def aclose(self) -> None:
        self._events.put_nowait(None)

    def __aiter__(self):
        return drain_events(self._events)
