"""A spoken question through a real tandem session in this process: no server, no socket.

The audio is pushed at real-time pace (the ASR, the planner's restarts and the LLM see the
timing a user would give them), then `tail_s` of silence while the answer is spoken (and more while the
session is still busy); or, with
`realtime=False`, as fast as the engine answers. Its transports' twins are `client.conversation`
(Moshi's websocket) and `client.realtime_client` (OpenAI Realtime). `ConversationLog` is what both
this and a websocket conversation (`client.conversation.Conversation.log`) give the evaluations: the
session's events in the library's types, timed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np

from kame.audio import FRAME_SIZE, SAMPLE_RATE
from kame.conversation_log import ConversationLog
from kame.runtime import Runtime
from kame.session import SessionConfig, TandemSession
from kame.session_events import AssistantAudio, SessionEvent

QUIET_S = 1.5  # after the tail: the session is done once this long passed with no event but its audio
QUIET_LIMIT_S = 10.0  # and the user waits at most this much longer for it


async def converse_in_process(runtime: Runtime, pcm: np.ndarray, config: SessionConfig | None = None,
                              tail_s: float = 4.0, realtime: bool = True,
                              max_ahead_frames: int = 6) -> ConversationLog:
    """Speak `pcm` (24 kHz mono) to a new session and collect every event: at real-time pace, or
    (`realtime=False`) as fast as the engine answers, at most `max_ahead_frames` ahead of its audio.
    After `tail_s` of silence the user stays silent while the session is still busy (a loaded machine's ASR
    lags by seconds, and the front-end says the answer only while it is given frames): until nothing but
    audio came for QUIET_S, at most QUIET_LIMIT_S more."""
    config = config or SessionConfig()
    if not realtime:  # frames sent ahead on purpose must never be skipped to keep the session live
        config = dataclasses.replace(config, realtime=False)
    conversation = ConversationLog()
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
        if realtime:
            await _silent_until_quiet(session, pace)
            await asyncio.sleep(0.3)  # the last frames come back
        else:
            await pace.quiet()  # the last frames and answers come back
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


async def _silent_until_quiet(session: TandemSession, pace: _Pace) -> None:
    """Silence at real time until QUIET_S passed with no event but audio, at most QUIET_LIMIT_S."""
    frame = np.zeros(FRAME_SIZE, np.float32)
    now = time.monotonic()
    deadline, last_news = now + QUIET_LIMIT_S, now
    pace.news.clear()
    while not pace.ended and now < deadline:
        if pace.news.is_set():
            pace.news.clear()
            last_news = now
        elif now - last_news >= QUIET_S:
            return
        await pace.wait_turn()
        session.push_pcm(frame)
        pace.frames_sent += 1
        now = time.monotonic()


async def _speak(session: TandemSession, pcm: np.ndarray, pace: _Pace) -> None:
    for index in range(0, len(pcm), FRAME_SIZE):
        await pace.wait_turn()
        session.push_pcm(pcm[index:index + FRAME_SIZE])
        pace.frames_sent += 1
    await pace.wait_turn()


async def _collect(session: TandemSession, conversation: ConversationLog, pace: _Pace) -> None:
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
