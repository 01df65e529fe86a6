"""Short-lived client secrets, as OpenAI's ephemeral keys: a trusted backend holding the server's
token mints one (`POST /v1/realtime/client_secrets`, the openai SDK's
`client.realtime.client_secrets.create`) and hands it to a browser, which opens its sessions with
it (`/v1/live/sessions` over WebRTC or WebSocket, `/v1/realtime`, `/api/chat`) and never holds the
server's token.

A secret is stateless: its expiry and a nonce, signed with HMAC-SHA256 under a key derived from the
server's tokens, so every replica sharing the tokens accepts it and rotating the tokens revokes
every secret. It opens sessions until it expires (a session it opened goes on); it cannot mint
more secrets.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable

from starlette.responses import JSONResponse

from server.http_errors import error_response

PREFIX = "ek_"
MIN_S, MAX_S, DEFAULT_S = 10, 7200, 600  # OpenAI's bounds and default for `expires_after.seconds`


class ClientSecrets:
    def __init__(self, tokens: list[bytes], now: Callable[[], float] = time.time) -> None:
        # no tokens (an open server): secrets still work, signed with a key of this process alone
        material = b"\0".join(sorted(tokens)) if tokens else secrets.token_bytes(32)
        self._key = hashlib.sha256(b"kame client secrets\0" + material).digest()
        self._now = now

    def mint(self, seconds: int = DEFAULT_S) -> tuple[str, int]:
        """A new secret valid for `seconds` (MIN_S to MAX_S) and its expiry (unix seconds)."""
        if not MIN_S <= seconds <= MAX_S:
            raise ValueError(f"expires_after.seconds is between {MIN_S} and {MAX_S}")
        expires_at = int(self._now()) + seconds
        payload = f"{expires_at}.{secrets.token_hex(8)}"
        return f"{PREFIX}{payload}.{self._sign(payload)}", expires_at

    def valid(self, value: str) -> bool:
        """`value` is a secret this server signed and it has not expired."""
        if not value.startswith(PREFIX):
            return False
        payload, _, signature = value[len(PREFIX):].rpartition(".")
        expires, _, _ = payload.partition(".")
        if not hmac.compare_digest(signature.encode(), self._sign(payload).encode()):
            return False
        return expires.isdigit() and int(expires) > self._now()

    def _sign(self, payload: str) -> str:
        return hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest()[:32]


async def create(request, access) -> JSONResponse:
    """`POST /v1/realtime/client_secrets` {expires_after?: {anchor: "created_at", seconds}, session?}:
    a new secret for a caller holding the server's token. `session` is echoed, not applied: the
    client configures its session itself."""
    if not access.trusted(request):
        return _error(401, "invalid_api_key", "minting a client secret needs the server's token")
    try:
        body = await request.json() if await request.body() else {}
    except ValueError:
        return _error(400, "invalid_json", "the body is not JSON")
    if not isinstance(body, dict):
        return _error(400, "invalid_request", "the body is a JSON object")
    if (unknown := sorted(set(body) - {"expires_after", "session"})):
        return _error(400, "unknown_parameter", f"Unknown parameter: '{unknown[0]}'.", unknown[0])
    expires = body.get("expires_after") or {}
    seconds = expires.get("seconds", DEFAULT_S) if isinstance(expires, dict) else None
    if not isinstance(expires, dict) or expires.get("anchor", "created_at") != "created_at" or set(expires) - {
            "anchor", "seconds"} or isinstance(seconds, bool) or not isinstance(seconds, int):
        return _error(400, "invalid_value", "expires_after is {anchor: 'created_at', seconds: int}", "expires_after")
    try:
        value, expires_at = access.secrets.mint(seconds)
    except ValueError as exc:
        return _error(400, "invalid_value", str(exc), "expires_after.seconds")
    session = body.get("session") if isinstance(body.get("session"), dict) else {"type": "realtime"}
    return JSONResponse({"value": value, "expires_at": expires_at, "session": session})


def _error(status: int, code: str, message: str, param: str | None = None) -> JSONResponse:
    return error_response(status, "invalid_request_error", code, message, param)
