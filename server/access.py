"""Who may open a session: bearer tokens (constant-time), browser origins, connections per IP.
A connection is a websocket or, for WebRTC, the POST with the offer (both `HTTPConnection`s)."""

from __future__ import annotations

import hmac
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from starlette.requests import HTTPConnection

from server.client_secrets import ClientSecrets
from server.settings import ServerSettings

KEY_SUBPROTOCOL = "openai-insecure-api-key."


@dataclass(frozen=True)
class Refusal:
    status: int  # HTTP status of the denial response
    close_code: int  # websocket close code, where a denial response cannot be sent
    reason: str


class SharedAddressCounts(Protocol):
    """Connections per address kept for several processes at once (server/front_peers.py's `SharedCounts`)."""

    def admit(self, address: str, limit: int) -> bool: ...

    def leave(self, address: str) -> None: ...


class AccessControl:
    def __init__(self, settings: ServerSettings, shared: SharedAddressCounts | None = None) -> None:
        self._tokens = [t.get_secret_value().encode() for t in settings.auth_tokens]
        self.secrets = ClientSecrets(self._tokens)  # short-lived client secrets open sessions too
        self._origins = set(settings.allowed_origins)
        self._per_ip = settings.max_connections_per_ip
        self.connections: Counter[str] = Counter()  # this process's own (with `shared`: also counted there)
        self._shared = shared

    def admit(self, ws: HTTPConnection) -> Refusal | None:
        """Check the connection and, if it may enter, count it at once (no await between check and
        count, so concurrent connections cannot pass the per-address limit); `leave` when it ends."""
        refusal = self.check(ws)
        if refusal is None and self._shared is not None and not self._shared.admit(_ip(ws), self._per_ip):
            refusal = self._too_many()  # another process took the last place meanwhile
        if refusal is None:
            self.connections[_ip(ws)] += 1
        return refusal

    def check(self, ws: HTTPConnection) -> Refusal | None:
        """Whether a session may open: `credentials`, then the address's sessions under its limit."""
        if (refusal := self.credentials(ws)) is not None:
            return refusal
        if self.connections[_ip(ws)] >= self._per_ip:
            return self._too_many()
        return None

    def credentials(self, ws: HTTPConnection) -> Refusal | None:
        """The token and the origin, for what opens no session (a recording's download, a sideband)."""
        if self._tokens and not self._token_ok(ws):
            return Refusal(401, 1008, "a valid token is required (Authorization: Bearer TOKEN, or ?token=TOKEN)")
        origin = ws.headers.get("origin")
        if origin is not None and not self._origin_ok(origin, ws.headers.get("host", "")):
            return Refusal(403, 1008, f"origin {origin} is not allowed")
        return None

    def _too_many(self) -> Refusal:
        return Refusal(429, 1013, f"at most {self._per_ip} sessions per address")

    def _token_ok(self, ws: HTTPConnection) -> bool:
        """A server token, or a client secret minted from one (`server/client_secrets.py`)."""
        given = _given(ws)
        return self.server_token(given) or self.secrets.valid(given)

    def trusted(self, request: HTTPConnection) -> bool:
        """The connection holds a server token, not a client secret (an open server trusts anyone):
        what minting client secrets and attaching a sideband need."""
        return not self._tokens or self.server_token(_given(request))

    def server_token(self, given: str) -> bool:
        """`given` is one of the server's own tokens (what may mint client secrets)."""
        given_bytes = given.encode()
        matched = False
        for token in self._tokens:  # every token is compared: the time taken says nothing
            matched |= hmac.compare_digest(given_bytes, token)
        return matched

    def origin_allowed(self, origin: str, host: str) -> bool:
        """A browser page on `origin` may connect (CORS answers for it)."""
        return self._origin_ok(origin, host)

    def _origin_ok(self, origin: str, host: str) -> bool:
        if "*" in self._origins or origin in self._origins:
            return True
        return not self._origins and origin in (f"http://{host}", f"https://{host}")

    def leave(self, ws: HTTPConnection) -> None:
        ip = _ip(ws)
        self.connections[ip] -= 1
        if self.connections[ip] <= 0:
            del self.connections[ip]
        if self._shared is not None:
            self._shared.leave(ip)


def _given(ws: HTTPConnection) -> str:
    """The token a connection gives: Bearer header, ?token=, or the Realtime browser clients'
    `openai-insecure-api-key.TOKEN` subprotocol (browsers cannot set the header)."""
    header = ws.headers.get("authorization", "")
    given = header[7:] if header.lower().startswith("bearer ") else ws.query_params.get("token", "")
    for protocol in ws.scope.get("subprotocols", []):
        if not given and protocol.startswith(KEY_SUBPROTOCOL):
            given = protocol[len(KEY_SUBPROTOCOL):]
    return given


def _ip(ws: HTTPConnection) -> str:
    return ws.client.host if ws.client else "unknown"


CLOSE_REASON_BYTES = 123  # a close frame's payload is 125 bytes at most, 2 of them the code


def close_reason(text: str) -> str:
    """`text` cut to what a websocket close frame carries: 123 bytes of UTF-8 (not characters: a reason that
    echoes a client's Japanese would not fit), on a character boundary."""
    return text.encode()[:CLOSE_REASON_BYTES].decode("utf-8", "ignore")
