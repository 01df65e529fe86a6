"""Clients of the OpenAI-Realtime endpoint `/v1/realtime`.

`converse_realtime` streams an audio file through the real `openai` SDK (what `kame client
--realtime-api` runs, and the proof that the SDK works against the server); `RealtimeAudio` is a
lean JSON client of the same protocol for the load benchmark, where the SDK's parsing of every
event would be measured instead of the server.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np
import websockets

from client.client import opening, send_paced
from kame.pcm import pcm16_decode, pcm16_encode
from kame.protocol import SAMPLE_RATE as RATE

REALTIME_PATH = "/v1/realtime"


def realtime_url(url: str, **params: str) -> str:
    """A server URL (ws://HOST:PORT, .../api/chat or .../v1/realtime) as its /v1/realtime URL."""
    parts = urlsplit(url)
    query = urlencode(dict(parse_qsl(parts.query)) | params)
    return urlunsplit((parts.scheme, parts.netloc, REALTIME_PATH, query, ""))


def sdk_base_url(url: str) -> str:
    """What the openai SDK takes as `base_url` for the server at `url` (it appends /realtime)."""
    parts = urlsplit(url)
    return f"{'https' if parts.scheme == 'wss' else 'http'}://{parts.netloc}/v1"


@dataclass
class RealtimeConversation:
    started: float = 0.0
    audio: list[np.ndarray] = field(default_factory=list)
    transcripts: list[str] = field(default_factory=list)  # the user's, completed
    responses: list[str] = field(default_factory=list)  # the assistant's, one per response
    errors: list[dict] = field(default_factory=list)
    frames_sent: int = 0

    @property
    def assistant_audio(self) -> np.ndarray:
        return np.concatenate(self.audio) if self.audio else np.zeros(0, dtype=np.float32)

    @property
    def assistant_text(self) -> str:
        return " ".join(r for r in self.responses if r).strip()


async def converse_realtime(url: str, pcm: np.ndarray, token: str | None = None, tail_s: float = 3.0,
                            instructions: str | None = None,
                            on_line: Callable[[float, str], None] | None = None) -> RealtimeConversation:
    """Speak `pcm` (24 kHz) at real-time pace through the openai SDK, then `tail_s` of silence."""
    from openai import AsyncOpenAI

    conv = RealtimeConversation()
    show = on_line or (lambda t, line: None)
    client = AsyncOpenAI(base_url=sdk_base_url(url), api_key=token or "none")
    connection = client.realtime.connect(model="kame")
    with opening(realtime_url(url)):
        conn = await connection.__aenter__()
    try:
        if instructions:
            await conn.session.update(session={"type": "realtime", "instructions": instructions})

        speaking: dict[str, str] = {}  # response id -> its transcript so far

        async def receive() -> None:
            async for event in conn:
                t = time.monotonic() - conv.started
                if event.type == "response.output_audio.delta":
                    conv.audio.append(pcm16_decode(base64.b64decode(event.delta)))
                elif event.type == "response.output_audio_transcript.delta":
                    speaking[event.response_id] = speaking.get(event.response_id, "") + event.delta
                elif event.type == "conversation.item.input_audio_transcription.completed":
                    conv.transcripts.append(event.transcript)
                    show(t, f"user: {event.transcript}")
                elif event.type == "response.output_audio_transcript.done":
                    speaking.pop(event.response_id, None)
                    conv.responses.append(event.transcript)
                    show(t, f"assistant: {event.transcript}")
                elif event.type == "input_audio_buffer.speech_started":
                    show(t, "user speaking")
                elif event.type == "error":
                    conv.errors.append(event.error.model_dump())
                    show(t, f"error: {event.error.message}")

        async def send(chunk: np.ndarray) -> None:
            await conn.input_audio_buffer.append(audio=base64.b64encode(pcm16_encode(chunk)).decode())
            conv.frames_sent += 1

        reader = asyncio.create_task(receive())
        conv.started = time.monotonic()
        await send_paced(send, np.concatenate([pcm, np.zeros(int(tail_s * RATE), dtype=np.float32)]))
        await asyncio.sleep(1.0)  # the last response's done events
        reader.cancel()
        conv.responses.extend(text.strip() for text in speaking.values())  # still speaking at the end
    finally:
        await connection.__aexit__(None, None, None)
    return conv


class RealtimeAudio:
    """A lean /v1/realtime client: PCM16 at 24 kHz in, the output audio deltas out."""

    def __init__(self, ws) -> None:
        self.ws = ws

    @classmethod
    async def connect(cls, url: str, token: str | None = None, session: dict | None = None) -> RealtimeAudio:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        with opening(realtime_url(url)):
            ws = await websockets.connect(realtime_url(url, model="kame"), additional_headers=headers, max_size=None)
        client = cls(ws)
        await client.expect("session.created")
        if session:
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", **session}}))
            await client.expect("session.updated")
        return client

    async def expect(self, kind: str) -> dict:
        while True:
            event = json.loads(await self.ws.recv())
            if event["type"] == kind:
                return event
            if event["type"] == "error":
                raise RuntimeError(f"the server answered {kind} with an error: {event['error']['message']}")

    async def send_pcm(self, pcm: np.ndarray) -> None:
        await self.ws.send(json.dumps({"type": "input_audio_buffer.append",
                                       "audio": base64.b64encode(pcm16_encode(pcm)).decode()}))

    async def audio(self) -> AsyncIterator[tuple[int | None, np.ndarray]]:
        """The assistant's audio, delta by delta, until the socket closes: (the session's frame index,
        when the session asked for kame events, else None; PCM)."""
        async for raw in self.ws:
            event = json.loads(raw)
            if event["type"] == "response.output_audio.delta":
                yield event.get("kame_frame"), pcm16_decode(base64.b64decode(event["delta"]))

    async def close(self) -> None:
        await self.ws.close()
