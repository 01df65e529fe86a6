"""The carriers' doors: Twilio's TwiML webhook (`POST /twilio/voice`) and its Media Stream
(`/twilio/media`). A carrier cannot send KAME's API key, so these routes admit by the carrier's own
credentials: with `[phone] twilio_auth_token` set, every webhook's X-Twilio-Signature is checked and the
stream opens only with the token its TwiML carried, for that call. Without credentials they are open on a
loopback address only (a softphone or a test on this machine), and off anywhere else.
"""

from __future__ import annotations

import logging
from urllib.parse import parse_qs, urlencode

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.websockets import WebSocket

from server.access import Refusal
from server.phone.carrier import PhoneCarrier
from server.phone.twilio import StreamTokens, TwilioStream, signed, twiml
from server.settings import ServerSettings, is_loopback

logger = logging.getLogger(__name__)

MAX_WEBHOOK_BYTES = 64 * 1024  # a voice webhook's form: a few hundred bytes
CALL_PARAMETERS = ("CallSid", "From", "To")  # of Twilio's webhook, passed on to the stream as <Parameter>s
SETTINGS_PARAMETERS = ("instructions", "llm", "voice", "keypad")  # a voice URL's query: the call's settings


def closed_reason(settings: ServerSettings, carrier: str) -> str | None:
    """Why `carrier`'s routes are off (None: they are on): a server reachable from the network takes calls
    only with the carrier's credentials."""
    if carrier == "twilio" and settings.phone.twilio_auth_token is not None:
        return None
    if is_loopback(settings.host):
        return None
    return (f"the {carrier} routes are off: the server listens on {settings.host} and [phone] "
            f"{carrier}_auth_token is not set (carriers cannot send the server's API key)")


class TwilioDoor:
    """Twilio's two routes for one server."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        token = settings.phone.twilio_auth_token
        self.auth_token = token.get_secret_value() if token is not None else None
        self.tokens = StreamTokens(self.auth_token) if self.auth_token is not None else None
        self.closed = closed_reason(settings, "twilio")

    async def voice(self, request: Request, free_slots: int) -> Response:
        """The TwiML for a call: a bidirectional Media Stream back to this server, the call's parameters with it."""
        if self.closed is not None:
            return PlainTextResponse(self.closed, status_code=403)
        body = await _read(request)
        if body is None:
            return PlainTextResponse(f"a webhook's body is at most {MAX_WEBHOOK_BYTES} bytes", status_code=413)
        form = {name: values[-1] for name, values in parse_qs(body, keep_blank_values=True).items()}
        if self.auth_token is not None:
            url = self._public(request, str(request.url.path), request.url.query)
            if not signed(self.auth_token, url, form, request.headers.get("x-twilio-signature")):
                logger.warning("a Twilio webhook with a bad signature from %s", request.client.host if request.client
                               else "?")
                return PlainTextResponse("the request's X-Twilio-Signature does not match", status_code=403)
        call_sid = form.get("CallSid", "")
        if free_slots <= 0:  # beyond capacity: the caller hears busy at once, and no stream opens
            logger.info("twilio call %s refused: every session slot is in use", call_sid)
            return Response('<?xml version="1.0" encoding="UTF-8"?><Response><Reject reason="busy"/></Response>',
                            media_type="application/xml")
        parameters = {name: form[name] for name in CALL_PARAMETERS if form.get(name)}
        parameters |= {name: request.query_params[name] for name in SETTINGS_PARAMETERS
                       if request.query_params.get(name)}
        query = urlencode({"stream_token": self.tokens.issue(call_sid)}) if self.tokens is not None else ""
        stream = self._public(request, "/twilio/media", query, websocket=True)
        return Response(twiml(stream, parameters), media_type="application/xml")

    def admit(self, ws: WebSocket) -> tuple[Refusal | None, str | None]:
        """(a refusal, or None; the call the stream's token was issued for, None where none is needed)."""
        if self.closed is not None:
            return Refusal(403, 1008, self.closed), None
        if self.tokens is None:
            return None, None
        call_sid = self.tokens.take(ws.query_params.get("stream_token"))
        if call_sid is None:
            return Refusal(403, 1008, "a Media Stream opens with the stream_token its TwiML carried, once"), None
        return None, call_sid

    def carrier(self, expected_call: str | None):
        phone = self.settings.phone
        return lambda runner, tandem: PhoneCarrier(runner, tandem, TwilioStream(), lead_frames=phone.lead_frames,
                                                   keypad_to_llm=phone.keypad_to_llm, expected_call=expected_call)

    def _public(self, request: Request, path: str, query: str, websocket: bool = False) -> str:
        """The URL the carrier used (or will use): the configured public one, else this request's scheme and
        host; ws/wss for a stream."""
        base = self.settings.phone.public_url
        if base is None:
            scheme = request.headers.get("x-forwarded-proto", request.url.scheme).split(",")[0].strip()
            base = f"{scheme}://{request.headers.get('host', request.url.netloc)}"
        base = base.rstrip("/")
        if websocket:
            base = base.replace("https://", "wss://", 1).replace("http://", "ws://", 1)
        return f"{base}{path}" + (f"?{query}" if query else "")


async def _read(request: Request) -> str | None:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_WEBHOOK_BYTES:
            return None
    return body.decode("utf-8", "replace")

