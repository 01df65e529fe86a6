"""OpenAI's SIP call control, as the openai SDK calls it: `POST /v1/realtime/calls/{call_id}/accept|reject|refer|
hangup` and `POST /v1/live/sessions/{session_id}/accept|reject|refer|hangup`, with the server's token (a client
secret does not steer calls). Whichever accept comes first runs the call; the other gets 409."""

from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from server.access import AccessControl
from server.http_errors import error_response
from server.live.config import serving_profile
from server.live.sideband import protocol
from server.realtime.adapter import realtime_facts
from server.realtime.client_events import RealtimeError, SessionConfigIn, invalid
from server.realtime.config import RealtimeConfig
from server.runner import SessionRunner
from server.sip.door import ControlError, SipDoor, session_params

MAX_BODY_BYTES = 256 * 1024  # a session's configuration (instructions, tools) is a few KB
PEEK_LIMIT_BYTES = 8 * 1024 * 1024  # POST /v1/live/sessions read to see its transport (a WebRTC offer: KBs)


def register(app: FastAPI, door: Callable[[], SipDoor | None], access: AccessControl) -> None:
    for kind, prefix, name in (("realtime", "/v1/realtime/calls", "call_id"),
                               ("live", "/v1/live/sessions", "session_id")):
        for action in ("accept", "reject", "refer", "hangup"):
            app.add_api_route(f"{prefix}/{{{name}}}/{action}", _route(kind, action, name, door, access),
                              methods=["POST"], name=f"sip_{kind}_{action}")


def _route(kind: str, action: str, name: str, door: Callable[[], SipDoor | None], access: AccessControl):
    async def control(request: Request) -> Response:
        refusal = access.credentials(request)
        if refusal is None and not access.trusted(request):
            return error_response(401, "invalid_request_error", "unauthorized",
                                  "call control needs the server's token, not a client secret")
        if refusal is not None:
            return error_response(refusal.status, "invalid_request_error", "unauthorized", refusal.reason)
        sip = door()
        if sip is None:
            return error_response(404, "invalid_request_error", "sip_disabled",
                                  "this server takes no SIP calls (kame serve --sip HOST:PORT)")
        try:
            body = await _json(request)
            await _act(sip, kind, action, request.path_params[name], body)
        except ControlError as exc:
            return error_response(exc.status, "invalid_request_error", exc.code, str(exc))
        return JSONResponse({}, status_code=200)

    control.__name__ = f"sip_{kind}_{action}"
    return control


async def sip_transport_create(request: Request, door: SipDoor | None, access: AccessControl) -> Response | None:
    """`POST /v1/live/sessions` with `transport: {type: "sip", destination, trunk}`: KAME dials out through the
    trunk and answers once the callee has (None: not a SIP transport; the WebRTC route takes the request)."""
    if "json" not in request.headers.get("content-type", ""):
        return None
    try:
        body = await _json(request, PEEK_LIMIT_BYTES)
    except ControlError as exc:
        if exc.status == 413:
            return error_response(413, "invalid_request_error", exc.code, str(exc))
        return None  # the WebRTC route reads the body again and says what is wrong with it
    transport = body.get("transport")
    if not isinstance(transport, dict) or transport.get("type") != "sip":
        return None
    refusal = access.credentials(request)
    if refusal is not None or not access.trusted(request):
        return error_response(401, "invalid_request_error", "unauthorized",
                              "an outbound call needs the server's token")
    if door is None:
        return error_response(400, "invalid_request_error", "sip_disabled",
                              "this server makes no SIP calls (kame serve --sip HOST:PORT)", "transport.type")
    try:
        call = await door.dial(session_params("live", body), transport)
    except ControlError as exc:
        return error_response(exc.status, "invalid_request_error", exc.code, str(exc))
    return JSONResponse({"session": {"id": call.live_id, "object": "live.session", "type": "live"},
                         "transport": {"type": "sip", "destination": transport["destination"], "status": "answered",
                                       "call_id": call.realtime_id}})


def realtime_call(door: SipDoor | None, call_id: str) -> SessionRunner | None:
    """The session of the answered SIP call `call_id` that the Realtime call control accepted: its sideband's."""
    call = door.calls.get(call_id) if door is not None else None
    if call is None or call.runner is None or call.sip.state == "ended" or getattr(call.runner, "closing", False):
        return None
    return call.runner if protocol(call.runner.carrier) == "realtime" else None


def realtime_session(door: SipDoor, body: dict, params: dict[str, str]) -> dict:
    """The Realtime session a call's accept asks for, checked as the session will apply it (a session.update
    on the server's defaults): ControlError 400 naming the field it cannot take, before the call is answered.
    Its `model`, where a backend profile is or serves it, is the session's LLM (as GPT-Live's accept)."""
    if door.state.services is None:
        raise ControlError(503, "server_busy", "the server is not taking calls now")
    runtime = door.state.services.runtime
    session = dict(body)
    llm = params.get("llm")
    kame = session.get("kame") if isinstance(session.get("kame"), dict) else {}
    if llm and "backend" not in kame:
        named = serving_profile(llm, {name: profile.model for name, profile in runtime.profiles.items()})
        if named is not None:
            session["kame"] = {**kame, "backend": named}
    runner = SimpleNamespace(id="accept", settings=door.settings, services=door.state.services)
    facts = realtime_facts(runner, SimpleNamespace(backend=runtime.default_profile, system_prompt=None))
    try:
        config = SessionConfigIn.model_validate(session)
        RealtimeConfig.initial(session.get("model") or "", facts).updated(config, facts)
    except ValidationError as exc:
        raise ControlError(400, "invalid_value", str(invalid(exc, prefix=("session",)))) from None
    except RealtimeError as exc:
        raise ControlError(400, exc.code, str(exc)) from None
    return session


async def _act(sip: SipDoor, kind: str, action: str, call_id: str, body: dict) -> None:
    if action == "accept":
        if kind == "realtime" and body.get("type") not in ("realtime", None):
            raise ControlError(400, "invalid_value", "a Realtime call is accepted with a session of type 'realtime'")
        sip.find(call_id)  # an unknown call is 404 whatever its body
        params = session_params(kind, body)
        realtime = realtime_session(sip, body, params) if kind == "realtime" else None
        await sip.accept(call_id, kind, params, realtime)
    elif action == "reject":
        status = body.get("status_code", 603 if kind == "realtime" else None)
        if not isinstance(status, int):
            raise ControlError(400, "missing_required_parameter", "status_code (an integer, 400-699) is required")
        sip.reject(call_id, status)
    elif action == "refer":
        target = body.get("target_uri")
        if not isinstance(target, str) or not target:
            raise ControlError(400, "missing_required_parameter", "target_uri (sip: or tel:) is required")
        await sip.refer(call_id, target)
    else:
        await sip.hangup(call_id)


async def _json(request: Request, limit: int = MAX_BODY_BYTES) -> dict:
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise ControlError(413, "request_too_large", f"a body of at most {limit} bytes")
    request._body = bytes(data)  # Starlette's cache: a route after this one reads the same body again
    if not data.strip():
        return {}
    try:
        body = json.loads(data)
    except ValueError:
        raise ControlError(400, "invalid_json", "the body is not JSON") from None
    if not isinstance(body, dict):
        raise ControlError(400, "invalid_json", "the body must be a JSON object")
    return body
