"""The Moshi websocket (`/api/chat`) as an adapter over one `kame.session.TandemSession`.

Tasks, in one TaskGroup (`server/transport.py`): receive (binary messages -> PCM and control),
forward (session events -> Opus, text and JSON messages), send (the one writer to the socket),
limits (session length, server shutdown). Opus runs on the shared codec thread.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from starlette.websockets import WebSocket

import kame
from kame.frontend.sampling import SAMPLING_PARAMETERS, Sampling
from kame.pcm import pcm16_decode, pcm16_encode
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
from kame.session import TandemSession
from kame.session_events import AssistantAudio, AssistantText, SessionFailed, SessionStats
from server.codec_process import CodecError, OpusStream
from server.services import Services
from server.transport import Ended, SocketSession

logger = logging.getLogger(__name__)


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


class Session(SocketSession):
    """Moshi's protocol (binary messages, Opus or PCM16) plus KAME's JSON extensions."""

    transport = "moshi"

    def __init__(self, ws: WebSocket, services: Services, options: SessionOptions, opus: OpusStream) -> None:
        super().__init__(ws, services)
        self.options, self._opus = options, opus  # its Opus decoder and encoder, in a codec process

    async def run(self, tandem: TandemSession) -> None:
        try:
            await super().run(tandem)
        finally:
            self._opus.close()

    async def open(self) -> TandemSession:
        """Take an engine slot for this connection (SlotsBusy, SessionError)."""
        config = self.settings.session_config(
            backend=self.options.backend, asr=self.options.asr, oracle_delay_s=self.options.oracle_delay_s,
            realtime=self.options.realtime, sampling=self.options.sampling,
            stats_interval_s=self.settings.stats_interval_s if self.options.events else None)
        return await self.open_tandem(config, asr=self.options.asr)

    async def _greet(self, tandem: TandemSession) -> None:
        runtime = self.services.runtime
        await self._send_now(encode(Kind.HANDSHAKE))
        await self._send_now(encode(Kind.METADATA, json.dumps(self._metadata(tandem)).encode()))
        self._event(ReadyEvent(
            session_id=self.id, frontend=runtime.frontend.source, asr=runtime.asr.name, backend=tandem.backend,
            backends=list(runtime.profiles), system_prompt=tandem.system_prompt,
            audio=self.options.audio, replica=self.settings.replica))

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

    async def _on_message(self, message: dict, tandem: TandemSession) -> None:
        data = message.get("bytes")
        if data is None:
            raise ProtocolError("text frames are not part of the protocol: send binary messages")
        if len(data) > self.settings.max_message_bytes:
            raise ProtocolError(f"message of {len(data)} bytes exceeds {self.settings.max_message_bytes}")
        kind, payload = decode(data)
        if kind is Kind.AUDIO:
            try:
                tandem.push_pcm(await self._opus.decode(payload))
            except CodecError as exc:  # the codec process is being restarted: this frame is lost, not the session
                logger.warning("session %s: %s; an audio message dropped", self.id, exc)
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
                elif opus := await self._encode(event.pcm):
                    self._send.put(encode(Kind.AUDIO, opus), droppable=True)
                self._count_dropped(tandem)
            elif isinstance(event, AssistantText):
                self._send.put(encode(Kind.TEXT, event.text.encode()))
            elif isinstance(event, SessionStats):
                self._event(StatsEvent(frames_in=event.frames_in, frames_out=event.frames_out,
                                       frames_dropped=event.frames_dropped + self._send.dropped,
                                       frame_latency_ms=event.frame_latency_ms), record=False)
            elif isinstance(event, SessionFailed):
                self._report(event.code, event.message, record=False)
                raise Ended("engine failure" if event.code == "engine" else "internal error")
            elif self.options.events and (wire := wire_event(event)) is not None:
                self._send.put(encode_event(wire))
        raise Ended("the session ended")

    # ---------------------------------------------------------------- helpers

    async def _encode(self, pcm) -> bytes:
        try:
            return await self._opus.encode(pcm)
        except CodecError as exc:  # as for decoding: a frame of the answer lost, not the session
            logger.warning("session %s: %s; a frame of audio dropped", self.id, exc)
            return b""

    def _event(self, event, record: bool = True) -> None:
        if record and self._recorder is not None:
            self._recorder.write_event(event.model_dump(exclude_none=True))
        if self.options.events:
            self._send.put(encode_event(event))

    def _report(self, code: str, message: str, record: bool = True) -> None:
        if self.options.events:
            self._event(ErrorEvent(code=code, message=message), record)
        else:
            if record and self._recorder is not None:
                self._recorder.write_event({"type": "error", "code": code, "message": message})
            self._send.put(encode(Kind.ERROR, message.encode()))
