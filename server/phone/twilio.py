"""Twilio: the TwiML a number's voice URL gets (`<Connect><Stream>`, a bidirectional Media Stream), the
check of Twilio's request signature, the stream's one-call token, and the Media Streams protocol
(`TwilioStream`: JSON text frames; mu-law 8 kHz in 20 ms chunks both ways; marks and clear).

Twilio's references: "TwiML Voice: <Stream>", "Media Streams - WebSocket Messages", "Webhooks security".
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Mapping
from xml.sax.saxutils import quoteattr

from server.phone.messages import json_message, json_object, media_dtmf_mark, shown, strings
from server.phone.streams import CallStarted, CallStopped, PhoneEvent, PhoneProtocolError

TOKEN_TTL_S = 60.0  # a stream token opens the stream within this long of the TwiML that carried it


# -------------------------------------------------------------------- the request's signature


def signature(auth_token: str, url: str, params: Mapping[str, str | list[str]]) -> str:
    """X-Twilio-Signature of a request: HMAC-SHA1 (the account's auth token) of the full URL followed by
    each POST parameter's name and value, names sorted (a repeated name: its values sorted), base64."""
    data = url
    for name in sorted(params):
        values = params[name]
        for value in sorted(values) if isinstance(values, list) else [values]:
            data += name + value
    digest = hmac.new(auth_token.encode(), data.encode(), hashlib.sha1).digest()
    return base64.b64encode(digest).decode()


def signed(auth_token: str, url: str, params: Mapping[str, str | list[str]], given: str | None) -> bool:
    """The request carries Twilio's signature for `url` and `params`. A URL with the default port written
    out or left off may be what Twilio signed: both are tried."""
    if not given:
        return False
    return any(hmac.compare_digest(signature(auth_token, candidate, params), given) for candidate in _ports(url))


def _ports(url: str) -> list[str]:
    """The URL as given, and with its scheme's default port added or taken away."""
    scheme, _, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    default = {"https": "443", "wss": "443", "http": "80", "ws": "80"}.get(scheme)
    if default is None:
        return [url]
    if host.endswith(f":{default}"):
        other = host.removesuffix(f":{default}")
    elif ":" not in host.rsplit("]", 1)[-1]:
        other = f"{host}:{default}"
    else:
        return [url]
    return [url, f"{scheme}://{other}{slash}{path}"]


# -------------------------------------------------------------------- the stream's token


class StreamTokens:
    """A token per TwiML answered: it names the call, lasts TOKEN_TTL_S and opens one stream, whose `start`
    must be that call's. Signed with the auth token (no state to share between processes); "used" is
    remembered by the process that took it."""

    def __init__(self, key: str, ttl_s: float = TOKEN_TTL_S, clock=time.time) -> None:
        self._key, self.ttl_s, self._clock = key.encode(), ttl_s, clock
        self._used: dict[str, float] = {}  # nonce -> when it expires

    def issue(self, call_sid: str) -> str:
        expires = int(self._clock() + self.ttl_s)
        body = f"{call_sid}.{expires}.{secrets.token_urlsafe(12)}"
        return f"{body}.{self._mac(body)}"

    def take(self, token: str | None) -> str | None:
        """The call the token names, once (None: no token, a forged or expired one, or one used already)."""
        if not token or token.count(".") != 3:
            return None
        body, mac = token.rsplit(".", 1)
        call_sid, expires, nonce = body.split(".")
        now = self._clock()
        if not hmac.compare_digest(self._mac(body), mac) or not expires.isdigit() or int(expires) < now:
            return None
        self._used = {n: t for n, t in self._used.items() if t >= now}
        if nonce in self._used:
            return None
        self._used[nonce] = int(expires)
        return call_sid

    def _mac(self, body: str) -> str:
        digest = hmac.new(self._key, b"kame-stream:" + body.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest[:18]).decode()


# -------------------------------------------------------------------- TwiML


def twiml(stream_url: str, parameters: Mapping[str, str]) -> str:
    """`<Connect><Stream>`: Twilio opens a bidirectional Media Stream to `stream_url` and hands the
    stream `parameters` in its start message (customParameters)."""
    inner = "".join(f"<Parameter name={quoteattr(name)} value={quoteattr(value)}/>"
                    for name, value in parameters.items())
    return ('<?xml version="1.0" encoding="UTF-8"?>'
            f"<Response><Connect><Stream url={quoteattr(stream_url)}>{inner}</Stream></Connect></Response>")


# -------------------------------------------------------------------- the Media Stream


class TwilioStream:
    """One call's Media Stream: Twilio's messages in, ours out."""

    name = "twilio"
    marks = True

    def __init__(self) -> None:
        self.stream_sid: str | None = None
        self.call_sid: str | None = None

    def read(self, message: str | bytes) -> list[PhoneEvent]:
        event, data = json_message(message, "Twilio")
        match event:
            case "connected":
                return []
            case "start":
                return [self._start(data)]
            case "stop":  # (before the start too: the caller hung up before the stream began)
                return [CallStopped("the caller hung up (stop)")]
            case "media" | "dtmf" | "mark" if self.stream_sid is None:
                raise PhoneProtocolError(f"a {event} message before the stream's start")
            case "media" | "dtmf" | "mark":
                return media_dtmf_mark(event, data)
        raise PhoneProtocolError(f"unknown event {shown(event)}")

    def _start(self, data: dict) -> CallStarted:
        if self.stream_sid is not None:
            raise PhoneProtocolError("a second start message")
        start = json_object(data, "start")
        stream_sid, call_sid = data.get("streamSid") or start.get("streamSid"), start.get("callSid")
        if not isinstance(stream_sid, str) or not isinstance(call_sid, str):
            raise PhoneProtocolError("start names its streamSid and start.callSid")
        media = start.get("mediaFormat") or {}
        if not isinstance(media, dict) or media.get("encoding", "audio/x-mulaw") != "audio/x-mulaw" \
                or str(media.get("sampleRate", 8000)) != "8000":
            raise PhoneProtocolError(f"a Media Stream is mu-law at 8000 Hz (got {shown(media)})")
        params = strings(start.get("customParameters"), "start.customParameters")
        self.stream_sid, self.call_sid = stream_sid, call_sid
        return CallStarted(call_sid, stream_sid, "audio/pcmu", 8000, params)

    def audio(self, data: bytes) -> list[str]:
        payload = base64.b64encode(data).decode()
        return [json.dumps({"event": "media", "streamSid": self.stream_sid, "media": {"payload": payload}})]

    def mark(self, name: str) -> list[str]:
        return [json.dumps({"event": "mark", "streamSid": self.stream_sid, "mark": {"name": name}})]

    def clear(self) -> list[str]:
        return [json.dumps({"event": "clear", "streamSid": self.stream_sid})]
