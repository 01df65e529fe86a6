"""A spoken question through a real tandem session in this process: no server, no socket.

The audio is pushed at real-time pace (the ASR, the planner's restarts and the LLM see the
timing a user would give them), then `tail_s` of silence while the answer is spoken.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from kame.audio import FRAME_SIZE, SAMPLE_RATE
from kame.runtime import Runtime
from kame.session import SessionConfig, TandemSession
from kame.session_events import (
    AssistantAudio,
    AssistantText,
    LLMAttempt,
    OracleApplied,
    SessionEvent,
    SessionFailed,
    Transcript,
)


@dataclass
class Conversation:
    events: list[tuple[float, SessionEvent]] = field(default_factory=list)  # (seconds since start, event)
    speech_end_s: float = 0.0  # when the question's last sample was pushed

    def of(self, kind: type) -> list:
        return [e for _, e in self.events if isinstance(e, kind)]

    @property
    def assistant_text(self) -> str:
        return "".join(e.text for e in self.of(AssistantText)).strip()

    @property
    def assistant_audio(self) -> np.ndarray:
        frames = [e.pcm for e in self.of(AssistantAudio)]
        return np.concatenate(frames) if frames else np.zeros(0, np.float32)

    def lines(self) -> list[str]:
        """What happened, one readable line per transcript, oracle update and LLM phase."""
        out = []
        for t, event in self.events:
            if isinstance(event, Transcript):
                out.append(f"{t:6.2f}s  {'final  ' if event.final else 'partial'} {event.text}")
            elif isinstance(event, OracleApplied) and event.accepted:
                out.append(f"{t:6.2f}s  oracle  {event.op:6} {event.text}")
            elif isinstance(event, SessionFailed):
                out.append(f"{t:6.2f}s  error   {event.message}")
            elif isinstance(event, LLMAttempt) and event.phase in ("started", "done", "failed"):
                detail = event.user_text if event.phase == "started" else (event.answer or event.error or "")
                out.append(f"{t:6.2f}s  llm {event.epoch:<3} {event.phase:7} {detail}")
        return out


async def converse(runtime: Runtime, pcm: np.ndarray, config: SessionConfig | None = None,
                   tail_s: float = 4.0) -> Conversation:
    """Speak `pcm` (24 kHz mono) to a new session at real-time pace; collect every event."""
    conversation = Conversation()
    started = time.monotonic()
    async with await TandemSession.open(runtime, config or SessionConfig()) as session:
        async def collect() -> None:
            async for event in session:
                conversation.events.append((time.monotonic() - started, event))

        collector = asyncio.get_running_loop().create_task(collect(), name=f"converse-{session.id}")
        silence = np.zeros(int(tail_s * SAMPLE_RATE), np.float32)
        for index in range(0, len(pcm), FRAME_SIZE):
            session.push_pcm(pcm[index:index + FRAME_SIZE])
            await _until(started + (index + FRAME_SIZE) / SAMPLE_RATE)
        conversation.speech_end_s = time.monotonic() - started
        await session.flush()
        for index in range(0, len(silence), FRAME_SIZE):
            session.push_pcm(silence[index:index + FRAME_SIZE])
            await _until(started + (len(pcm) + index + FRAME_SIZE) / SAMPLE_RATE)
        await asyncio.sleep(0.3)  # the last frames come back
    await collector
    return conversation


async def _until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
