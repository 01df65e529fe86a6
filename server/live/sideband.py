"""The sideband: `/v1/live/sessions/{id}/attach`, a WebSocket through which a trusted server watches
and steers a running Live session (a browser's, over WebRTC, whose token it never saw). A SIP call that the
Realtime call control accepted has the Realtime API's own (`/v1/realtime?call_id=`, `serve`): its events in
the Realtime protocol, what a Realtime client may send.

It gets a short replay of the session's recent events, then every event the client gets, plus the
user's audio reflected (`session.input_audio.append`, PCM16 24 kHz) and the assistant's audio with
its place on the timeline (`session.output_audio.delta` with `start_ms`/`end_ms`). It may send what
the client may, but audio and `session.start`: commentary for a delegation, instructions, an update,
`session.close`. Its own errors go to it alone. It ends when the session does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from fastapi.responses import JSONResponse
from starlette.websockets import WebSocket

from kame.queues import DropOldestQueue
from server.access import AccessControl, Refusal, close_reason
from server.live.adapter import LiveCarrier
from server.runner import CLOSED, SessionRunner

logger = logging.getLogger(__name__)


class Sideband:
    """One attached connection: what the session's carrier puts, for the socket's writer."""

    def __init__(self, capacity: int) -> None:
        self.queue: DropOldestQueue[str] = DropOldestQueue(capacity)
        self.ended = asyncio.Event()

    def put(self, event: dict, droppable: bool) -> None:
        self.queue.put(json.dumps(event), droppable=droppable)

    def end(self) -> None:
        self.ended.set()


def protocol(carrier) -> str | None:
    """Which sideband a session's carrier takes: GPT-Live's ("live": a Live session over either link, or a call
    running one), the Realtime API's ("realtime": a SIP call its call control accepted), or none."""
    return "live" if isinstance(carrier, LiveCarrier) else getattr(carrier, "protocol", None)


def find(sessions: set, session_id: str) -> SessionRunner | None:
    """The running Live session (over either link, or inside a phone call) with this id."""
    return next((s for s in sessions if s.id == session_id and protocol(s.carrier) == "live"), None)


async def attach(ws: WebSocket, session_id: str, sessions: set, access: AccessControl, capacity: int) -> None:
    """Serve one GPT-Live sideband connection until it or the session ends."""
    await serve(ws, lambda: find(sessions, session_id), f"no live session {session_id!r}", access, capacity)


async def serve(ws: WebSocket, lookup, missing: str, access: AccessControl, capacity: int) -> None:
    """Serve one sideband connection to the session `lookup()` finds (404 `missing` when none), until it or
    the session ends: GPT-Live's, or a SIP call's Realtime one (`/v1/realtime?call_id=`), whose carrier speaks
    its own protocol (`replayed`, `sidebands`, `steer`)."""
    refusal = access.credentials(ws)  # a sideband watches a session; it opens none
    if refusal is None and not access.trusted(ws):  # a browser's client secret does not watch others
        refusal = Refusal(401, 1008, "a sideband needs the server's token, not a client secret")
    live = lookup() if refusal is None else None
    if refusal is not None or live is None:
        status, reason = (refusal.status, refusal.reason) if refusal else (404, missing)
        await _deny(ws, status, reason)
        return
    session_id = live.id
    await ws.accept(subprotocol=_subprotocol(ws))
    band = Sideband(capacity)
    for event in live.carrier.replayed():
        band.put(event, False)
    live.carrier.sidebands.add(band)
    if getattr(live, "closing", False):  # it ended while this one was being accepted: nothing more will come
        band.end()
    logger.info("session %s: a sideband attached", session_id)
    tasks = [asyncio.create_task(_read(ws, live, band), name=f"sideband-{session_id}-read"),
             asyncio.create_task(_write(ws, band), name=f"sideband-{session_id}-write"),
             asyncio.create_task(band.ended.wait(), name=f"sideband-{session_id}-ended")]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(result, Exception):  # a bug ends this sideband only, with a trace
                logger.error("session %s: sideband failed", session_id, exc_info=result)
        live.carrier.sidebands.discard(band)
        await _drain(ws, band)
        with contextlib.suppress(*CLOSED):
            await ws.close(1000, "the session ended" if band.ended.is_set() else "detached")


def _subprotocol(ws: WebSocket) -> str | None:
    """A browser's Realtime client offers the "realtime" subprotocol (its key as another: server/access.py)."""
    return "realtime" if "realtime" in ws.scope.get("subprotocols", []) else None


async def _read(ws: WebSocket, live: SessionRunner, band: Sideband) -> None:
    with contextlib.suppress(*CLOSED):
        while (message := await ws.receive())["type"] != "websocket.disconnect":
            live.carrier.steer(message.get("text"), band)


async def _write(ws: WebSocket, band: Sideband) -> None:
    with contextlib.suppress(*CLOSED):
        while True:
            await ws.send_text(await band.queue.get())


async def _drain(ws: WebSocket, band: Sideband, limit_s: float = 1.0) -> None:
    """The last events (session.closed) before the sideband closes."""
    with contextlib.suppress(TimeoutError, *CLOSED):
        async with asyncio.timeout(limit_s):
            while len(band.queue):
                await ws.send_text(band.queue.get_nowait())


async def _deny(ws: WebSocket, status: int, reason: str) -> None:
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        code = {401: "invalid_api_key", 403: "origin_not_allowed", 404: "session_not_found"}.get(status, "refused")
        await ws.send_denial_response(JSONResponse({"error": {"type": "invalid_request_error", "code": code,
                                                              "message": reason}}, status_code=status))
    else:
        await ws.accept()
        await ws.close(1008, close_reason(reason))
