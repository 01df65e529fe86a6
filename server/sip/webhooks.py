"""The webhooks KAME's SIP endpoint posts when a call rings (`realtime.call.incoming`, `live.transport.incoming`),
shaped and signed as OpenAI's (Standard Webhooks), so that `OpenAI().webhooks.unwrap` accepts them unchanged."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx2  # the HTTP client the openai package brings: in the base install (httpx is not)

logger = logging.getLogger(__name__)

USER_AGENT = "kame-webhooks"
_SECRET_PREFIX = "whsec_"
# OpenAI leaves these out of `sip_headers` ("excluding SIP authorization headers"): they carry the caller's
# digest credentials, which the application has no business seeing.
_CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization"})
# Statuses a receiver sends for a passing problem (Standard Webhooks retries these); any other 4xx is a refusal.
_RETRIED_4XX = frozenset({408, 409, 429})
# How often a backoff wait asks still_wanted(): a call that stops ringing stops its retries this soon.
_POLL_S = 0.05


def _now() -> float:
    return time.time()


def _key(secret: str) -> bytes:
    """The HMAC key as the OpenAI SDK derives it: base64 after `whsec_`, else the secret's UTF-8 bytes."""
    if secret.startswith(_SECRET_PREFIX):
        return base64.b64decode(secret[len(_SECRET_PREFIX):])
    return secret.encode()


def sign(secret: str, webhook_id: str, timestamp: int, body: bytes) -> str:
    """`v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`, the webhook-signature header's value."""
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    digest = hmac.new(_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def _headers(webhook_id: str, timestamp: int) -> dict[str, str]:
    return {"webhook-id": webhook_id, "webhook-timestamp": str(timestamp),
            "content-type": "application/json", "user-agent": USER_AGENT}


def signed_headers(secret: str, body: bytes, *, webhook_id: str | None = None,
                   now: float | None = None) -> dict[str, str]:
    """The headers of one delivery attempt of `body`, signed now (or at `now`)."""
    webhook_id = webhook_id or _message_id()
    timestamp = int(_now() if now is None else now)
    return _headers(webhook_id, timestamp) | {"webhook-signature": sign(secret, webhook_id, timestamp, body)}


def _message_id() -> str:
    return "msg_" + secrets.token_hex(16)


def event_id() -> str:
    return "evt_" + secrets.token_hex(16)


def _sip_headers(headers: list[tuple[str, str]]) -> list[dict[str, str]]:
    """The INVITE's headers in order, repeats kept, credentials left out."""
    return [{"name": name, "value": value} for name, value in headers
            if name.strip().lower() not in _CREDENTIAL_HEADERS]


def _event(kind: str, data: dict, now: float | None) -> dict:
    created_at = int(_now() if now is None else now)
    return {"object": "event", "id": event_id(), "type": kind, "created_at": created_at, "data": data}


def realtime_call_incoming(call_id: str, sip_headers: list[tuple[str, str]], *, now: float | None = None,
                           sip_media_security: str | None = None) -> dict:
    """The event a Realtime application accepts or rejects `call_id` from (openai.types.webhooks.
    RealtimeCallIncomingWebhookEvent). `sip_media_security` ("rtp" / "srtp") is left out when unknown."""
    data = {"call_id": call_id, "sip_headers": _sip_headers(sip_headers)}
    if sip_media_security is not None:
        data["sip_media_security"] = sip_media_security
    return _event("realtime.call.incoming", data, now)


def live_transport_incoming(session_id: str, sip_headers: list[tuple[str, str]], *, now: float | None = None,
                            sip_media_security: str | None = None) -> dict:
    """The event a Live application accepts or rejects `session_id` from (openai.types.webhooks.
    LiveTransportIncomingWebhookEvent)."""
    data = {"session_id": session_id, "sip_headers": _sip_headers(sip_headers), "type": "sip"}
    if sip_media_security is not None:
        data["sip_media_security"] = sip_media_security
    return _event("live.transport.incoming", data, now)


@dataclass(frozen=True)
class Delivery:
    delivered: bool
    attempts: int
    status: int | None  # the last HTTP status; None when no attempt got an answer
    error: str | None


def _retried(status: int | None) -> bool:
    return status is None or status >= 500 or status in _RETRIED_4XX


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds; its HTTP-date form is not honoured (the backoff applies)."""
    try:
        seconds = float(value) if value is not None else math.nan
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _loggable(url: httpx2.URL) -> str:
    """The URL without credentials or query, which may hold a token."""
    port = f":{url.port}" if url.port else ""
    return f"{url.scheme}://{url.host}{port}{url.path}"


async def _wait(seconds: float, still_wanted: Callable[[], bool]) -> None:
    """Sleep `seconds`, or less once the delivery is no longer wanted."""
    deadline = time.monotonic() + seconds
    while still_wanted():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        await asyncio.sleep(min(left, _POLL_S))


class WebhookPoster:
    """Posts events to one URL, retrying what may pass (5xx, 408/409/429, no answer) while the call rings."""

    def __init__(self, url: str, secret: str | None, *, timeout_s: float = 5.0,
                 backoff_s: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0),
                 client: httpx2.AsyncClient | None = None) -> None:
        self._url = httpx2.URL(url)
        if self._url.scheme not in ("http", "https") or not self._url.host:
            raise ValueError(f"webhook URL must be http(s)://host/...: {_loggable(self._url)}")
        if secret is not None:
            _check_secret(secret)
        else:
            logger.warning("webhooks to %s are posted UNSIGNED (no webhook secret): for a local test receiver only",
                           _loggable(self._url))
        self._secret = secret
        self._timeout_s = timeout_s
        self._backoff_s = tuple(backoff_s)
        self._own_client = client is None
        self._client = client if client is not None else httpx2.AsyncClient(timeout=timeout_s, follow_redirects=False)

    async def post(self, event: dict, *, still_wanted: Callable[[], bool] = lambda: True) -> Delivery:
        """Deliver `event`: one body and webhook-id for every attempt, signed afresh each time."""
        body = json.dumps(event, separators=(",", ":")).encode()
        webhook_id = _message_id()
        name = f"{event.get('type')} {event.get('id')}"
        attempts, status, error = 0, None, None
        for delay in (*self._backoff_s, None):
            if not still_wanted():
                logger.info("webhook %s: no longer wanted after %d attempt(s)", name, attempts)
                return Delivery(False, attempts, status, f"no longer wanted (last: {error or 'none'})")
            attempts += 1
            status, error, retry_after = await self._attempt(webhook_id, body)
            if error is None:
                logger.debug("webhook %s delivered to %s (HTTP %s)", name, _loggable(self._url), status)
                return Delivery(True, attempts, status, None)
            if not _retried(status):
                logger.warning("webhook %s refused by %s: %s", name, _loggable(self._url), error)
                return Delivery(False, attempts, status, error)
            if delay is None:
                break
            wait = delay if retry_after is None else min(retry_after, delay)
            logger.info("webhook %s to %s: %s; retrying in %.2f s", name, _loggable(self._url), error, wait)
            await _wait(wait, still_wanted)
        logger.warning("webhook %s to %s given up after %d attempt(s): %s", name, _loggable(self._url), attempts, error)
        return Delivery(False, attempts, status, error)

    async def _attempt(self, webhook_id: str, body: bytes) -> tuple[int | None, str | None, float | None]:
        """(status, error or None when delivered, Retry-After seconds) of one POST."""
        try:
            # the total bound: httpx's timeout is per read, and a trickling receiver would outlast the ring
            async with asyncio.timeout(self._timeout_s):
                response = await self._client.post(self._url, content=body, headers=self._headers(webhook_id, body),
                                                   timeout=self._timeout_s)
        except (TimeoutError, httpx2.TimeoutException):
            return None, f"no answer within {self._timeout_s:g} s", None
        except (httpx2.HTTPError, OSError) as exc:
            return None, f"{type(exc).__name__}: {exc}", None
        if response.is_success:
            return response.status_code, None, None
        return response.status_code, f"HTTP {response.status_code}", _retry_after(response.headers.get("retry-after"))

    def _headers(self, webhook_id: str, body: bytes) -> dict[str, str]:
        if self._secret is None:
            return _headers(webhook_id, int(_now()))
        return signed_headers(self._secret, body, webhook_id=webhook_id)

    async def aclose(self) -> None:
        """Close the HTTP client if this poster made it (a client passed in is its owner's to close)."""
        if self._own_client:
            await self._client.aclose()


def _check_secret(secret: str) -> None:
    """Fail at start-up, not on the first call, on a secret the SDK could not use either (never echoing it)."""
    try:
        key = _key(secret)
    except (binascii.Error, ValueError):
        raise ValueError("webhook secret: the part after 'whsec_' is not valid base64") from None
    if not key:
        raise ValueError("webhook secret is empty; pass None to post unsigned")
