"""The WebRTC side of `/v1/live/sessions`: a POST with the client's SDP offer starts a Live session
on one aiortc peer connection; the `oai-events` data channel carries the Live events both ways and
one sendrecv Opus track the audio (48 kHz on the wire, 24 kHz in the session).

Only frames move here: the mapping, `LiveCarrier` and the session's tasks, limits and closing are
the WebSocket adapter's (`adapter.LiveSession`), with the data channel in place of the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import av
import numpy as np
from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError
from openai.types.live import DataChannelConfig, SessionConfig
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from kame.asr.vad import silero_session
from kame.audio import SAMPLE_RATE
from kame.clock import Clock
from kame.errors import EngineError, SessionError
from kame.pcm import Resampler
from kame.rtc import OpusInput, receive_opus, send_cheaply
from kame.session import TandemSession
from server.access import AccessControl, Refusal
from server.http_errors import error_response
from server.live.adapter import LiveCarrier, LiveSession, live_facts
from server.live.assistant_track import AssistantTrack
from server.live.client_events import LiveError, invalid, unknown_parameter
from server.live.mapping import LiveMapping
from server.live.standby import DEFAULT_VAD_THRESHOLD, SpeechDetector
from server.services import Services
from server.transport import CLOSE_LIMIT_S, Disconnected, Limit

logger = logging.getLogger(__name__)

EVENTS_LABEL = "oai-events"  # the data channel the client creates
MEDIA_ONLY = ("idle_timeout_s", "wake_policy")  # WebRTC's additions to SessionConfig (standby)
WAKE_POLICY_KEYS = {"type", "vad_threshold"}
SENT_GRACE_S = 0.1  # after SCTP took the last message, before the peer connection closes (unacked)


class ChannelPermissions:
    """`session.client.data_channel`: which events an untrusted browser may send and receive on its
    data channel (a sideband is not limited). None: all."""

    def __init__(self, config: DataChannelConfig | None) -> None:
        sends = None if config is None else config.allowed_client_events
        gets = None if config is None else config.allowed_server_events
        self.sends = None if sends in (None, "all") else frozenset(sends)
        self.gets = None if gets in (None, "all") else frozenset((g.type, g.response_event) for g in gets)

    def may_send(self, kind: object) -> bool:
        return self.sends is None or kind in self.sends

    def may_get(self, event: dict) -> bool:
        if self.gets is None:
            return True
        nested = event["event"].get("type") if event["type"] == "response.event" else None
        return (event["type"], nested) in self.gets


class WebRTCSession(LiveSession):
    """One Live session on one peer connection; `answer` starts it, `run` serves it until the peer
    goes, `session.close` or a limit."""

    transport = "live-webrtc"

    def __init__(self, services: Services, config: SessionConfig, events: bool = False,
                 clock: Clock | None = None, timing: bool = False, media: dict | None = None) -> None:
        super().__init__(None, services, events, clock)
        self.config = config
        self.media = media or {}  # idle_timeout_s, wake_policy
        self._vad_session = None  # Silero's, where the session may pause
        self._detector: SpeechDetector | None = None  # listening for the wake, while paused
        self.permissions = ChannelPermissions(config.client.data_channel if config.client else None)
        send_cheaply()
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))  # host candidates: no STUN round trip
        self.track = AssistantTrack(self._frame_sent if timing else None)
        self._inbox: asyncio.Queue[str | bytes | None] = asyncio.Queue()  # None: the peer has gone
        self._channel = None
        self._channel_open = asyncio.Event()
        self._remote: MediaStreamTrack | None = None
        self._opus: OpusInput | None = None  # the user's audio, decoded as it arrives (`answer`)
        self.task: asyncio.Task | None = None  # `run`, started by the POST
        self.answer_sdp = ""
        self._pc_closing: asyncio.Task | None = None

    async def answer(self, offer: str, tandem: TandemSession) -> str:
        """Start the session (LiveError) and answer the client's offer (LiveError for a bad one)."""
        self.mapping = LiveMapping(live_facts(self.id, self.services, tandem, "webrtc", self.events))
        record = self._recorder.write_event if self._recorder is not None else None
        self.carrier = LiveCarrier(self.mapping, tandem, self.clock, self._enqueue, self.track.play, record,
                                   self.services.metrics)
        self.mapping.start(self.config, self.clock.now())
        wake = self.media.get("wake_policy") or {}
        self.mapping.stand_by(self.media.get("idle_timeout_s"), wake.get("vad_threshold"), self.clock.now())
        if self.mapping.standby is not None:
            self._vad_session = await asyncio.to_thread(silero_session)
        self.carrier.carry_out()
        self.pc.on("datachannel", self._on_channel)
        self.pc.on("track", self._on_track)
        self.pc.on("connectionstatechange", self._on_state)
        try:
            await self.pc.setRemoteDescription(RTCSessionDescription(offer, "offer"))
        except (ValueError, KeyError, IndexError) as exc:
            raise LiveError("invalid_sdp", f"The SDP offer cannot be read: {exc}", "transport.sdp") from exc
        kinds = {t.kind for t in self.pc.getTransceivers()}
        if "audio" not in kinds or self.pc.sctp is None:
            raise LiveError("invalid_sdp", "The offer needs one audio track and a data channel.", "transport.sdp")
        self.pc.addTrack(self.track)
        await self.pc.setLocalDescription(await self.pc.createAnswer())
        audio = next(t for t in self.pc.getTransceivers() if t.kind == "audio")
        self._opus = receive_opus(audio, name=f"opus-in-{self.id}")
        return self.pc.localDescription.sdp

    async def abandon(self, tandem: TandemSession) -> None:
        """The POST failed after the slot was taken: give everything back."""
        await tandem.aclose()
        await self.close_peer()
        await self.discard_recording()

    async def run(self, tandem: TandemSession) -> None:
        try:
            await super().run(tandem)
        finally:
            await self.close_peer()

    async def close_peer(self) -> None:
        """Close the peer connection, once, waiting at most CLOSE_LIMIT_S. The close runs in a task of
        its own and is never cut short: aiortc's `close`, once interrupted, makes every later call wait
        forever (and this session's task with it, holding its place among the server's sessions)."""
        if self._opus is not None:
            self._opus.close()
        if self._pc_closing is None:
            self._pc_closing = asyncio.get_running_loop().create_task(self.pc.close(), name=f"pc-close-{self.id}")
        try:
            async with asyncio.timeout(CLOSE_LIMIT_S):
                await asyncio.shield(self._pc_closing)
        except TimeoutError:
            logger.warning("session %s: the peer connection did not close within %.0f s", self.id, CLOSE_LIMIT_S)
        except Exception:  # closing is the last thing done: log it, end anyway
            logger.exception("session %s: closing the peer connection failed", self.id)

    # ---------------------------------------------------------------- the peer connection's events

    def _on_channel(self, channel) -> None:
        if channel.label != EVENTS_LABEL or self._channel is not None:
            logger.info("session %s: data channel %r ignored", self.id, channel.label)
            return
        self._channel = channel
        channel.on("message", self._inbox.put_nowait)
        channel.on("close", lambda: self._inbox.put_nowait(None))
        if channel.readyState == "open":
            self._channel_open.set()
        else:
            channel.on("open", self._channel_open.set)

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio" and self._remote is None:
            self._remote = track

    def _on_state(self) -> None:
        if self.pc.connectionState in ("failed", "closed"):
            self._inbox.put_nowait(None)

    def _frame_sent(self, frame: int, packet: int) -> None:
        """With `?kame_timing=1`: which RTP packet of the track (its index, from 0) carried the start of each
        of the session's frames, so that a client can time the audio of each frame (the bench)."""
        if self.mapping is not None:
            self._enqueue(self.mapping.outbox.event("kame.output_audio.sent", frame=frame, packet=packet), True)

    # ---------------------------------------------------------------- LiveSession's hooks, over WebRTC

    async def _greet(self, tandem: TandemSession) -> None:
        """The mapping started with the POST (`answer`); session.started waits for the channel."""

    def _extra_tasks(self, tandem: TandemSession) -> list:
        return [*super()._extra_tasks(tandem), self._listen()]

    def _enqueue(self, event: dict, droppable: bool) -> None:
        if self.permissions.may_get(event):
            super()._enqueue(event, droppable)

    async def _on_message(self, message: dict, tandem: TandemSession) -> None:
        kind = _event_type(message.get("text"))
        if not self.permissions.may_send(kind):
            raise LiveError("event_not_allowed", f"{kind} is not among this data channel's allowed client events "
                            "(session.client.data_channel.allowed_client_events).", "type")
        await super()._on_message(message, tandem)

    async def _next_message(self) -> dict:
        """The data channel's next message: no idle limit (the audio comes on the track)."""
        message = await self._inbox.get()
        if message is None:
            raise Disconnected
        return {"text": message} if isinstance(message, str) else {"bytes": message}

    async def _listen(self) -> None:
        """The user's audio as 24 kHz mono float32 for the mapping: from `OpusInput` as each packet
        decodes, or (another codec) from aiortc's track."""
        if self._opus is not None:
            while (pcm := await self._opus.frames.get()) is not None:
                self._hear(pcm)
            return
        if self._remote is None:
            return
        mono, resample = None, None  # PyAV to float mono at the codec's rate, then kame/pcm.py's resampler
        while True:
            try:
                frame = await self._remote.recv()
            except MediaStreamError as exc:
                raise Disconnected from exc
            if resample is None:
                mono = av.AudioResampler(format="flt", layout="mono", rate=frame.sample_rate)
                resample = Resampler(frame.sample_rate, SAMPLE_RATE)
            for out in mono.resample(frame):
                self._hear(resample(out.to_ndarray().reshape(-1)))

    def _hear(self, pcm: np.ndarray) -> None:
        """The user's audio to the mapping; while the session is paused, Silero listens for the wake."""
        if not self.mapping.paused:
            self._detector = None
            self.mapping.on_audio(pcm)
        else:
            if self._detector is None:
                self._detector = SpeechDetector(self._vad_session, self.mapping.standby.vad_threshold)
            self.mapping.on_audio(pcm)  # kept for the wake
            if self._detector(pcm):
                self.mapping.wake(self.clock.now())
        self.carrier.carry_out()

    async def _sender(self) -> None:
        try:
            async with asyncio.timeout(self.settings.idle_timeout_s):
                await self._channel_open.wait()
        except TimeoutError as exc:
            raise Limit(1001, f"no data channel {EVENTS_LABEL!r} after {self.settings.idle_timeout_s:.0f} s") from exc
        while True:
            await self._send_now(await self._send.get())

    async def _send_now(self, message: bytes | str) -> None:
        if self._channel.readyState != "open":
            raise Disconnected
        self._channel.send(message)

    async def _flush_then_close(self, code: int, reason: str, limit_s: float = 1.0) -> None:
        """What is queued (session.closed above all) goes out before the peer connection closes."""
        channel = self._channel
        if channel is not None and channel.readyState == "open":
            while len(self._send):
                channel.send(self._send.get_nowait())
            sent = asyncio.Event()
            if channel.bufferedAmount:
                channel.once("bufferedamountlow", sent.set)  # fired as the amount reaches 0
            else:
                sent.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(limit_s):
                    await sent.wait()
                    await asyncio.sleep(SENT_GRACE_S)
        await self._hang_up(code, reason)

    async def _close(self, code: int, reason: str) -> None:
        logger.info("session %s: closing the peer connection (%d %s)", self.id, code, reason)
        await self.close_peer()


# -------------------------------------------------------------------- the POST's body


def _event_type(text: str | None) -> object:
    """A data channel message's `type`, for the permission check (None when it has none: the
    mapping refuses such a message as usual)."""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        return json.loads(text).get("type")
    return None


def parse_offer(raw: object) -> tuple[SessionConfig, str, dict]:
    """`{session, transport: {type: "webrtc", sdp}}` -> (the session's config, the SDP offer, its
    WebRTC-only fields: `idle_timeout_s`, `wake_policy`);
    LiveError naming the parameter at fault (unknown fields are refused, as on the WebSocket)."""
    if not isinstance(raw, dict):
        raise LiveError("invalid_request", "The body is a JSON object: {session, transport}.")
    for key in raw:
        if key not in ("session", "transport"):
            raise LiveError("unknown_parameter", f"Unknown parameter: '{key}'.", key)
    transport, session = raw.get("transport"), raw.get("session")
    if not isinstance(transport, dict) or not isinstance(transport.get("sdp"), str):
        raise LiveError("missing_required_parameter", "Missing required parameter: 'transport.sdp'.", "transport.sdp")
    if transport.get("type") != "webrtc":
        raise LiveError("invalid_value", "transport.type must be 'webrtc'.", "transport.type")
    if (extra := set(transport) - {"type", "sdp"}):
        param = f"transport.{sorted(extra)[0]}"
        raise LiveError("unknown_parameter", f"Unknown parameter: '{param}'.", param)
    if not isinstance(session, dict):
        raise LiveError("missing_required_parameter", "Missing required parameter: 'session'.", "session")
    _check_media_only(session)
    common = {key: value for key, value in session.items() if key not in MEDIA_ONLY}
    if (param := unknown_parameter(SessionConfig, common, "session")) is not None:
        raise LiveError("unknown_parameter", f"Unknown parameter: '{param}'.", param)
    media = {key: session[key] for key in MEDIA_ONLY if key in session}
    try:
        return SessionConfig.model_validate(common), transport["sdp"], media
    except ValidationError as exc:
        raise invalid(exc, prefix="session.") from None


def _check_media_only(session: dict) -> None:
    timeout = session.get("idle_timeout_s")
    if timeout is not None and (not isinstance(timeout, int) or isinstance(timeout, bool) or timeout <= 0):
        raise LiveError("invalid_value", "idle_timeout_s is a positive integer.", "session.idle_timeout_s")
    wake = session.get("wake_policy")
    if wake is None:
        return
    if not isinstance(wake, dict) or wake.get("type") != "speech":
        raise LiveError("invalid_value", "wake_policy.type must be 'speech'.", "session.wake_policy.type")
    if (extra := set(wake) - WAKE_POLICY_KEYS):
        param = f"session.wake_policy.{sorted(extra)[0]}"
        raise LiveError("unknown_parameter", f"Unknown parameter: '{param}'.", param)
    threshold = wake.get("vad_threshold", DEFAULT_VAD_THRESHOLD)
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 <= threshold <= 1:
        raise LiveError("invalid_value", "wake_policy.vad_threshold is a number from 0 to 1.",
                        "session.wake_policy.vad_threshold")


async def read_body(request: Request, limit_bytes: int) -> object:
    """The POST's JSON, read no further than `limit_bytes` (LiveError)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit_bytes:
            raise LiveError("request_too_large", f"The body exceeds {limit_bytes} bytes.")
    try:
        return json.loads(body)
    except ValueError as exc:
        raise LiveError("invalid_json", f"The body is not valid JSON: {exc}") from exc


# -------------------------------------------------------------------- the POST


REFUSAL_CODES = {401: ("invalid_request_error", "invalid_api_key"),
                 403: ("invalid_request_error", "origin_not_allowed"),
                 429: ("rate_limit_error", "too_many_sessions"), 503: ("server_error", "server_busy")}


def cors_headers(request: Request, access: AccessControl, preflight: bool = False) -> dict[str, str]:
    """CORS for a browser on an allowed origin (a page elsewhere than this server POSTs its offer)."""
    origin = request.headers.get("origin")
    if origin is None or not access.origin_allowed(origin, request.headers.get("host", "")):
        return {}
    headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
    if preflight:
        headers |= {"Access-Control-Allow-Methods": "POST, OPTIONS", "Access-Control-Max-Age": "600",
                    "Access-Control-Allow-Headers": "authorization, content-type"}
    return headers


async def create(request: Request, services: Services, access: AccessControl, sessions: set,
                 draining: bool) -> JSONResponse:
    """`POST /v1/live/sessions`: admit, parse, take a slot, answer; the session then runs as a task
    (in `sessions`, so the server's drain reaches it)."""
    cors = cors_headers(request, access)
    refusal = Refusal(503, 1001, "the server is shutting down") if draining else access.admit(request)
    if refusal is not None:
        services.metrics.sessions_refused.inc()
        return error_response(refusal.status, *REFUSAL_CODES.get(refusal.status, ("invalid_request_error", "refused")),
                              refusal.reason, headers=cors)
    try:
        session = await _start(request, services)
    except LiveError as exc:
        access.leave(request)
        return error_response(400, exc.kind, exc.code, str(exc), exc.param, cors)
    except EngineError as exc:  # SlotsBusy, or a runner that is stopping
        access.leave(request)
        services.metrics.sessions_refused.inc()
        return error_response(503, "server_error", "server_busy", str(exc), headers=cors)
    except BaseException:
        access.leave(request)
        raise
    sessions.add(session)
    session.task.add_done_callback(lambda _: (sessions.discard(session), access.leave(request)))
    body = {"session": session.mapping.config.resource(session.mapping.facts),
            "transport": {"type": "webrtc", "sdp": session.answer_sdp}}
    return JSONResponse(body, headers=cors)


async def _start(request: Request, services: Services) -> WebRTCSession:
    settings = services.settings
    config, offer, media = parse_offer(await read_body(request, settings.max_message_bytes * 4 // 3 + 4096))
    flag = {name: request.query_params.get(name, "").lower() in ("1", "true")
            for name in ("kame_events", "kame_timing")}
    session = WebRTCSession(services, config, flag["kame_events"], timing=flag["kame_timing"], media=media)
    try:
        tandem = await session.open()
    except SessionError as exc:
        await session.close_peer()
        raise LiveError("invalid_request", str(exc)) from exc
    except BaseException:
        await session.close_peer()
        raise
    try:
        session.answer_sdp = await session.answer(offer, tandem)
    except BaseException:
        await session.abandon(tandem)
        raise
    session.task = asyncio.get_running_loop().create_task(session.run(tandem), name=f"live-webrtc-{session.id}")
    return session
