"""The FastAPI application: /api/chat (websocket), /healthz, /metrics, and the browser page at /."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, WebSocket
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST

from kame.errors import EngineError
from kame.protocol import ProtocolError
from server.services import Services
from server.session import Session, SessionOptions
from server.settings import ServerSettings

logger = logging.getLogger(__name__)

WEB_ROOT = Path(__file__).resolve().parents[1] / "client" / "web"


def create_app(settings: ServerSettings, services: Services | None = None) -> FastAPI:
    """The app; it loads its services at start-up unless `services` are given (tests)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.services = services or await asyncio.to_thread(Services.start, settings)
        logger.info("ready: ws://%s:%d/api/chat", settings.host, settings.port)
        try:
            yield
        finally:
            if services is None:
                await app.state.services.aclose()

    app = FastAPI(title="KAME server", lifespan=lifespan)
    app.state.services = None

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        current: Services | None = app.state.services
        if current is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse(current.health())

    @app.get("/metrics")
    async def metrics() -> Response:
        current: Services | None = app.state.services
        if current is None:
            return PlainTextResponse("loading\n", status_code=503)
        return Response(current.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.websocket("/api/chat")
    async def chat(ws: WebSocket) -> None:
        await run_session(ws, app.state.services)

    if (WEB_ROOT / "index.html").is_file():  # the browser page, after the routes above
        app.mount("/", StaticFiles(directory=WEB_ROOT, html=True), name="web")
    else:
        @app.get("/")
        async def index() -> Response:
            return PlainTextResponse("KAME server: connect a websocket client to /api/chat\n")

    return app


async def _refuse(ws: WebSocket, services: Services, reason: str) -> None:
    services.metrics.sessions_refused.inc()
    logger.info("connection refused: %s", reason)
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(JSONResponse({"error": "busy", "message": reason}, status_code=503))
    else:
        await ws.accept()
        await ws.close(1013, reason)


async def run_session(ws: WebSocket, services: Services) -> None:
    try:
        options = SessionOptions.from_query(ws.query_params)
        session = Session(ws, services, options)
    except ProtocolError as exc:
        await ws.accept()
        await ws.close(1008, str(exc)[:120])
        return
    if services.runner.free_slots <= 0:
        await _refuse(ws, services, f"all {services.engine.batch_size} session slots are busy; try again later")
        return
    try:
        handle = await services.runner.acquire_async(session.on_output_threadsafe, session.on_error_threadsafe)
    except EngineError as exc:
        await _refuse(ws, services, str(exc))
        return
    try:
        await ws.accept()
    except BaseException:
        handle.release()
        raise
    await session.run(handle)
