"""Drives LiveKit Agents' GPT-Live client (`GPTLiveModel`, livekit-plugins-openai from KAME's dev extra)
against a KAME server outside any LiveKit room: an `AgentSession` whose duplex session gets a question
pushed at real-time pace, with what LiveKit received kept in a `Log`. Used by scripts/livekit_live_check.py
and tests/test_livekit_live.py."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

import numpy as np
from livekit import rtc
from livekit.agents import Agent, AgentSession
from livekit.plugins.openai.realtime import GPTLiveModel

from kame.eval.conditions import words
from kame.pcm import pcm16_encode

RATE = 24000
CHUNK = int(RATE * 0.08)  # one KAME frame per push


class Log:
    """The server's events as LiveKit's plugin received them, the assistant's and the user's words, the
    delegations it saw, and the user's turns as LiveKit closed them (its final transcripts)."""

    def __init__(self) -> None:
        self.types: collections.Counter[str] = collections.Counter()
        self.said = self.heard = ""
        self.delegations: list[str] = []
        self.errors: list[dict] = []
        self.user_turns: list[str] = []
        self.started, self.closed = asyncio.Event(), asyncio.Event()

    def on_event(self, event: dict) -> None:
        kind = event.get("type", "")
        self.types[kind] += 1
        if kind == "session.started":
            self.started.set()
        elif kind == "session.closed":
            self.closed.set()
        elif kind == "session.output_transcript.delta":
            self.said += event.get("delta", "")
        elif kind == "session.input_transcript.delta":
            self.heard += event.get("delta", "")
        elif kind == "error":
            self.errors.append(event)

    def said_words(self) -> str:
        return " ".join(words(self.said))


def answer_with(text: str):
    """Client delegation's backend: every delegation answered with `text` as commentary."""
    return lambda duplex, delegation: duplex.append_commentary(text, delegation_id=delegation.id)


async def converse(agent: Agent, model: GPTLiveModel, audio: np.ndarray, done: Callable[[Log], bool],
                   limit_s: float = 30, on_delegation=None) -> Log:
    """Push `audio` (float32 at 24 kHz, then silence) at real-time pace until `done(log)` holds after the
    audio or `limit_s` of silence has gone by; then close the session (session.close, then session.closed)."""
    log = Log()
    session = AgentSession(llm=model)
    await session.start(agent)  # no room: session.start goes out once the agent's instructions are set
    duplex = agent.duplex_session
    duplex.on("openai_server_event_received", log.on_event)

    @duplex.on("input_audio_transcription_completed")
    def on_user_turn(event) -> None:
        if event.is_final:
            log.user_turns.append(event.transcript)

    @duplex.on("delegation_created")
    def on_created(delegation) -> None:
        log.delegations.append(delegation.id)
        if on_delegation is not None:
            on_delegation(duplex, delegation)

    try:
        await asyncio.wait_for(log.started.wait(), 15)
        pcm = pcm16_encode(np.concatenate([audio, np.zeros(int(RATE * limit_s), np.float32)]))
        loop = asyncio.get_running_loop()
        start, step = loop.time(), CHUNK * 2
        for offset in range(0, len(pcm), step):
            if offset >= len(audio) * 2 and done(log):
                break
            chunk = pcm[offset:offset + step]
            duplex.push_audio(rtc.AudioFrame(data=chunk, sample_rate=RATE, num_channels=1,
                                             samples_per_channel=len(chunk) // 2))
            await asyncio.sleep(max(0.0, start + (offset + step) / (RATE * 2) - loop.time()))
    finally:
        await session.aclose()
        await model.aclose()
    return log
