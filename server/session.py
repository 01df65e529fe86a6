"""The Moshi websocket (`/api/chat`) as an adapter over one `kame.session.TandemSession`.

Tasks, in one TaskGroup: receive (binary messages -> PCM and control), forward (session events
-> Opus, text and JSON messages), send (the one writer to the socket), limits (session length,
server shutdown). Opus runs on the shared codec thread; the session owns its engine slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.exceptions import ConnectionClosed

import kame
from kame.codec import OpusDecoder, OpusEncoder, pcm16_decode, pcm16_encode
from kame.errors import SessionError
from kame.frontend.sampling import SAMPLING_PARAMETERS, Sampling
from kame.protocol import (
    ErrorEvent,
    Kind,
    ProtocolError,
    ReadyEvent,
    StatsEvent,
    decode,
    encode,
    encode_event,
    parse_client_message,
    wire_event,
)
from kame.queues import DropOldestQueue
from kame.session import TandemSession
from kame.session_events import AssistantAudio, AssistantText, SessionFailed, SessionStats
from server.codec_thread import CodecThread
from server.metrics import SessionMetrics
from server.recorder import SessionRecorder
from server.services import Services

logger = logging.getLogger(__name__)

_CLOSED = (RuntimeError, OSError, WebSocketDisconnect, ConnectionClosed)


class _Disconnected(Exception):
    """The client went away."""


class _Ended(Exception):
    """The tandem session ended by itself (its engine slot failed)."""


class _Limit(Exception):
    """A limit ended the session; args: (close code, reason[, error code: "limit" by default])."""


@dataclass(frozen=True)
class SessionOptions:
    events: bool = False  # send JSON events (kind 7)
    audio: str = "opus"  # "opus" (Moshi's) or "pcm" (raw PCM16, kind 9)
    backend: str | None = None
    asr: bool = True  # False (?asr=off): no transcripts, no oracle: the front-end alone (plain Moshi)
    oracle_delay_s: float = 0.0  # hold every oracle update back this long (latency experiments)
    realtime: bool = True  # False (?realtime=0): the client sends faster than real time; no frame is skipped
    sampling: dict[str, float | int] = field(default_factory=dict)  # Moshi's sampling query parameters
    ignored: tuple[str, ...] = ()  # parameters Moshi's clients send that this server cannot honour

    @classmethod
    def from_query(cls, params) -> SessionOptions:
        audio = params.get("audio", "opus")
        if audio not in ("opus", "pcm"):
            raise ProtocolError(f"audio must be 'opus' or 'pcm', not {audio!r}")
        try:
            delay = float(params.get("oracle_delay", "0"))
        except ValueError as exc:
            raise ProtocolError("oracle_delay must be a number of seconds") from exc
        if not 0 <= delay <= 30:
            raise ProtocolError("oracle_delay must be between 0 and 30 seconds")
        asked = {name: params[name] for name in SAMPLING_PARAMETERS if name in params}
        try:
            sampling = {name: getattr(Sampling().updated(asked), name) for name in asked}
        except ValueError as exc:
            raise ProtocolError(str(exc)) from exc
        return cls(_flag(params, "events", False), audio, params.get("backend"), _flag(params, "asr", True), delay,
                   _flag(params, "realtime", True), sampling, tuple(name for name in _IGNORED if name in params))


# Per-session seeds cannot hold in a batch: every slot draws from the one generator of the device.
_IGNORED = ("text_seed", "audio_seed", "seed")


def _flag(params, name: str, default: bool) -> bool:
    value = params.get(name)
    if value is None:
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off", "none"):
        return False
    raise ProtocolError(f"{name} must be 1 or 0, not {value!r}")


class Session:
    def __init__(self, ws: WebSocket, services: Services, options: SessionOptions, codec: CodecThread) -> None:
        self.ws, self.services, self.options, self.codec = ws, services, options, codec
        self.settings = services.settings
        self.id = uuid.uuid4().hex[:12]
        self._send: DropOldestQueue[bytes] = DropOldestQueue(self.settings.send_queue_messages)
        self._opus_in, self._opus_out = OpusDecoder(), OpusEncoder()
        self._recorder: SessionRecorder | None = None
        self._dropped_out = 0
        self._stop: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.ended = asyncio.Event()

    async def open(self) -> TandemSession:
        """Take an engine slot for this connection (SlotsBusy, SessionError)."""
        config = self.settings.session_config(
            backend=self.options.backend, asr=self.options.asr, oracle_delay_s=self.options.oracle_delay_s,
            realtime=self.options.realtime, sampling=self.options.sampling,
            stats_interval_s=self.settings.stats_interval_s if self.options.events else None)
        observers = [SessionMetrics(self.services.metrics)]
        if self.settings.record_dir is not None:
            runtime = self.services.runtime
            self._recorder = SessionRecorder(self.settings.record_dir, self.id, {
                "frontend": runtime.frontend.source, "asr": runtime.asr.name if self.options.asr else "none",
                "backend": self.options.backend or runtime.default_profile,
                "oracle_delay_s": self.options.oracle_delay_s})
            observers.append(self._recorder)
        try:
            return await TandemSession.open(self.services.runtime, config, observers, session_id=self.id)
        except BaseException:
            await self.discard_recording()
            raise

    async def discard_recording(self) -> None:
        """The session does not happen after all: leave no recording behind."""
        if self._recorder is not None:
            recorder, self._recorder = self._recorder, None
            await asyncio.to_thread(recorder.discard)

    async def run(self, tandem: TandemSession) -> None:
        metrics = self.services.metrics
        metrics.sessions_total.inc()
        metrics.active_sessions.inc()
        runtime = self.services.runtime
        try:
            await self._send_now(encode(Kind.HANDSHAKE))
            await self._send_now(encode(Kind.METADATA, json.dumps(self._metadata(tandem)).encode()))
            self._event(ReadyEvent(
                session_id=self.id, frontend=runtime.frontend.source, asr=runtime.asr.name, backend=tandem.backend,
                backends=list(runtime.profiles), system_prompt=tandem.planner.system_prompt,
                audio=self.options.audio))
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._receive(tandem), name=f"ws-{self.id}-receive")
                tasks.create_task(self._forward(tandem), name=f"ws-{self.id}-forward")
                tasks.create_task(self._sender(), name=f"ws-{self.id}-send")
                tasks.create_task(self._limits(), name=f"ws-{self.id}-limits")
        except* _Disconnected:
            logger.info("session %s: client disconnected", self.id)
        except* _Limit as group:
            code, reason, *error = group.exceptions[0].args
            logger.info("session %s closed: %s", self.id, reason)
            self._error(error[0] if error else "limit", reason)
            await self._flush_then_close(code, reason)
        except* _Ended as group:
            await self._flush_then_close(1011, group.exceptions[0].args[0])
        except* Exception:  # a bug must end this session only, with a trace in the log
            logger.exception("session %s failed", self.id)
            await self._close(1011, "internal error")
        finally:
            await tandem.aclose()
            metrics.active_sessions.dec()
            if self._recorder is not None:
                await asyncio.to_thread(self._recorder.close)
            self.ended.set()

    def _metadata(self, tandem: TandemSession) -> dict:
        """The kind-4 message: the facts Moshi's servers send (its web client shows them), and ours."""
        runtime = self.services.runtime
        return {
            **tandem.sampling.as_dict(),  # what this session samples with, after its query parameters
            "lm_model_file": runtime.frontend.source,
            "instance_name": f"kame {kame.__version__}",
            "build_info": {"version": kame.__version__, "device": str(runtime.engine.device)},
            "session_id": self.id,
            "asr": runtime.asr.name if self.options.asr else "none",
            "backend": tandem.backend,
            "max_sessions": runtime.engine.batch_size,
            "ignored_parameters": list(self.options.ignored),
        }

    def shutdown(self, reason: str) -> None:
        """The server is stopping: tell the client and end the session (through its own tasks)."""
        if not self._stop.done():
            self._stop.set_result(reason)

    # ---------------------------------------------------------------- tasks

    async def _receive(self, tandem: TandemSession) -> None:
        flood = _Flood(self.settings.max_messages_per_s)
        while True:
            try:
                async with asyncio.timeout(self.settings.idle_timeout_s):
                    message = await self.ws.receive()
            except TimeoutError as exc:
                raise _Limit(1001, f"no message for {self.settings.idle_timeout_s:.0f} s", "limit") from exc
            except _CLOSED as exc:
                raise _Disconnected from exc
            if flood.over():
                raise _Limit(1008, f"more than {self.settings.max_messages_per_s:.0f} messages/s for 5 s")
            if message["type"] == "websocket.disconnect":
                raise _Disconnected
            try:
                await self._on_message(message.get("bytes"), tandem)
            except (ProtocolError, SessionError) as exc:
                self.services.metrics.protocol_errors.inc()
                self._error("protocol", str(exc))

    async def _on_message(self, data: bytes | None, tandem: TandemSession) -> None:
        if data is None:
            raise ProtocolError("text frames are not part of the protocol: send binary messages")
        if len(data) > self.settings.max_message_bytes:
            raise ProtocolError(f"message of {len(data)} bytes exceeds {self.settings.max_message_bytes}")
        kind, payload = decode(data)
        if kind is Kind.AUDIO:
            tandem.push_pcm(await self.codec.run(self._opus_in.decode, payload))
        elif kind is Kind.PCM:
            tandem.push_pcm(pcm16_decode(payload))
        elif kind is Kind.CLIENT_JSON:
            message = parse_client_message(payload)
            tandem.configure(backend=message.backend, system_prompt=message.system_prompt)
        elif kind is not Kind.PING:
            raise ProtocolError(f"a client may not send message kind {int(kind)} ({kind.name.lower()})")

    async def _forward(self, tandem: TandemSession) -> None:
        async for event in tandem:
            if isinstance(event, AssistantAudio):
                if self.options.audio == "pcm":
                    self._send.put(encode(Kind.PCM, pcm16_encode(event.pcm)), droppable=True)
                elif opus := await self.codec.run(self._opus_out.encode, event.pcm):
                    self._send.put(encode(Kind.AUDIO, opus), droppable=True)
                self._count_dropped(tandem)
            elif isinstance(event, AssistantText):
                self._send.put(encode(Kind.TEXT, event.text.encode()))
            elif isinstance(event, SessionStats):
                self._event(StatsEvent(frames_in=event.frames_in, frames_out=event.frames_out,
                                       frames_dropped=event.frames_dropped + self._send.dropped,
                                       frame_latency_ms=event.frame_latency_ms), record=False)
            elif isinstance(event, SessionFailed):
                self._error(event.code, event.message, record=False)
                raise _Ended("engine failure" if event.code == "engine" else "internal error")
            elif self.options.events and (wire := wire_event(event)) is not None:
                self._send.put(encode_event(wire))
        raise _Ended("the session ended")

    def _count_dropped(self, tandem: TandemSession) -> None:
        """Audio this client read too slowly to get, in the session's queue or the socket's."""
        dropped = tandem.dropped_events + self._send.dropped
        if dropped > self._dropped_out:
            self.services.metrics.frames_dropped.labels("out").inc(dropped - self._dropped_out)
            self._dropped_out = dropped

    async def _sender(self) -> None:
        while True:
            await self._send_now(await self._send.get())

    async def _send_now(self, message: bytes) -> None:
        try:
            async with asyncio.timeout(self.settings.send_timeout_s):
                await self.ws.send_bytes(message)
        except TimeoutError as exc:
            raise _Limit(1008, f"the client has not read for {self.settings.send_timeout_s:.0f} s") from exc
        except _CLOSED as exc:
            raise _Disconnected from exc

    async def _limits(self) -> None:
        """The session's length limit, and the server's shutdown."""
        limit_s = self.settings.max_session_s
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(limit_s):
                raise _Limit(1001, await asyncio.shield(self._stop), "shutdown")
        raise _Limit(1000, f"the session reached its {limit_s:.0f} s limit")

    # ---------------------------------------------------------------- closing

    async def _flush_then_close(self, code: int, reason: str, limit_s: float = 1.0) -> None:
        """Send what is queued (the error event above all), briefly, then close: the tasks are over."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(limit_s):
                while len(self._send):
                    await self.ws.send_bytes(self._send.get_nowait())
        await self._close(code, reason)

    async def _close(self, code: int, reason: str) -> None:
        with contextlib.suppress(*_CLOSED):  # already closed
            await self.ws.close(code, reason)

    # ---------------------------------------------------------------- helpers

    def _event(self, event, record: bool = True) -> None:
        if record and self._recorder is not None:
            self._recorder.write_event(event.model_dump(exclude_none=True))
        if self.options.events:
            self._send.put(encode_event(event))

    def _error(self, code: str, message: str, record: bool = True) -> None:
        if self.options.events:
            self._event(ErrorEvent(code=code, message=message), record)
        else:
            if record and self._recorder is not None:
                self._recorder.write_event({"type": "error", "code": code, "message": message})
            self._send.put(encode(Kind.ERROR, message.encode()))


class _Flood:
    """Counts client messages per second; `over()` is true after 5 s in a row above the limit."""

    def __init__(self, per_second: float, patience_s: int = 5) -> None:
        self.per_second, self.patience_s = per_second, patience_s
        self._second, self._count, self._bad_seconds = int(time.monotonic()), 0, 0

    def over(self) -> bool:
        now = int(time.monotonic())
        if now != self._second:
            self._bad_seconds = self._bad_seconds + 1 if self._count > self.per_second else 0
            self._second, self._count = now, 0
        self._count += 1
        return self._bad_seconds >= self.patience_s
