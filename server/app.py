"""The FastAPI application: /api/chat, /v1/realtime and /v1/live/sessions (websockets; a POST there
starts a WebRTC Live session), /healthz, /metrics, and the browser page at /."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import signal
import warnings
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST

from kame.errors import EngineError, SessionError
from kame.protocol import ProtocolError
from kame.runtime import log_index_stats
from kame.session import SessionConfig, TandemSession
from server import client_secrets, front_peers
from server.access import AccessControl, Refusal, close_reason
from server.codec_process import CodecPool
from server.front_peers import FrontPlan
from server.http_errors import error_response
from server.live import recording, sideband
from server.live.adapter import LiveCarrier, live_facts
from server.live.mapping import LiveMapping
from server.moshi.carrier import MoshiCarrier
from server.moshi.mapping import SessionOptions
from server.phone.doors import StreamTokenDoor, stream_token_doors
from server.phone.routes import TwilioDoor
from server.realtime import RealtimeCarrier
from server.realtime.adapter import subprotocol as realtime_subprotocol
from server.runner import Carrier, SessionRunner
from server.services import Services
from server.settings import ServerSettings
from server.sip import control as sip_control
from server.sip.door import SipDoor
from server.websocket_link import WebSocketLink

logger = logging.getLogger(__name__)

try:  # WebRTC (aiortc, PyAV) is optional at run time: without it the rest of the server works and the route says why
    from server.live import webrtc
except ImportError as exc:
    if (exc.name or "").split(".")[0] not in ("aiortc", "av"):  # our own import error is a bug: fail loudly
        raise
    webrtc = None
    WEBRTC_MISSING = f"GPT-Live over WebRTC is unavailable on this server: {exc} (pip install aiortc==1.16.0)"

WEB_ROOT = Path(__file__).resolve().parents[1] / "client" / "web"


async def close_sessions(sessions: set, timeout_s: float) -> None:
    """Tell every client the server is going away, and give sessions `timeout_s` to end."""
    if not sessions:
        return
    logger.info("closing %d sessions", len(sessions))
    current = list(sessions)
    for session in current:
        session.shutdown("the server is shutting down")
    waiters = [asyncio.ensure_future(s.ended.wait()) for s in current]
    _, late = await asyncio.wait(waiters, timeout=timeout_s)
    for waiter in late:
        waiter.cancel()


class RedactTokens(logging.Filter):
    """Hides `token=...` query values (browsers pass the auth token that way) in uvicorn's logs."""

    _pattern = re.compile(r"(token=)[^&\s\"']+")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "token=" in message:
            record.msg, record.args = self._pattern.sub(r"\1***", message), ()
        return True


def install_log_redaction() -> None:
    for name in ("uvicorn.access", "uvicorn.error", "uvicorn"):
        logger_ = logging.getLogger(name)
        if not any(isinstance(f, RedactTokens) for f in logger_.filters):
            logger_.addFilter(RedactTokens())


class DrainingServer(uvicorn.Server):
    """uvicorn, but on shutdown the sessions are told and given time to end before uvicorn
    drops their sockets (uvicorn alone closes them at once with code 1012)."""

    async def startup(self, sockets=None) -> None:
        install_log_redaction()  # uvicorn configures its loggers before this
        await super().startup(sockets)

    async def shutdown(self, sockets=None) -> None:
        app = self.config.app
        drain = getattr(getattr(app, "state", None), "drain", None)
        if drain is not None:
            await drain()
        await super().shutdown(sockets)


def uvicorn_config(app, settings):
    """uvicorn's settings for the app (one process, or each front process)."""
    # uvicorn's legacy websockets implementation: its sans-io successor logs a spurious error after
    # the HTTP 503 denial response that refuses a session when all slots are busy
    warnings.filterwarnings("ignore", message=".*websockets.* implementation is deprecated")
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info", ws="websockets",
                          lifespan="on",
                          # no permessage-deflate: Opus does not compress, and deflating every
                          # frame cost both ends CPU (it showed in the host-side profile)
                          ws_per_message_deflate=False,
                          # Realtime events carry audio as base64 (4/3 the bytes); a frame up
                          # to 4x that gets a clear error event, beyond it the socket closes
                          ws_max_size=4 * (settings.max_message_bytes * 4 // 3 + 4096))


def watch_knowledge(services: Services) -> Callable[[], None]:
    """Re-index the knowledge base when its files change (every `watch_interval_s`) and on SIGHUP;
    returns what stops both. Nothing to do without a knowledge base."""
    runtime = services.runtime
    if runtime.knowledge is None:
        return lambda: None
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task] = set()

    def spawn(coro, name: str) -> None:
        task = loop.create_task(coro, name=name)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    interval = runtime.settings.knowledge.watch_interval_s
    if interval:
        spawn(runtime.knowledge.watch(interval, lambda stats: log_index_stats(stats, "knowledge base changed")),
              "knowledge-watch")
    hup = False
    with contextlib.suppress(ValueError, RuntimeError, NotImplementedError, AttributeError):  # not the main thread
        loop.add_signal_handler(signal.SIGHUP, lambda: spawn(
            asyncio.to_thread(runtime.refresh_knowledge, "SIGHUP: knowledge base re-indexed"), "knowledge-sighup"))
        hup = True

    def stop() -> None:
        if hup:
            loop.remove_signal_handler(signal.SIGHUP)
        for task in tasks:
            task.cancel()

    return stop


def create_app(settings: ServerSettings, services: Services | None = None,
               on_ready: Callable[[FastAPI], object] | None = None,
               health_extra: Callable[[], Awaitable[dict]] | None = None,
               metrics_source: Callable[[], Awaitable[bytes]] | None = None,
               front: FrontPlan | None = None) -> FastAPI:
    """The app; it loads its services at start-up unless `services` are given (tests).

    `on_ready(app)` runs on the app's loop once the services are up (Ray replicas start their
    reporting there); `health_extra()` adds to /healthz (the cluster's replicas and readiness: a
    "status" other than "ready" answers 503); `metrics_source()` replaces /metrics' own figures
    (the cluster's, each replica's labelled). `front`: this app is one of several front processes
    (server/fronts.py): connections per address are counted for all, /metrics merges every front's,
    and a sideband for a session another front holds is relayed there."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.services = services or await asyncio.to_thread(Services.start, settings)
        app.state.codec = CodecPool(settings.resolved_codec_processes(app.state.services.runtime.engine.batch_size))
        await app.state.codec.ready()
        base = f"ws://{settings.host}:{settings.port}"
        logger.info("ready: %s/api/chat, %s/v1/realtime and %s/v1/live/sessions", base, base, base)
        if webrtc is None:
            logger.warning("%s", WEBRTC_MISSING)
        if twilio.closed is not None:
            logger.warning("%s", twilio.closed)
        else:
            logger.info("phone calls: a Twilio number's voice URL is %s/twilio/voice (docs/telephony.md)",
                        settings.phone.public_url or f"http://{settings.host}:{settings.port}")
        for door in carriers:
            if door.closed is not None:
                logger.warning("%s", door.closed)
        if opened := [f"/{door.name}/media" for door in carriers if door.closed is None]:
            logger.info("phone calls: carriers' media streams at %s (docs/telephony.md)", ", ".join(opened))
        if app.state.sip is not None:
            await app.state.sip.start()
        if on_ready is not None:
            on_ready(app)
        stop_watching = watch_knowledge(app.state.services)
        probe = asyncio.get_running_loop().create_task(app.state.services.metrics.probe_loop(), name="loop-probe")
        try:
            yield
        finally:
            probe.cancel()
            stop_watching()
            await drain()
            if app.state.sip is not None:
                await app.state.sip.close()
            app.state.codec.close()
            await app.state.services.runtime.aclose_llms()  # on the loop that used them
            if services is None:
                await asyncio.to_thread(app.state.services.runtime.close)

    app = FastAPI(title="KAME server", lifespan=lifespan)
    app.state.services = None
    twilio = TwilioDoor(settings)
    carriers = stream_token_doors(settings)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        current: Services | None = app.state.services
        if current is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        health = current.health() | (await health_extra() if health_extra is not None else {})
        return JSONResponse(health, status_code=200 if health["status"] == "ready" else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        current: Services | None = app.state.services
        if current is None:
            return PlainTextResponse("loading\n", status_code=503)
        if metrics_source is not None:
            body = await metrics_source()
        elif front is not None and "local" not in request.query_params:  # (a peer asks with ?local=1)
            body = await front_peers.merged_metrics(front, current.metrics.render())
        else:
            body = current.metrics.render()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    access = AccessControl(settings, front.counts if front is not None else None)
    app.state.sessions = set()
    app.state.draining = False
    app.state.sip = SipDoor(settings, app.state) if settings.sip.listen and front is None else None
    if settings.sip.listen and front is not None:
        logger.warning("[sip] listen is ignored with --fronts: SIP calls need one process (docs/telephony.md)")
    sip_control.register(app, lambda: app.state.sip, access)

    async def drain() -> None:
        """Graceful stop: refuse new sessions, tell the current ones, give them time to end."""
        app.state.draining = True
        await close_sessions(app.state.sessions, settings.shutdown_timeout_s)

    app.state.drain = drain

    @app.websocket("/api/chat")
    async def chat(ws: WebSocket) -> None:
        services = app.state.services

        def endpoint() -> Endpoint:
            options = SessionOptions.from_query(ws.query_params)
            config = services.settings.session_config(
                backend=options.backend, asr=options.asr, oracle_delay_s=options.oracle_delay_s,
                realtime=options.realtime, sampling=options.sampling, persona=options.persona,
                language=options.language, voice=options.voice,
                stats_interval_s=services.settings.stats_interval_s if options.events else None)
            return Endpoint("moshi", config, lambda runner, tandem: MoshiCarrier(
                runner, tandem, options, app.state.codec.stream()), asr=options.asr)

        await run_session(ws, services, access, app.state.sessions, app.state.draining, endpoint)

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket) -> None:
        if "call_id" in ws.query_params:  # the sideband of a SIP call the Realtime call control accepted
            call_id = ws.query_params["call_id"]
            await sideband.serve(ws, lambda: sip_control.realtime_call(app.state.sip, call_id),
                                 f"no Realtime call {call_id!r}", access, settings.send_queue_messages)
            return
        services = app.state.services
        beta = "realtime=v1" in ws.headers.get("openai-beta", "")
        model = ws.query_params.get("model", "")
        await run_session(ws, services, access, app.state.sessions, app.state.draining, lambda: Endpoint(
            "realtime", services.settings.session_config(stats_interval_s=None),
            lambda runner, tandem: RealtimeCarrier(runner, tandem, model, beta),
            subprotocol=realtime_subprotocol(ws.scope.get("subprotocols", []))))

    @app.websocket("/v1/live/sessions")
    async def live(ws: WebSocket) -> None:
        """OpenAI's GPT-Live over WebSocket (docs/live.md); `?kame_events=true`: KAME's extra events."""
        services = app.state.services
        events = ws.query_params.get("kame_events", "").lower() in ("1", "true")
        await run_session(ws, services, access, app.state.sessions, app.state.draining, lambda: Endpoint(
            "live", services.settings.session_config(stats_interval_s=None),
            lambda runner, tandem: LiveCarrier(runner, tandem,
                                               LiveMapping(live_facts(runner, tandem, "websocket", events)))))

    # ---- GPT-Live over WebRTC: the POST with the SDP offer starts the session (server/live/webrtc.py)

    @app.post("/v1/live/sessions")
    async def live_webrtc(request: Request) -> Response:
        outbound = await sip_control.sip_transport_create(request, app.state.sip, access)
        if outbound is not None:  # transport.type "sip": an outbound call (server/sip/door.py)
            return outbound
        if webrtc is None:
            return error_response(501, "server_error", "webrtc_unavailable", WEBRTC_MISSING)
        return await webrtc.create(request, app.state.services, access, app.state.sessions, app.state.draining)

    @app.options("/v1/live/sessions")
    async def live_webrtc_preflight(request: Request) -> Response:
        if webrtc is None:
            return error_response(501, "server_error", "webrtc_unavailable", WEBRTC_MISSING)
        return Response(status_code=204, headers=webrtc.cors_headers(request, access, preflight=True))

    # ---- phone calls: a carrier's media stream (server/phone/, docs/telephony.md)

    @app.post("/twilio/voice")
    async def twilio_voice(request: Request) -> Response:
        """The TwiML a Twilio number's voice URL gets: a bidirectional Media Stream back here."""
        current: Services | None = app.state.services
        free = 0 if current is None or app.state.draining else current.runtime.runner.free_slots
        return await twilio.voice(request, free)

    @app.websocket("/twilio/media")
    async def twilio_media(ws: WebSocket) -> None:
        """The Media Stream the TwiML named: opens with the token the TwiML issued for its call."""
        refusal, call = twilio.admit(ws)
        await _serve_call(ws, app.state, refusal, lambda services: Endpoint(
            "twilio", services.settings.session_config(stats_interval_s=None), twilio.carrier(call)))

    def carrier_media(door: StreamTokenDoor):
        async def media(ws: WebSocket) -> None:
            """A Telnyx, Vonage or Plivo media stream to the URL the application wrote (server/phone/doors.py)."""
            await _serve_call(ws, app.state, door.admit(ws), lambda services: Endpoint(
                door.name, services.settings.session_config(stats_interval_s=None), door.phone_carrier))
        return media

    for door in carriers:
        app.add_api_websocket_route(f"/{door.name}/media", carrier_media(door), name=f"{door.name}_media")

    @app.post("/v1/realtime/client_secrets")
    async def client_secret(request: Request) -> Response:
        """A short-lived client secret for a browser, minted with the server's token (docs/live.md)."""
        return await client_secrets.create(request, access)

    @app.get("/v1/live/sessions/{session_id}/content")
    async def live_recording(request: Request, session_id: str) -> Response:
        """A finished session's recording (the SDK's `download_recording`), where the server records."""
        return await recording.download(request, session_id, settings.record_dir, access)

    @app.websocket("/v1/live/sessions/{session_id}/attach")
    async def live_sideband(ws: WebSocket, session_id: str) -> None:
        """GPT-Live's sideband: a trusted server watches and steers a running session (docs/live.md)."""
        if (front is not None and sideband.find(app.state.sessions, session_id) is None
                and front_peers.RELAYED not in ws.headers and await front_peers.relay_sideband(ws, session_id, front)):
            return  # another front holds it: relayed there, where it is checked as any attach
        await sideband.attach(ws, session_id, app.state.sessions, access, settings.send_queue_messages)

    if (WEB_ROOT / "index.html").is_file():  # the browser page, after the routes above
        app.mount("/", StaticFiles(directory=WEB_ROOT, html=True), name="web")
    else:
        @app.get("/")
        async def index() -> Response:
            return PlainTextResponse("KAME server: connect a websocket client to /api/chat\n")

    return app


async def _refuse(ws: WebSocket, services: Services, refusal: Refusal) -> None:
    services.metrics.sessions_refused.inc()
    logger.info("connection from %s refused (%d): %s", ws.client.host if ws.client else "?", refusal.status,
                refusal.reason)
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        body = {"error": {401: "unauthorized", 403: "forbidden", 429: "too_many", 503: "busy"}.get(
            refusal.status, "refused"), "message": refusal.reason}
        await ws.send_denial_response(JSONResponse(body, status_code=refusal.status))
    else:
        await ws.accept()
        await ws.close(refusal.close_code, close_reason(refusal.reason))


async def _serve_call(ws: WebSocket, state, refusal: Refusal | None,
                      endpoint: Callable[[Services], Endpoint]) -> None:
    """A carrier's media stream that its door let in (`refusal` None): a session unless the server is draining."""
    services = state.services
    if refusal is None and state.draining:
        refusal = Refusal(503, 1001, "the server is shutting down")
    if refusal is not None:
        await _refuse(ws, services, refusal)
        return
    await _serve(ws, services, state.sessions, lambda: endpoint(services))


@dataclass(frozen=True)
class Endpoint:
    """What one websocket route runs: its transport's name (metrics, recordings), the session's config,
    the protocol's carrier, and the subprotocol the upgrade answers with."""

    transport: str
    config: SessionConfig
    carrier: Callable[[SessionRunner, TandemSession], Carrier]
    asr: bool = True
    subprotocol: str | None = None


async def run_session(ws: WebSocket, services: Services, access: AccessControl, sessions: set, draining: bool,
                      endpoint: Callable[[], Endpoint]) -> None:
    """One connection, whatever its protocol (`endpoint` reads its query: ProtocolError)."""
    refusal = Refusal(503, 1001, "the server is shutting down") if draining else access.admit(ws)
    if refusal is not None:
        await _refuse(ws, services, refusal)
        return
    try:
        await _serve(ws, services, sessions, endpoint)
    finally:
        access.leave(ws)


async def _serve(ws: WebSocket, services: Services, sessions: set, endpoint: Callable[[], Endpoint]) -> None:
    try:
        route = endpoint()
        runner = SessionRunner(services, WebSocketLink(ws), route.transport)
        tandem = await runner.open(route.config, asr=route.asr)
    except (ProtocolError, SessionError) as exc:
        await ws.accept()
        await ws.close(1008, close_reason(str(exc)))
        return
    except EngineError as exc:  # SlotsBusy, or a runner that is stopping
        await _refuse(ws, services, Refusal(503, 1013, str(exc)))
        return
    try:
        await ws.accept(subprotocol=route.subprotocol)
        carrier = route.carrier(runner, tandem)
    except BaseException:
        await tandem.aclose()  # from here on, the runner ends the tandem
        await runner.discard_recording()
        raise
    sessions.add(runner)
    try:
        await runner.run(tandem, carrier)
    finally:
        sessions.discard(runner)
