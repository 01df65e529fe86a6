"""One websocket session: its engine slot, ASR stream, planner and conversation, in one TaskGroup.

Tasks: receive (client audio and control), engine (assistant audio and text back), asr
(transcripts into the planner), send (one writer to the socket), stats. Cleanup runs in
`finally` on every exit path: the slot, the ASR stream and the LLM stream are released.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import statistics
import time
import uuid
from collections import deque
from dataclasses import dataclass

import numpy as np
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.exceptions import ConnectionClosed

from kame.asr import NoAsr
from kame.asr.events import AsrFailure, FinalTranscript, PartialTranscript
from kame.backend.planner import (
    AttemptFinished,
    AttemptFirstToken,
    AttemptStarted,
    BackendSwitched,
    OracleEmitted,
    Planner,
    PlannerEvent,
)
from kame.codec import FrameSplitter, OpusDecoder, OpusEncoder, pcm16_decode, pcm16_encode
from kame.frontend.engine import FrameOutput
from kame.frontend.oracle import piece_text
from kame.frontend.runner import SlotHandle
from kame.protocol import (
    SAMPLE_RATE,
    AsrStatusEvent,
    BackendEvent,
    ConfigureMessage,
    ErrorEvent,
    Kind,
    LLMEvent,
    OracleEvent,
    ProtocolError,
    ReadyEvent,
    StatsEvent,
    TranscriptEvent,
    decode,
    encode,
    encode_event,
    parse_client_message,
)
from server.recorder import SessionRecorder
from server.send_queue import SendQueue
from server.services import Services

logger = logging.getLogger(__name__)


class _Disconnected(Exception):
    """The client went away."""


class _EngineFailed(Exception):
    pass


class _Limit(Exception):
    """A limit ended the session; args: (close code, reason)."""


@dataclass(frozen=True)
class SessionOptions:
    events: bool = False  # send JSON events (kind 7)
    audio: str = "opus"  # "opus" (Moshi's) or "pcm" (raw PCM16, kind 9)
    backend: str | None = None
    asr: bool = True  # False (?asr=off): no transcripts, no oracle: the front-end alone (plain Moshi)
    oracle_delay_s: float = 0.0  # hold every oracle update back this long (latency experiments)

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
        return cls(params.get("events", "0").lower() in ("1", "true", "yes"), audio, params.get("backend"),
                   params.get("asr", "on").lower() not in ("off", "0", "none", "false"), delay)


class Session:
    def __init__(self, ws: WebSocket, services: Services, options: SessionOptions) -> None:
        self.ws, self.services, self.options = ws, services, options
        self.settings = services.settings
        self.id = uuid.uuid4().hex[:12]
        self._loop = asyncio.get_running_loop()
        self._outputs: asyncio.Queue[FrameOutput | BaseException] = asyncio.Queue()
        self._send = SendQueue(self.settings.send_queue_messages)
        self._splitter = FrameSplitter()
        self._opus_in, self._opus_out = OpusDecoder(), OpusEncoder()
        self._frame_pushed_at: deque[float] = deque()
        self._latencies: deque[float] = deque(maxlen=100)
        self._audio_wall: deque[tuple[float, float]] = deque(maxlen=2000)  # (audio end s, wall time received)
        self._samples_in = 0
        self.frames_in = self.frames_out = self._dropped_seen = 0
        self._oracle_text: dict[int, str] = {}
        backend = options.backend or self.settings.default_profile
        if backend not in services.profiles:
            raise ProtocolError(f"unknown backend profile {backend!r}; known: {', '.join(services.profiles)}")
        self.backend = backend
        self.handle: SlotHandle | None = None
        self.planner: Planner | None = None
        self._asr_ok = True
        self._recorder: SessionRecorder | None = None
        self.ended = asyncio.Event()
        self._started = time.monotonic()
        self._closing: str | None = None

    # ---------------------------------------------------------------- engine thread -> loop

    def on_output_threadsafe(self, output: FrameOutput) -> None:
        self._loop.call_soon_threadsafe(self._outputs.put_nowait, output)

    def on_error_threadsafe(self, exc: BaseException) -> None:
        self._loop.call_soon_threadsafe(self._outputs.put_nowait, exc)

    # ---------------------------------------------------------------- lifecycle

    async def run(self, handle: SlotHandle) -> None:
        self.handle = handle
        services = self.services
        metrics = services.metrics
        metrics.sessions_total.inc()
        metrics.active_sessions.inc()
        asr_stream = services.asr.open_stream() if self.options.asr else NoAsr().open_stream()
        self.planner = Planner(services.llm(self.backend), services.frontend.tokenizer, self._send_oracle,
                               self._on_planner_event, self.settings.planner_config())
        logger.info("session %s started (slot %d, backend %s)", self.id, handle.slot, self.backend)
        if self.settings.record_dir is not None:
            self._recorder = SessionRecorder(self.settings.record_dir, self.id, {
                "frontend": services.frontend.source, "asr": services.asr.name if self.options.asr else "none",
                "backend": self.backend, "oracle_delay_s": self.options.oracle_delay_s,
                "system_prompt": self.planner.system_prompt})
        try:
            await self._send_now(encode(Kind.HANDSHAKE))
            self._event(ReadyEvent(
                session_id=self.id, frontend=services.frontend.source, asr=services.asr.name, backend=self.backend,
                backends=list(services.profiles), system_prompt=self.planner.system_prompt, audio=self.options.audio))
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._receive(asr_stream), name=f"session-{self.id}-receive")
                tasks.create_task(self._engine_output(), name=f"session-{self.id}-engine")
                tasks.create_task(self._asr_events(asr_stream), name=f"session-{self.id}-asr")
                tasks.create_task(self._sender(), name=f"session-{self.id}-send")
                tasks.create_task(self._watchdog(asr_stream), name=f"session-{self.id}-watchdog")
                if self.options.events:
                    tasks.create_task(self._stats(), name=f"session-{self.id}-stats")
        except* _Disconnected:
            logger.info("session %s: client disconnected", self.id)
        except* _Limit as group:
            code, reason = group.exceptions[0].args
            logger.info("session %s closed: %s", self.id, reason)
            self._error("limit", reason)
            await self._flush_then_close(code, reason)
        except* _EngineFailed:
            logger.error("session %s ended: the engine failed on its slot", self.id)
            await self._close(1011, "engine failure")
        except* Exception:  # a bug must end this session only, with a trace in the log
            logger.exception("session %s failed", self.id)
            await self._close(1011, "internal error")
        finally:
            handle.release()
            await asr_stream.aclose()
            await self.planner.aclose()
            metrics.active_sessions.dec()
            metrics.free_slots.set(services.runner.free_slots)
            if self._recorder is not None:
                self._recorder.close()
            self.ended.set()
            logger.info("session %s ended after %d frames", self.id, self.frames_in)

    async def _close(self, code: int, reason: str) -> None:
        with contextlib.suppress(RuntimeError, OSError):  # already closed
            await self.ws.close(code, reason)

    # ---------------------------------------------------------------- tasks

    async def _receive(self, asr_stream) -> None:
        flood = _Flood(self.settings.max_messages_per_s)
        while True:
            try:
                async with asyncio.timeout(self.settings.idle_timeout_s):
                    message = await self.ws.receive()
            except TimeoutError as exc:
                raise _Limit(1001, f"no message for {self.settings.idle_timeout_s:.0f} s") from exc
            except (RuntimeError, OSError, WebSocketDisconnect, ConnectionClosed) as exc:
                raise _Disconnected from exc
            if flood.over():
                raise _Limit(1008, f"more than {self.settings.max_messages_per_s:.0f} messages/s for 5 s")
            if message["type"] == "websocket.disconnect":
                raise _Disconnected
            data = message.get("bytes")
            try:
                if data is None:
                    raise ProtocolError("text frames are not part of the protocol: send binary messages")
                if len(data) > self.settings.max_message_bytes:
                    raise ProtocolError(f"message of {len(data)} bytes exceeds {self.settings.max_message_bytes}")
                self._on_message(*decode(data), asr_stream)
            except ProtocolError as exc:
                self.services.metrics.protocol_errors.inc()
                self._error("protocol", str(exc))

    def _on_message(self, kind: Kind, payload: bytes, asr_stream) -> None:
        if kind is Kind.AUDIO:
            self._on_pcm(self._opus_in.decode(payload), asr_stream)
        elif kind is Kind.PCM:
            self._on_pcm(pcm16_decode(payload), asr_stream)
        elif kind is Kind.CLIENT_JSON:
            self._configure(parse_client_message(payload))
        elif kind is Kind.PING:
            pass
        else:
            raise ProtocolError(f"a client may not send message kind {int(kind)} ({kind.name.lower()})")

    def _on_pcm(self, pcm: np.ndarray, asr_stream) -> None:
        if not len(pcm):
            return
        now = time.monotonic()
        self._samples_in += len(pcm)
        if self._recorder is not None:
            self._recorder.write_input(pcm)
        self._audio_wall.append((self._samples_in / SAMPLE_RATE, now))
        if self._asr_ok:
            asr_stream.push_pcm(pcm)
        for frame in self._splitter.push(pcm):
            self._frame_pushed_at.append(now)
            self.handle.push_frame(frame)
            self.frames_in += 1

    def _configure(self, message: ConfigureMessage) -> None:
        if message.backend is not None:
            if message.backend not in self.services.profiles:
                raise ProtocolError(f"unknown backend profile {message.backend!r}; "
                                    f"known: {', '.join(self.services.profiles)}")
            if message.backend != self.backend:
                self.backend = message.backend
                self.planner.set_llm(self.services.llm(message.backend))
        if message.system_prompt is not None:
            self.planner.set_system_prompt(message.system_prompt)
        profile = self.services.profiles[self.backend]
        self._event(BackendEvent(name=self.backend, model=profile.model, system_prompt=self.planner.system_prompt))

    async def _engine_output(self) -> None:
        tokenizer = self.services.frontend.tokenizer
        while True:
            output = await self._outputs.get()
            if isinstance(output, BaseException):
                self._error("engine", f"the engine failed: {output}")
                raise _EngineFailed from output
            self._account_latency()
            self.frames_out += 1
            if self._recorder is not None:
                self._recorder.write_output(output.pcm)
            if self.options.audio == "pcm":
                self._send.put(encode(Kind.PCM, pcm16_encode(output.pcm)), droppable=True)
            elif opus := self._opus_out.encode(output.pcm):
                self._send.put(encode(Kind.AUDIO, opus), droppable=True)
            if output.text_token is not None and tokenizer is not None:
                piece = piece_text(tokenizer, output.text_token)
                self._send.put(encode(Kind.TEXT, piece.encode()))
                self.planner.on_assistant_text(piece)
                if self._recorder is not None:
                    self._recorder.write_event({"type": "text", "frame": output.frame, "text": piece})
            for applied in output.applied:
                self._on_applied(applied)

    def _account_latency(self) -> None:
        dropped = self.handle.dropped_frames
        for _ in range(dropped - self._dropped_seen):  # frames the runner dropped never come out
            if self._frame_pushed_at:
                self._frame_pushed_at.popleft()
                self.services.metrics.frames_dropped.labels("in").inc()
        self._dropped_seen = dropped
        if self._frame_pushed_at:
            latency = time.monotonic() - self._frame_pushed_at.popleft()
            self._latencies.append(latency)
            self.services.metrics.frame_latency.observe(latency)

    def _on_applied(self, applied) -> None:
        metrics = self.services.metrics
        update = applied.update
        seen = len(update.tokens) - applied.late_tokens
        metrics.oracle_tokens.labels("applied" if applied.accepted else "dropped").inc(
            seen if applied.accepted else len(update.tokens))
        metrics.oracle_tokens.labels("late").inc(applied.late_tokens)
        self._event(OracleEvent(op=update.op.value, epoch=update.epoch, text=self._oracle_text.pop(id(update), ""),
                                tokens=len(update.tokens), frame=applied.frame, accepted=applied.accepted,
                                late_tokens=applied.late_tokens))

    async def _asr_events(self, asr_stream) -> None:
        async for event in asr_stream:
            if isinstance(event, AsrFailure):
                logger.warning("session %s: ASR failed (%s); going on without oracle updates", self.id, event.message)
                self._event(AsrStatusEvent(status="failed", message=event.message))
                return
            if isinstance(event, PartialTranscript):
                self.services.metrics.asr_partial_lag.observe(self._lag(event.end_s))
            self.planner.on_transcript(event)
            self._event(TranscriptEvent(final=isinstance(event, FinalTranscript), text=event.text,
                                        start_s=round(event.start_s, 3), end_s=round(event.end_s, 3)))

    def _lag(self, audio_s: float) -> float:
        index = bisect.bisect_left(self._audio_wall, (audio_s, 0.0))
        received = self._audio_wall[min(index, len(self._audio_wall) - 1)][1] if self._audio_wall else time.monotonic()
        return max(0.0, time.monotonic() - received)

    async def _sender(self) -> None:
        while True:
            await self._send_now(await self._send.get())

    async def _send_now(self, message: bytes) -> None:
        try:
            async with asyncio.timeout(self.settings.send_timeout_s):
                await self.ws.send_bytes(message)
        except TimeoutError as exc:
            raise _Limit(1008, f"the client has not read for {self.settings.send_timeout_s:.0f} s") from exc
        except (RuntimeError, OSError, WebSocketDisconnect, ConnectionClosed) as exc:
            raise _Disconnected from exc

    async def _flush_then_close(self, code: int, reason: str, limit_s: float = 1.0) -> None:
        """Send what is queued (the error event above all), briefly, then close."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(limit_s):
                while len(self._send):
                    await self.ws.send_bytes(await self._send.get())
        await self._close(code, reason)

    async def shutdown(self, reason: str) -> None:
        """The server is stopping: tell the client and end the session."""
        self._closing = reason
        self._error("shutdown", reason)
        await self._flush_then_close(1001, reason)

    async def _watchdog(self, asr_stream) -> None:
        """Session length, ASR health: checked once a second."""
        stall_s = self.settings.asr_stall_s
        while True:
            await asyncio.sleep(min(1.0, self.settings.max_session_s))
            if time.monotonic() - self._started >= self.settings.max_session_s:
                raise _Limit(1000, f"the session reached its {self.settings.max_session_s:.0f} s limit")
            lag = getattr(asr_stream, "stalled_for_s", lambda: 0.0)()
            if self._asr_ok and lag > stall_s:
                self._asr_ok = False
                message = f"the ASR is {lag:.0f} s behind; going on without transcripts (plain Moshi)"
                logger.warning("session %s: %s", self.id, message)
                self._event(AsrStatusEvent(status="failed", message=message))

    async def _stats(self) -> None:
        while True:
            await asyncio.sleep(self.settings.stats_interval_s)
            latency = statistics.median(self._latencies) * 1000 if self._latencies else None
            self._event(StatsEvent(frames_in=self.frames_in, frames_out=self.frames_out,
                                   frames_dropped=self._dropped_seen + self._send.dropped,
                                   frame_latency_ms=None if latency is None else round(latency, 2)))

    # ---------------------------------------------------------------- planner -> client

    def _send_oracle(self, update) -> None:
        if self.options.oracle_delay_s > 0:
            self._loop.call_later(self.options.oracle_delay_s, self._push_late, update)
        else:
            self.handle.push_oracle(update)

    def _push_late(self, update) -> None:
        if not self.handle.closed:
            self.handle.push_oracle(update)

    def _on_planner_event(self, event: PlannerEvent) -> None:
        metrics = self.services.metrics
        if isinstance(event, OracleEmitted):
            self._oracle_text[id(event.update)] = event.text
            return
        if isinstance(event, BackendSwitched):
            return  # the configure reply says it
        record = event.record
        phase = {AttemptStarted: "started", AttemptFirstToken: "first_token"}.get(type(event), record.status)
        if isinstance(event, AttemptFirstToken):
            metrics.llm_ttft.labels(record.backend).observe(record.first_token_latency_s or 0.0)
        if isinstance(event, AttemptFinished):
            metrics.llm_attempts.labels(record.backend, record.status).inc()
        self._event(LLMEvent(
            phase=phase, epoch=record.epoch, backend=record.backend, trigger=record.trigger,
            user_text=record.user_text if phase == "started" else "",
            latency_s=record.first_token_latency_s if phase == "first_token" else None,
            answer=record.text if phase in ("done", "cancelled", "failed") else "",
            error_kind=record.error_kind, error=record.error,
            retry_in_s=event.retry_in_s if isinstance(event, AttemptFinished) else None))

    # ---------------------------------------------------------------- helpers

    def _event(self, event) -> None:
        if self._recorder is not None:
            self._recorder.write_event(event.model_dump(exclude_none=True))
        if self.options.events:
            self._send.put(encode_event(event))

    def _error(self, code: str, message: str) -> None:
        if self.options.events:
            self._event(ErrorEvent(code=code, message=message))
        else:
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
