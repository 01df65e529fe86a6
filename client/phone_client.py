"""The carrier's side of one phone call, for `kame bench load --transport twilio|telnyx|vonage`: it opens
`/<carrier>/media` as the carrier's media stream would, sends the caller's audio as the line carries it
(20 ms messages), and plays the server's audio in a simulated playout buffer: a mark goes back once the
audio before it has played, as the carrier's does, so the server's pacer (server/phone/pacer.py) is
measured against a real-time listener. It records the lead it held (audio received, not yet played).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import websockets

from client.client import opening
from kame.audio import FRAME_S, SAMPLE_RATE
from kame.clock import Clock, MonotonicClock
from kame.pcm import Resampler, pcm16_decode, pcm16_encode, ulaw_decode, ulaw_encode

CARRIERS = ("twilio", "telnyx", "vonage")  # each a transport of the load benchmark
CHUNK_S = 0.02  # the line's audio goes up in 20 ms messages, as a carrier sends it


@dataclass(frozen=True)
class LineAudio:
    """How a line carries audio: its rate, bytes a sample, and its coding from and to float32."""

    rate: int
    width: int
    encode: Callable[[np.ndarray], bytes]
    decode: Callable[[bytes], np.ndarray]

    def bytes_for(self, seconds: float) -> int:
        return round(self.rate * seconds) * self.width


MULAW_8K = LineAudio(8000, 1, ulaw_encode, ulaw_decode)
L16_16K = LineAudio(16000, 2, pcm16_encode, pcm16_decode)


# -------------------------------------------------------------------- what the server says


@dataclass(frozen=True)
class Mark:
    token: object  # what goes back once the audio before it has played (a name, or Vonage's payload)


@dataclass(frozen=True)
class Clear:
    """Drop the audio not yet played."""


Said = bytes | Mark | Clear  # bytes: the assistant's audio, in the line's coding


class JsonMedia:
    """Twilio's and Telnyx's media streams: JSON text frames both ways, mu-law at 8 kHz in base64 payloads;
    every message names the stream (Twilio's `streamSid`, Telnyx's `stream_id`)."""

    line = MULAW_8K

    def __init__(self, carrier: str) -> None:
        tag = uuid.uuid4().hex
        if carrier == "twilio":
            self.stream = {"streamSid": f"MZ{tag}"}
            self._start = {**self.stream, "callSid": f"CA{tag}", "customParameters": {},
                           "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}
        else:
            self.stream = {"stream_id": tag}
            self._start = {"call_control_id": f"v3:{tag}", "custom_parameters": {},
                           "media_format": {"encoding": "PCMU", "sample_rate": 8000, "channels": 1}}

    def _event(self, event: str, **body) -> str:
        return json.dumps({"event": event, **self.stream, **body})

    def opening(self) -> list[str | bytes]:
        return [json.dumps({"event": "connected", "version": "1.0.0"}), self._event("start", start=self._start)]

    def media(self, data: bytes) -> str | bytes:
        return self._event("media", media={"track": "inbound", "payload": base64.b64encode(data).decode()})

    def marked(self, token: object) -> list[str | bytes]:
        return [self._event("mark", mark={"name": token})]

    def cleared(self) -> list[str | bytes]:
        return []  # the marks a clear dropped come back, nothing else

    def stop(self) -> list[str | bytes]:
        return [self._event("stop")]

    def read(self, message: str | bytes) -> Said | None:
        data = json.loads(message)
        match data.get("event"):
            case "media":
                return base64.b64decode(data["media"]["payload"])
            case "mark":
                return Mark(data["mark"]["name"])
            case "clear":
                return Clear()
        return None


class VonageMedia:
    """Vonage's Voice API WebSocket: a `websocket:connected` text message with the NCCO's headers, then
    16-bit PCM at 16 kHz as binary frames both ways; `notify` and `clear` are JSON actions. No stop message:
    a hang-up closes the socket."""

    line = L16_16K

    def opening(self) -> list[str | bytes]:
        return [json.dumps({"event": "websocket:connected", "content-type": "audio/l16;rate=16000",
                            "uuid": str(uuid.uuid4())})]

    def media(self, data: bytes) -> str | bytes:
        return data

    def marked(self, token: object) -> list[str | bytes]:
        return [json.dumps({"event": "websocket:notify", "payload": token})]

    def cleared(self) -> list[str | bytes]:
        return [json.dumps({"event": "websocket:cleared"})]

    def stop(self) -> list[str | bytes]:
        return []

    def read(self, message: str | bytes) -> Said | None:
        if isinstance(message, bytes):
            return message
        data = json.loads(message)
        return {"notify": Mark(data.get("payload")), "clear": Clear()}.get(data.get("action"))


def carrier_media(carrier: str) -> JsonMedia | VonageMedia:
    return VonageMedia() if carrier == "vonage" else JsonMedia(carrier)


def phone_url(url: str, carrier: str) -> str:
    """A server URL (ws://HOST:PORT or any of its paths) as the carrier's media stream URL."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{carrier}/media", "", ""))


# -------------------------------------------------------------------- the playout


class Playout:
    """The carrier's playback: audio plays back to back in real time from its arrival (or from the end of
    what is ahead of it); a mark falls due once the audio received before it has played; a clear drops
    what has not played and hands back the marks still pending. Times in, nothing read."""

    def __init__(self) -> None:
        self.ends = 0.0  # when the audio received so far will have played
        self._marks: collections.deque[tuple[float, object]] = collections.deque()  # (due, token)

    def push(self, seconds: float, now: float) -> float:
        """Audio arrived; the lead after it (seconds received and not yet played)."""
        self.ends = max(self.ends, now) + seconds
        return self.ends - now

    def mark(self, token: object, now: float) -> None:
        self._marks.append((max(self.ends, now), token))

    def next_due(self) -> float | None:
        return self._marks[0][0] if self._marks else None

    def due(self, now: float) -> list[object]:
        tokens = []
        while self._marks and self._marks[0][0] <= now:
            tokens.append(self._marks.popleft()[1])
        return tokens

    def clear(self, now: float) -> list[object]:
        self.ends = min(self.ends, now)
        tokens = [token for _, token in self._marks]
        self._marks.clear()
        return tokens


# -------------------------------------------------------------------- the call


class PhoneCall:
    """One call: `send_pcm` (24 kHz float32 frames) up the line, `audio()` the server's audio as it arrives
    (a 24 kHz frame per 80 ms of it, no frame index on the wire), marks back as their audio plays."""

    def __init__(self, ws, media: JsonMedia | VonageMedia, clock: Clock | None = None) -> None:
        self.ws, self.media, self.line = ws, media, media.line
        self.clock = clock or MonotonicClock()
        self.playout = Playout()
        self.leads: list[float] = []  # the lead (s) as each piece of the server's audio arrived
        self._down, self._up = Resampler(SAMPLE_RATE, self.line.rate), Resampler(self.line.rate, SAMPLE_RATE)
        self._back = bytearray()  # the server's audio not yet a whole frame

    @classmethod
    async def connect(cls, url: str, carrier: str) -> PhoneCall:
        target = phone_url(url, carrier)
        with opening(target):
            ws = await websockets.connect(target, max_size=None, open_timeout=30)
        call = cls(ws, carrier_media(carrier))
        for message in call.media.opening():
            await ws.send(message)
        return call

    @property
    def max_lead_s(self) -> float:
        return max(self.leads, default=0.0)

    @property
    def lead_p99_s(self) -> float:
        return float(np.percentile(self.leads, 99)) if self.leads else 0.0

    async def send_pcm(self, pcm: np.ndarray) -> None:
        data, step = self.line.encode(self._down(pcm)), self.line.bytes_for(CHUNK_S)
        for start in range(0, len(data), step):
            await self.ws.send(self.media.media(data[start:start + step]))

    # ---------------------------------------------------------------- the carrier's side, pure

    def received(self, message: str | bytes) -> tuple[list[np.ndarray], list[str | bytes]]:
        """A message from the server: the whole frames of audio it completes (24 kHz), and the replies due
        at once (the marks a clear hands back)."""
        said, now = self.media.read(message), self.clock.now()
        if isinstance(said, bytes):
            self.leads.append(self.playout.push(len(said) / self.line.bytes_for(1.0), now))
            self._back += said
            return self._frames(), []
        if isinstance(said, Mark):
            self.playout.mark(said.token, now)
        elif isinstance(said, Clear):
            return [], [*self._marked(self.playout.clear(now)), *self.media.cleared()]
        return [], []

    def returns(self) -> list[str | bytes]:
        """The marks whose audio has played by now."""
        return self._marked(self.playout.due(self.clock.now()))

    def _marked(self, tokens: list[object]) -> list[str | bytes]:
        return [reply for token in tokens for reply in self.media.marked(token)]

    def _frames(self) -> list[np.ndarray]:
        size, frames = self.line.bytes_for(FRAME_S), []
        while len(self._back) >= size:
            frames.append(self._up(self.line.decode(bytes(self._back[:size]))))
            del self._back[:size]
        return frames

    # ---------------------------------------------------------------- the socket

    async def audio(self) -> AsyncIterator[tuple[int | None, np.ndarray]]:
        """The server's audio, a frame at a time as it arrives; the marks go back meanwhile (while this
        runs: the benchmark reads it for the whole call)."""
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                for reply in self.returns():
                    await self.ws.send(reply)
                due = self.playout.next_due()
                try:
                    async with asyncio.timeout(None if due is None else max(0.0, due - self.clock.now())):
                        message = await self.ws.recv()  # (cancelling a recv loses nothing)
                except TimeoutError:
                    continue
                frames, replies = self.received(message)
                for reply in replies:
                    await self.ws.send(reply)
                for pcm in frames:
                    yield None, pcm

    async def close(self) -> None:
        """Twilio and Telnyx say `stop`; Vonage's call just ends."""
        with contextlib.suppress(websockets.ConnectionClosed):
            for message in self.media.stop():
                await self.ws.send(message)
        await self.ws.close()
