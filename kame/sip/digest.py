"""Digest authentication for SIP (RFC 3261 §22, RFC 2617, RFC 7616 with MD5 and SHA-256): answering a carrier's
401/407 challenge, and on the server side issuing stateless nonces and checking a caller's credentials."""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

# RFC 7616 §6.1's names, upper-cased for a case-insensitive look-up -> the spelling we write back
ALGORITHMS = {"MD5": "MD5", "MD5-SESS": "MD5-sess", "SHA-256": "SHA-256", "SHA-256-SESS": "SHA-256-sess"}
_STRENGTH = {"MD5": 1, "MD5-sess": 1, "SHA-256": 2, "SHA-256-sess": 2}  # best_challenge prefers the higher
_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # an RFC 7230 token
_BARE_VALUE = re.compile(r"[^\s,\"]+")  # an unquoted value; lenient: some servers leave '/' or '=' unquoted
_SCHEME = re.compile(r"\s*([!#$%&'*+\-.^_`|~0-9A-Za-z]+)(?:\s+|$)(.*)", re.DOTALL)
_NONCE_COUNT = re.compile(r"[0-9a-fA-F]{8}")
_SPACE = " \t\r\n"


class DigestError(ValueError):
    """A challenge or credentials that cannot be read or answered."""


@dataclass(frozen=True)
class Challenge:
    """A WWW-Authenticate or Proxy-Authenticate Digest challenge."""

    realm: str
    nonce: str
    algorithm: str = "MD5"  # "MD5", "MD5-sess", "SHA-256", "SHA-256-sess"
    qop: tuple[str, ...] = ()  # e.g. ("auth", "auth-int"); we answer with "auth" when offered, else without qop
    opaque: str | None = None
    stale: bool = False

    def header_value(self) -> str:
        """The challenge as a server writes it in a 401's WWW-Authenticate (or a 407's Proxy-Authenticate)."""
        parts = [f"realm={_quote(self.realm)}", f"nonce={_quote(self.nonce)}", f"algorithm={self.algorithm}"]
        if self.qop:
            parts.append(f"qop={_quote(','.join(self.qop))}")
        if self.opaque is not None:
            parts.append(f"opaque={_quote(self.opaque)}")
        if self.stale:
            parts.append("stale=true")
        return "Digest " + ", ".join(parts)


def parse_challenge(value: str) -> Challenge:
    """Read a WWW-Authenticate / Proxy-Authenticate value; DigestError if it is not Digest, lacks realm or nonce,
    or names an algorithm we do not have."""
    params = _digest_params(value)
    for name in ("realm", "nonce"):
        if name not in params:
            raise DigestError(f"the Digest challenge has no {name}: {value!r}")
    qop = tuple(token.strip().lower() for token in params.get("qop", "").split(",") if token.strip())
    return Challenge(realm=params["realm"], nonce=params["nonce"], algorithm=_algorithm(params.get("algorithm")),
                     qop=qop, opaque=params.get("opaque"), stale=params.get("stale", "").lower() == "true")


def best_challenge(values: list[str]) -> Challenge:
    """The challenge to answer among several (one per header): SHA-256 before MD5, else the first offered."""
    challenges, problems = [], []
    for value in values:
        try:
            challenges.append(parse_challenge(value))
        except DigestError as error:
            problems.append(str(error))
    if not challenges:
        raise DigestError("no Digest challenge we can answer" + (": " + "; ".join(problems) if problems else ""))
    # max() keeps the first of equals: among challenges of one strength, the server's order decides
    return max(challenges, key=lambda challenge: _STRENGTH[challenge.algorithm])


def authorization(challenge: Challenge, *, method: str, uri: str, username: str, password: str,
                  cnonce: str | None = None, nc: int = 1) -> str:
    """The Authorization (or Proxy-Authorization) value answering `challenge` for a `method` request to `uri`."""
    if not 0 < nc <= 0xFFFFFFFF:
        raise DigestError(f"nc: {nc} is not a nonce count 1-ffffffff")
    algorithm = _algorithm(challenge.algorithm)  # a Challenge built by hand may spell it "md5"
    qop = "auth" if "auth" in challenge.qop else None  # auth-int would hash the body: not supported
    if qop or algorithm.endswith("-sess"):
        cnonce = cnonce or secrets.token_hex(8)
    count = f"{nc:08x}"
    response = _response(algorithm, username=username, realm=challenge.realm, password=password,
                         method=method, uri=uri, nonce=challenge.nonce, cnonce=cnonce, nc=count, qop=qop)
    parts = [f"username={_quote(username)}", f"realm={_quote(challenge.realm)}", f"nonce={_quote(challenge.nonce)}",
             f"uri={_quote(uri)}", f"response={_quote(response)}", f"algorithm={algorithm}"]
    if cnonce is not None:
        parts.append(f"cnonce={_quote(cnonce)}")
    if qop:
        parts += [f"nc={count}", f"qop={qop}"]
    if challenge.opaque is not None:
        parts.append(f"opaque={_quote(challenge.opaque)}")
    return "Digest " + ", ".join(parts)


def parse_credentials(value: str) -> dict[str, str]:
    """An Authorization / Proxy-Authorization Digest value's parameters (names lower-cased, values unquoted)."""
    return _digest_params(value)


def verify(value: str, *, method: str, realm: str, password: Callable[[str], str | None],
           nonce_ok: Callable[[str], bool], uri: str | None = None) -> str | None:
    """The username when the credentials in `value` answer a challenge of ours for this request, else None.

    `password(username)` gives the user's password (None: no such user); `nonce_ok(nonce)` says whether we issued
    the nonce and it is still fresh; `uri`, when given, is the Request-URI the credentials must name (so that they
    cannot be replayed against another one). Nonce counts are not tracked: a nonce is good until it expires."""
    try:
        params = parse_credentials(value)
        algorithm = _algorithm(params.get("algorithm"))
    except DigestError:
        return None
    if not _well_formed(params, algorithm) or params["realm"] != realm:
        return None
    if (uri is not None and params["uri"] != uri) or not nonce_ok(params["nonce"]):
        return None
    secret = password(params["username"])
    if secret is None:
        return None
    qop = params.get("qop", "").lower() or None
    expected = _response(algorithm, username=params["username"], realm=realm, password=secret, method=method,
                         uri=params["uri"], nonce=params["nonce"], cnonce=params.get("cnonce"),
                         nc=params.get("nc", ""), qop=qop)
    # bytes: compare_digest refuses a str with non-ASCII characters, which a forged header may well have
    if hmac.compare_digest(expected.encode(), params["response"].lower().encode()):
        return params["username"]
    return None


def _well_formed(params: dict[str, str], algorithm: str) -> bool:
    if any(name not in params for name in ("username", "realm", "nonce", "uri", "response")):
        return False
    qop = params.get("qop", "").lower()
    if qop not in ("", "auth"):
        return False
    if qop and not (_NONCE_COUNT.fullmatch(params.get("nc", "")) and params.get("cnonce")):
        return False
    return not (algorithm.endswith("-sess") and not params.get("cnonce"))


class NonceIssuer:
    """Server-side nonces: a timestamp and random bytes, signed with HMAC-SHA256, so that any nonce issued is
    checked without being stored, and expires `lifetime_s` after it was issued."""

    _BODY = 16  # 8 bytes of milliseconds, 8 random (two nonces of one millisecond differ)
    _MAC = 16  # 128 bits of HMAC-SHA256: forging one is out of reach
    _SHAPE = re.compile(r"[A-Za-z0-9_-]{43}")  # 32 bytes in unpadded base64url

    def __init__(self, secret: bytes, lifetime_s: float = 300.0, clock: Callable[[], float] = time.time):
        if len(secret) < 16:
            raise ValueError(f"secret: {len(secret)} bytes; a nonce key needs at least 16")
        if lifetime_s <= 0:
            raise ValueError(f"lifetime_s: {lifetime_s} must be positive")
        self._secret = secret
        self.lifetime_s = lifetime_s
        self._clock = clock

    def issue(self) -> str:
        # floor, not round: a stamp rounded up would be a fraction of a millisecond in the future, hence refused
        body = math.floor(self._clock() * 1000).to_bytes(8, "big", signed=True) + secrets.token_bytes(8)
        return base64.urlsafe_b64encode(body + self._sign(body)).rstrip(b"=").decode("ascii")

    def valid(self, nonce: str) -> bool:
        # the shape first: b64decode would skip characters outside the alphabet, letting variants of one nonce pass
        if not self._SHAPE.fullmatch(nonce):
            return False
        raw = base64.urlsafe_b64decode(nonce + "=")
        body, mac = raw[:self._BODY], raw[self._BODY:]
        if not hmac.compare_digest(mac, self._sign(body)):
            return False
        age = self._clock() - int.from_bytes(body[:8], "big", signed=True) / 1000
        return 0 <= age <= self.lifetime_s

    def _sign(self, body: bytes) -> bytes:
        return hmac.new(self._secret, body, hashlib.sha256).digest()[:self._MAC]


def _response(algorithm: str, *, username: str, realm: str, password: str, method: str, uri: str, nonce: str,
              cnonce: str | None, nc: str, qop: str | None) -> str:
    """RFC 2617 §3.2.2.1 (RFC 7616 §3.4.1): the request-digest, in lower-case hex."""
    digest = hashlib.sha256 if algorithm.startswith("SHA-256") else hashlib.md5

    def h(text: str) -> str:
        return digest(text.encode("utf-8")).hexdigest()

    ha1 = h(f"{username}:{realm}:{password}")
    if algorithm.endswith("-sess"):
        ha1 = h(f"{ha1}:{nonce}:{cnonce}")
    ha2 = h(f"{method}:{uri}")
    if qop:
        return h(f"{ha1}:{nonce}:{nc}:{cnonce}:{qop}:{ha2}")
    return h(f"{ha1}:{nonce}:{ha2}")  # RFC 2069, for servers that offer no qop


def _algorithm(name: str | None) -> str:
    if name is None:
        return "MD5"  # RFC 2617 §3.2.1: absent means MD5
    if name.upper() not in ALGORITHMS:
        raise DigestError(f"algorithm: {name!r} is not supported (we have {', '.join(ALGORITHMS.values())})")
    return ALGORITHMS[name.upper()]


def _digest_params(value: str) -> dict[str, str]:
    match = _SCHEME.match(value)
    if not match or match.group(1).lower() != "digest":
        scheme = match.group(1) if match else value.strip()[:20]
        raise DigestError(f"not a Digest challenge or credentials: the scheme is {scheme!r}")
    return _params(match.group(2))


def _params(text: str) -> dict[str, str]:
    """`name=value, name="quoted, value"` pairs (RFC 7235 auth-param); names are case-insensitive."""
    params: dict[str, str] = {}
    position = 0
    while True:
        position = _skip(text, position, _SPACE + ",")  # empty list elements are allowed (RFC 7230 §7)
        if position >= len(text):
            return params
        name, position = _name(text, position)
        position = _skip(text, position, _SPACE)
        if text[position:position + 1] != "=":
            raise DigestError(f"parameter {name}: no '=' after its name")
        value, position = _value(text, _skip(text, position + 1, _SPACE), name)
        if name in params:
            raise DigestError(f"parameter {name} is given twice")
        params[name] = value
        position = _skip(text, position, _SPACE)
        if position < len(text) and text[position] != ",":
            raise DigestError(f"parameter {name}: expected ',' after its value, found {text[position:position + 20]!r}")


def _skip(text: str, position: int, characters: str) -> int:
    while position < len(text) and text[position] in characters:
        position += 1
    return position


def _name(text: str, position: int) -> tuple[str, int]:
    match = _NAME.match(text, position)
    if not match:
        raise DigestError(f"expected a parameter name at {text[position:position + 20]!r}")
    return match.group().lower(), match.end()


def _value(text: str, position: int, name: str) -> tuple[str, int]:
    if text[position:position + 1] == '"':
        return _unquote(text, position + 1, name)
    match = _BARE_VALUE.match(text, position)
    if not match:
        raise DigestError(f"parameter {name}: no value")
    return match.group(), match.end()


def _unquote(text: str, position: int, name: str) -> tuple[str, int]:
    """A quoted-string's content from just after its opening quote; a backslash escapes the next character."""
    characters = []
    while position < len(text):
        character = text[position]
        if character == '"':
            return "".join(characters), position + 1
        if character == "\\" and position + 1 < len(text):
            position += 1
            character = text[position]
        characters.append(character)
        position += 1
    raise DigestError(f"parameter {name}: its quoted value has no closing quote")


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
