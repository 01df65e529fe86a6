"""Stream an audio file to the server as a user would speak it, and record everything it sends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from client.client import AudioMessage, ErrorMessage, EventMessage, KameClient, ServerMessage, TextMessage
from kame.conversation_log import ConversationLog
from kame.protocol import FRAME_SIZE as FRAME
from kame.protocol import SAMPLE_RATE as RATE
from kame.protocol import session_event
from kame.session_events import AssistantAudio, AssistantText, SessionEvent


@dataclass
class Conversation:
    """What a session produced, with times in seconds since the first frame was sent."""

    started: float = 0.0
    audio: list[np.ndarray] = field(default_factory=list)
    text: list[tuple[float, str]] = field(default_factory=list)
    events: list[tuple[float, dict]] = field(default_factory=list)
    errors: list[tuple[float, str]] = field(default_factory=list)
    frames_sent: int = 0
    input_end_s: float = 0.0  # when the last frame of the input file (before the tail) was sent
    # what came, in order, in the library's types: the events read back, the text and audio as the session's
    typed: list[tuple[float, SessionEvent]] = field(default_factory=list)

    @property
    def assistant_audio(self) -> np.ndarray:
        return np.concatenate(self.audio) if self.audio else np.zeros(0, dtype=np.float32)

    @property
    def assistant_text(self) -> str:
        return "".join(t for _, t in self.text).strip()

    def events_of(self, kind: str) -> list[dict]:
        return [e for _, e in self.events if e.get("type") == kind]

    def log(self) -> ConversationLog:
        """The conversation in the library's types (what the evaluations read, as from a session in process)."""
        return ConversationLog(list(self.typed), speech_end_s=self.input_end_s, frames_sent=self.frames_sent)

    def add(self, message: ServerMessage) -> tuple[float, str, object] | None:
        t = message.received_s - self.started
        if isinstance(message, AudioMessage):
            self.typed.append((t, AssistantAudio(len(self.audio), message.pcm, ready=True, latency_s=None)))
            self.audio.append(message.pcm)
            return None
        if isinstance(message, TextMessage):  # on the wire a text piece has no frame: the frames received before it
            self.typed.append((t, AssistantText(len(self.audio), message.text)))
            self.text.append((t, message.text))
            return t, "text", message.text
        if isinstance(message, EventMessage):
            if (typed := session_event(message.event)) is not None:
                self.typed.append((t, typed))
            event = message.event.model_dump(exclude_none=True)
            self.events.append((t, event))
            return t, "event", event
        if isinstance(message, ErrorMessage):
            self.errors.append((t, message.text))
            return t, "error", message.text
        return None


async def converse(
    url: str,
    pcm: np.ndarray,
    realtime: bool = True,
    tail_s: float = 3.0,
    backend: str | None = None,
    system_prompt: str | None = None,
    on_item: Callable[[tuple[float, str, object]], None] | None = None,
    max_ahead_frames: int = 6,
    options: dict | None = None,
) -> Conversation:
    """Send `pcm` (24 kHz) then `tail_s` of silence; real-time pace, or as fast as the server
    answers (`realtime=False`: at most `max_ahead_frames` frames ahead of the audio received)."""
    if not realtime:  # ask the server not to skip our frames to keep us live: we send ahead on purpose
        options = {"realtime": "0"} | (options or {})
    client = await KameClient.connect(url, events=True, backend=backend, options=options)
    if system_prompt is not None:
        await client.configure(system_prompt=system_prompt)
    conv = Conversation(started=time.monotonic())
    received = asyncio.Event()
    news = asyncio.Event()  # a transcript, LLM, oracle or text message (not audio, not stats)

    async def receive() -> None:
        async for message in client:
            item = conv.add(message)
            if item is not None:
                if on_item is not None:
                    on_item(item)
                if not (item[1] == "event" and item[2].get("type") == "stats"):
                    news.set()
            received.set()

    receiver = asyncio.create_task(receive(), name="client-receive")
    samples = np.concatenate([pcm, np.zeros(int(tail_s * RATE), dtype=np.float32)])
    frames = -(-len(samples) // FRAME)
    input_frames = -(-len(pcm) // FRAME)
    for index in range(frames):
        if realtime:
            delay = conv.started + index * FRAME / RATE - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        else:
            while index - sum(len(a) for a in conv.audio) // FRAME >= max_ahead_frames and not receiver.done():
                received.clear()
                await received.wait()
        await client.send_pcm(samples[index * FRAME:(index + 1) * FRAME])
        conv.frames_sent += 1
        if index + 1 == input_frames:
            conv.input_end_s = time.monotonic() - conv.started
    deadline = time.monotonic() + 5.0
    while sum(len(a) for a in conv.audio) < frames * FRAME - FRAME and time.monotonic() < deadline:
        received.clear()
        try:
            await asyncio.wait_for(received.wait(), deadline - time.monotonic())
        except TimeoutError:
            break
    # sent faster than real time, the ASR and the LLM may still be catching up: wait for 1 s of quiet
    quiet_deadline = time.monotonic() + 10.0
    while time.monotonic() < quiet_deadline:
        news.clear()
        try:
            await asyncio.wait_for(news.wait(), 1.0)
        except TimeoutError:
            break
    await client.close()
    await receiver
    return conv

