"""An async Python client of the KAME server (Moshi's protocol plus the KAME extensions)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np
import websockets
from websockets.exceptions import ConnectionClosed, InvalidStatus

from kame.codec import OpusDecoder, OpusEncoder
from kame.errors import KameError
from kame.pcm import pcm16_decode, pcm16_encode
from kame.protocol import (
    FRAME_SIZE,
    SAMPLE_RATE,
    ConfigureMessage,
    Kind,
    ProtocolError,
    ServerEvent,
    decode,
    encode,
    encode_client_message,
    parse_event,
)


class ServerUnreachable(KameError):
    """Nothing answers at the server's address (down, wrong port, no route)."""

    exit_code = 3


class ServerRefused(KameError):
    """The server refused the session; `status`: the HTTP status of its answer (400: a bad query)."""

    exit_code = 5

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status
        if status == 400:
            self.exit_code = 2  # bad input, not bad credentials


class ServerBusy(ServerRefused, ConnectionError):
    """The server refused the session for now: all its slots are in use (HTTP 503 or close code
    1013), or this address has as many sessions as it may (429). Try again later."""

    exit_code = 4

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message, status)


@dataclass(frozen=True)
class AudioMessage:
    pcm: np.ndarray  # float32, 24 kHz mono
    received_s: float  # client clock (time.monotonic)


@dataclass(frozen=True)
class TextMessage:
    text: str
    received_s: float


@dataclass(frozen=True)
class EventMessage:
    event: ServerEvent
    received_s: float


@dataclass(frozen=True)
class ErrorMessage:
    text: str
    received_s: float


ServerMessage = AudioMessage | TextMessage | EventMessage | ErrorMessage


def session_url(url: str, events: bool, audio: str, backend: str | None, extra: dict | None = None) -> str:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query)) | {k: str(v) for k, v in (extra or {}).items()}
    if events:
        query["events"] = "1"
    if audio != "opus":
        query["audio"] = audio
    if backend:
        query["backend"] = backend
    return urlunsplit(parts._replace(query=urlencode(query)))


def _refusal(status: int, body: bytes | None) -> ServerRefused:
    """The server's reason (its JSON `message`, else the body) as the matching error."""
    text = (body or b"").decode(errors="replace")
    with contextlib.suppress(ValueError, AttributeError):
        text = json.loads(text).get("message", text)
    reason = f"the server refused the session (HTTP {status}): {text or 'no reason given'}"
    return ServerBusy(reason, status) if status in (429, 503) else ServerRefused(reason, status)


@contextlib.contextmanager
def opening(url: str):
    """Around a websocket upgrade: a refusal as ServerBusy/ServerRefused with the server's reason, a
    server that cannot be reached as ServerUnreachable (every client of both endpoints)."""
    try:
        yield
    except InvalidStatus as exc:
        raise _refusal(exc.response.status_code, exc.response.body) from exc
    except (OSError, TimeoutError) as exc:
        raise ServerUnreachable(f"cannot reach the server at {url.split('?')[0]}: {exc}") from exc


async def send_paced(send: Callable[[np.ndarray], Awaitable[object]], pcm: np.ndarray,
                     chunk: int = FRAME_SIZE) -> tuple[float, float]:
    """`send` each `chunk` of `pcm` (24 kHz) at real-time pace, on an absolute schedule (no drift);
    the (start, end) times."""
    start = time.monotonic()
    for index in range(0, len(pcm), chunk):
        await send(pcm[index:index + chunk])
        delay = start + (index + chunk) / SAMPLE_RATE - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
    return start, time.monotonic()


class KameClient:
    def __init__(self, ws, audio: str) -> None:
        self.ws, self.audio = ws, audio
        self._encoder, self._decoder = OpusEncoder(), OpusDecoder()
        self.metadata: dict | None = None  # the server's kind-4 message (model, sampling), once it came

    @classmethod
    async def connect(cls, url: str, events: bool = True, audio: str = "opus", backend: str | None = None,
                      open_timeout: float = 30.0, options: dict | None = None) -> KameClient:
        """Connect and wait for the server's handshake. `options`: more query parameters
        (`asr=off`, `oracle_delay=SECONDS`, `token=...`)."""
        with opening(url):
            ws = await websockets.connect(session_url(url, events, audio, backend, options),
                                          open_timeout=open_timeout, max_size=None)
        try:
            first = await ws.recv()
        except ConnectionClosed as exc:
            if exc.rcvd is not None and exc.rcvd.code == 1013:
                raise ServerBusy(exc.rcvd.reason) from exc
            if exc.rcvd is not None and exc.rcvd.code == 1008:  # a bad query (or a refusal after the upgrade)
                raise ServerRefused(f"the server refused the session: {exc.rcvd.reason}", 400) from exc
            raise
        if not isinstance(first, bytes) or first[:1] != bytes([Kind.HANDSHAKE]):
            await ws.close()
            raise ProtocolError(f"expected the handshake, got {first[:16]!r}")
        return cls(ws, audio)

    async def send_pcm(self, pcm: np.ndarray) -> None:
        """Send 24 kHz mono float32 audio (any chunk size)."""
        if self.audio == "pcm":
            await self.ws.send(encode(Kind.PCM, pcm16_encode(pcm)))
        elif data := self._encoder.encode(pcm):
            await self.ws.send(encode(Kind.AUDIO, data))

    async def configure(self, backend: str | None = None, system_prompt: str | None = None) -> None:
        await self.ws.send(encode_client_message(ConfigureMessage(backend=backend, system_prompt=system_prompt)))

    async def send_raw(self, data: bytes | str) -> None:
        await self.ws.send(data)

    async def __aiter__(self) -> AsyncIterator[ServerMessage]:
        try:
            async for raw in self.ws:
                try:
                    message = self._parse(raw)
                except ProtocolError as exc:  # one bad message must not end the conversation
                    message = ErrorMessage(f"unreadable message from the server: {exc}", time.monotonic())
                if message is not None:
                    yield message
        except ConnectionClosed:
            return

    def _parse(self, raw: bytes | str) -> ServerMessage | None:
        now = time.monotonic()
        if isinstance(raw, str):
            return ErrorMessage(f"unexpected text frame: {raw[:80]}", now)
        kind, payload = decode(raw)
        if kind is Kind.AUDIO:
            pcm = self._decoder.decode(payload)
            return AudioMessage(pcm, now) if len(pcm) else None
        if kind is Kind.PCM:
            return AudioMessage(pcm16_decode(payload), now)
        if kind is Kind.TEXT:
            return TextMessage(payload.decode("utf-8", errors="replace"), now)
        if kind is Kind.EVENT:
            return EventMessage(parse_event(payload), now)
        if kind is Kind.ERROR:
            return ErrorMessage(payload.decode("utf-8", errors="replace"), now)
        if kind is Kind.METADATA:
            try:
                self.metadata = json.loads(payload)
            except ValueError as exc:
                raise ProtocolError(f"unreadable metadata: {exc}") from exc
        return None

    @property
    def close_code(self) -> int | None:
        return self.ws.close_code

    async def close(self) -> None:
        await self.ws.close()
