"""A spoken question through a real tandem session in this process: no server, no socket.

The audio is pushed at real-time pace (the ASR, the planner's restarts and the LLM see the
timing a user would give them), then `tail_s` of silence while the answer is spoken; or, with
`realtime=False`, as fast as the engine answers. Its transports' twins are `client.conversation`
(Moshi's websocket) and `client.realtime_client` (OpenAI Realtime); `kame.eval.inprocess` gives the
evaluations this conversation in the websocket's shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
class InProcessConversation:
    """Every event of a session in this process, with times in seconds since it opened."""

    events: list[tuple[float, SessionEvent]] = field(default_factory=list)  # (seconds since start, event)
    speech_end_s: float = 0.0  # when the question's last sample was pushed
    frames_sent: int = 0  # the question's frames and the tail's

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


async def converse_in_process(runtime: Runtime, pcm: np.ndarray, config: SessionConfig | None = None,
                              tail_s: float = 4.0, realtime: bool = True,
                              max_ahead_frames: int = 6) -> InProcessConversation:
    """Speak `pcm` (24 kHz mono) to a new session and collect every event: at real-time pace, or
    (`realtime=False`) as fast as the engine answers, at most `max_ahead_frames` ahead of its audio."""
    config = config or SessionConfig()
    if not realtime:  # frames sent ahead on purpose must never be skipped to keep the session live
        config = dataclasses.replace(config, realtime=False)
    conversation = InProcessConversation()
    started = time.monotonic()
    async with await TandemSession.open(runtime, config) as session:
        pace = _Pace(started, realtime, max_ahead_frames)
        collector = asyncio.get_running_loop().create_task(_collect(session, conversation, pace),
                                                           name=f"converse-{session.id}")
        silence = np.zeros(int(tail_s * SAMPLE_RATE), np.float32)
        await _speak(session, pcm, pace)
        conversation.speech_end_s = time.monotonic() - started
        await session.flush()
        await _speak(session, silence, pace)
        await (asyncio.sleep(0.3) if realtime else pace.quiet())  # the last frames and answers come back
        conversation.frames_sent = pace.frames_sent
    await collector
    return conversation


class _Pace:
    """When the next frame may go: its real-time deadline, or enough of the engine's audio back."""

    def __init__(self, started: float, realtime: bool, max_ahead_frames: int) -> None:
        self.started, self.realtime, self.max_ahead = started, realtime, max_ahead_frames
        self.frames_sent = self.frames_back = 0
        self.ended = False  # the session sends nothing more (it failed): nobody waits for its audio
        self.audio_back, self.news = asyncio.Event(), asyncio.Event()

    def on_event(self, event: SessionEvent) -> None:
        if isinstance(event, AssistantAudio):
            self.frames_back += 1
            self.audio_back.set()
        else:
            self.news.set()

    async def wait_turn(self) -> None:
        if self.realtime:
            await _until(self.started + self.frames_sent * FRAME_SIZE / SAMPLE_RATE)
            return
        while not self.ended and self.frames_sent - self.frames_back >= self.max_ahead:
            self.audio_back.clear()
            try:
                await asyncio.wait_for(self.audio_back.wait(), 5.0)
            except TimeoutError:
                return  # a stalled engine: send on (frames over its queue cap are dropped, and counted)

    async def quiet(self, quiet_s: float = 1.0, limit_s: float = 10.0) -> None:
        """Sent faster than real time, the ASR and the LLM may still be catching up: wait for quiet."""
        deadline = time.monotonic() + limit_s
        while not self.ended and time.monotonic() < deadline:
            self.news.clear()
            try:
                await asyncio.wait_for(self.news.wait(), quiet_s)
            except TimeoutError:
                return


async def _speak(session: TandemSession, pcm: np.ndarray, pace: _Pace) -> None:
    for index in range(0, len(pcm), FRAME_SIZE):
        await pace.wait_turn()
        session.push_pcm(pcm[index:index + FRAME_SIZE])
        pace.frames_sent += 1
    await pace.wait_turn()


async def _collect(session: TandemSession, conversation: InProcessConversation, pace: _Pace) -> None:
    try:
        async for event in session:
            conversation.events.append((time.monotonic() - pace.started, event))
            pace.on_event(event)
    finally:
        pace.ended = True
        pace.audio_back.set()
        pace.news.set()


async def _until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
