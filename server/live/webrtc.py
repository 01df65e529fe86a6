"""GPT-Live over WebRTC (`POST /v1/live/sessions`): the client's SDP offer starts a Live session on one
aiortc peer connection (`rtc_link.WebRTCLink`: the `oai-events` data channel and one Opus track), run
by the same runner and carrier as over a WebSocket (`server/runner.py`, `adapter.LiveCarrier`).
"""

from __future__ import annotations

import asyncio
import json
import logging

from openai.types.live import DataChannelConfig, SessionConfig
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from kame.asr.vad import silero_session
from kame.clock import Clock
from kame.errors import EngineError, SessionError
from server.access import AccessControl, Refusal
from server.http_errors import error_response
from server.live.adapter import LiveCarrier, live_facts
from server.live.client_events import LiveError, invalid, unknown_parameter
from server.live.mapping import LiveMapping
from server.live.rtc_link import WebRTCLink
from server.live.standby import DEFAULT_VAD_THRESHOLD
from server.runner import SessionRunner
from server.services import Services

logger = logging.getLogger(__name__)

MEDIA_ONLY = ("idle_timeout_s", "wake_policy")  # WebRTC's additions to SessionConfig (standby)
WAKE_POLICY_KEYS = {"type", "vad_threshold"}
TIMING_BATCH_S = 0.25  # ?kame_timing=1's frame times, sent together (the bench's client waits 0.5 s to close)


class FrameTimes:
    """With ?kame_timing=1: which RTP packet of the track carried the start of each of the session's
    frames, as the 20 ms slot of the RTP clock (from the track's first packet) where it begins, whatever
    the packet time, so that a client can time the audio of each frame (the bench). Sent in batches
    (`kame.output_audio.sent {frames: [[frame, slot], ...]}`, every TIMING_BATCH_S): an event a frame was
    12.5 data-channel messages a second that the bench added to each session's work (SCTP, DTLS), a
    quarter of the WebRTC path's cost on the event loop; the client matches them after the run."""

    def __init__(self, carrier: LiveCarrier, mapping: LiveMapping) -> None:
        self._carrier, self._mapping = carrier, mapping
        self._pending: list[list[int]] = []

    def add(self, frame: int, slot: int) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_later(TIMING_BATCH_S, self._send)
        self._pending.append([frame, slot])

    def _send(self) -> None:
        frames, self._pending = self._pending, []
        self._carrier.send_event(self._mapping.outbox.event("kame.output_audio.sent", frames=frames), True)


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


# -------------------------------------------------------------------- the POST's body


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
    sessions.add(session.runner)
    session.task.add_done_callback(lambda _: (sessions.discard(session.runner), access.leave(request)))
    mapping = session.carrier.mapping
    body = {"session": mapping.config.resource(mapping.facts),
            "transport": {"type": "webrtc", "sdp": session.answer_sdp}}
    return JSONResponse(body, headers=cors)


class WebRTCSession:
    """One Live session on one peer connection: the runner, its link and its carrier; `task` runs it."""

    def __init__(self, runner: SessionRunner, link: WebRTCLink, carrier: LiveCarrier, answer_sdp: str) -> None:
        self.runner, self.link, self.carrier, self.answer_sdp = runner, link, carrier, answer_sdp
        self.task: asyncio.Task | None = None


async def start(services: Services, config: SessionConfig, offer: str, media: dict, events: bool = False,
                timing: bool = False, clock: Clock | None = None) -> WebRTCSession:
    """Take a slot, start the mapping and answer the offer; the caller runs `runner.run` (LiveError,
    EngineError; everything is given back on a failure)."""
    rtc = services.settings.realtime
    link = WebRTCLink(rtc.webrtc_opus_complexity, rtc.webrtc_uplink_ptime_ms)
    runner = SessionRunner(services, link, "live-webrtc", clock)
    link.name = runner.id
    try:
        tandem = await runner.open(services.settings.session_config(stats_interval_s=None))
    except SessionError as exc:
        await link.close_peer()
        raise LiveError("invalid_request", str(exc)) from exc
    except BaseException:
        await link.close_peer()
        raise
    try:
        mapping = LiveMapping(live_facts(runner, tandem, "webrtc", events))
        permissions = ChannelPermissions(config.client.data_channel if config.client else None)
        mapping.start(config, runner.clock.now())
        wake = media.get("wake_policy") or {}
        mapping.stand_by(media.get("idle_timeout_s"), wake.get("vad_threshold"), runner.clock.now())
        vad = await asyncio.to_thread(silero_session) if mapping.standby is not None else None
        carrier = LiveCarrier(runner, tandem, mapping, link.track.play, permissions, vad)
        link.hear = carrier.hear
        if timing:
            link.track.sent = FrameTimes(carrier, mapping).add
        carrier.carry_out()
        answer_sdp = await link.answer(offer)
    except BaseException:  # the POST failed after the slot was taken: give everything back
        await tandem.aclose()
        await link.close_peer()
        await runner.discard_recording()
        raise
    session = WebRTCSession(runner, link, carrier, answer_sdp)
    session.task = asyncio.get_running_loop().create_task(_run(session, tandem), name=f"live-webrtc-{runner.id}")
    return session


async def _run(session: WebRTCSession, tandem) -> None:
    try:
        await session.runner.run(tandem, session.carrier)
    finally:
        await session.link.close_peer()
        if (packet_ms := session.link.peer_packet_ms) is not None:
            session.runner.services.metrics.webrtc_peer_packets.labels(str(packet_ms)).inc()


async def _start(request: Request, services: Services) -> WebRTCSession:
    settings = services.settings
    config, offer, media = parse_offer(await read_body(request, settings.max_message_bytes * 4 // 3 + 4096))
    flag = {name: request.query_params.get(name, "").lower() in ("1", "true")
            for name in ("kame_events", "kame_timing")}
    return await start(services, config, offer, media, flag["kame_events"], flag["kame_timing"])
