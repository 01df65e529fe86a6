"""SIP messages (RFC 3261 §7, §20, §25): parsing one from a datagram or a stream, writing one, and the
header values a user agent reads (Via, name-addr, URI, CSeq). Anything malformed is a SipError naming the
part at fault, never an IndexError."""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

MAX_MESSAGE_BYTES = 64 * 1024  # a call's INVITE is a few KB; a datagram cannot be bigger anyway
MAX_HEADERS = 120
BRANCH_MAGIC = "z9hG4bK"  # RFC 3261 §8.1.1.7: a branch made by an RFC 3261 element starts so

# compact forms (RFC 3261 §7.3.3, RFC 3515, RFC 4028, RFC 3265) and the canonical spelling of the others
COMPACT = {"v": "Via", "f": "From", "t": "To", "i": "Call-ID", "m": "Contact", "l": "Content-Length",
           "c": "Content-Type", "k": "Supported", "s": "Subject", "e": "Content-Encoding", "o": "Event",
           "r": "Refer-To", "b": "Referred-By", "x": "Session-Expires", "u": "Allow-Events"}
CANONICAL = {name.lower(): name for name in (
    "Via", "From", "To", "Call-ID", "CSeq", "Contact", "Max-Forwards", "Content-Length", "Content-Type", "Allow",
    "Supported", "Require", "Record-Route", "Route", "User-Agent", "Server", "WWW-Authenticate", "Authorization",
    "Proxy-Authenticate", "Proxy-Authorization", "Refer-To", "Referred-By", "Event", "Subscription-State",
    "Accept", "Retry-After", "Reason", "Expires", "Session-Expires", "Min-SE", "Unsupported", "Warning",
    "Allow-Events", "P-Asserted-Identity", "Diversion", "Content-Disposition", "Timestamp")}
# headers whose comma-separated values are separate header fields (§7.3.1); others keep their commas
LISTS = {"via", "route", "record-route", "contact", "allow", "supported", "require", "accept", "unsupported",
         "allow-events"}
MANDATORY = ("Via", "From", "To", "Call-ID", "CSeq")

REASONS = {100: "Trying", 180: "Ringing", 183: "Session Progress", 200: "OK", 202: "Accepted",
           400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
           407: "Proxy Authentication Required", 408: "Request Timeout", 413: "Request Entity Too Large",
           415: "Unsupported Media Type", 420: "Bad Extension", 480: "Temporarily Unavailable",
           481: "Call/Transaction Does Not Exist", 482: "Loop Detected", 483: "Too Many Hops", 486: "Busy Here",
           487: "Request Terminated", 488: "Not Acceptable Here", 491: "Request Pending", 500: "Server Internal Error",
           501: "Not Implemented", 503: "Service Unavailable", 505: "Version Not Supported", 603: "Decline"}

_TOKEN = re.compile(r"^[A-Za-z0-9.!%*_+`'~-]+$")
_STATUS_LINE = re.compile(r"^SIP/2\.0 ([1-6][0-9]{2})(?: (.*))?$")  # exactly 3 digits (RFC 4475 §3.1.2.18)
_DIGITS = re.compile(r"^[0-9]+$")  # ASCII digits only: str.isdigit() also takes '²', which int() refuses
_VIA_PROTOCOL = re.compile(r"^SIP\s*/\s*2\.0\s*/\s*([A-Za-z0-9.!%*_+`'~-]+)\s+(.*)$", re.IGNORECASE | re.DOTALL)


class SipError(ValueError):
    """A message that cannot be read; `status`: what a request gets back (400 by default)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def canonical(name: str) -> str:
    name = name.strip()
    lower = name.lower()
    if lower in COMPACT:
        return COMPACT[lower]
    return CANONICAL.get(lower, name)


@dataclass
class Headers:
    """Header fields in order; names compared without case, compact forms read as their full names."""

    items: list[tuple[str, str]] = field(default_factory=list)

    def get(self, name: str, default: str | None = None) -> str | None:
        name = canonical(name).lower()
        return next((value for key, value in self.items if key.lower() == name), default)

    def all(self, name: str) -> list[str]:
        name = canonical(name).lower()
        return [value for key, value in self.items if key.lower() == name]

    def add(self, name: str, value: str) -> None:
        self.items.append((canonical(name), value))

    def set(self, name: str, value: str) -> None:
        """Replace every field of `name` by one (added at the end when there was none)."""
        name = canonical(name)
        index = next((i for i, (key, _) in enumerate(self.items) if key.lower() == name.lower()), None)
        self.remove(name)
        if index is None:
            self.items.append((name, value))
        else:
            self.items.insert(index, (name, value))

    def remove(self, name: str) -> None:
        name = canonical(name).lower()
        self.items = [(key, value) for key, value in self.items if key.lower() != name]

    def __contains__(self, name: str) -> bool:
        return self.get(name) is not None

    def copy(self) -> Headers:
        return Headers(list(self.items))


class _Fields:
    """What requests and responses both carry and the user agent reads of them."""

    headers: Headers

    @property
    def cseq(self) -> tuple[int, str]:
        return parse_cseq(self.headers.get("CSeq") or "")

    @property
    def call_id(self) -> str:
        return self.headers.get("Call-ID") or ""

    @property
    def top_via(self) -> Via:
        return Via.parse(self.headers.get("Via") or "")


@dataclass
class Request(_Fields):
    method: str
    uri: str
    headers: Headers = field(default_factory=Headers)
    body: bytes = b""

    def __bytes__(self) -> bytes:
        return _write(f"{self.method} {self.uri} SIP/2.0", self.headers, self.body)


@dataclass
class Response(_Fields):
    status: int
    reason: str = ""
    headers: Headers = field(default_factory=Headers)
    body: bytes = b""

    def __bytes__(self) -> bytes:
        return _write(f"SIP/2.0 {self.status} {self.reason or REASONS.get(self.status, 'Unknown')}",
                      self.headers, self.body)


Message = Request | Response


def _write(start: str, headers: Headers, body: bytes) -> bytes:
    lines = [start]
    lines += [f"{name}: {value}" for name, value in headers.items if name.lower() != "content-length"]
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


# ---------------------------------------------------------------- parsing


def parse(data: bytes, *, stream: bool = False) -> Message:
    """One message: a datagram's whole content (a body beyond Content-Length is cut; `stream`: the caller
    framed it by Content-Length already). SipError for anything malformed."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise SipError(f"a message of {len(data)} bytes (at most {MAX_MESSAGE_BYTES})", 413)
    head, separator, body = data.partition(b"\r\n\r\n")
    if not separator:
        head, separator, body = data.partition(b"\n\n")  # bare LF: tolerated (§7.5 asks to be lenient)
        if not separator:
            raise SipError("no empty line ends the headers")
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        raise SipError("the headers are not UTF-8") from None
    start, *rest = _unfold(text.lstrip("\r\n"))
    headers = Headers()
    for line in rest:
        name, colon, value = line.partition(":")
        if not colon or not _TOKEN.match(name.strip()):
            raise SipError(f"a header line without a name: {line[:60]!r}")
        _add_field(headers, name, value.strip())
        if len(headers.items) > MAX_HEADERS:
            raise SipError(f"more than {MAX_HEADERS} header fields", 413)
    body = _framed_body(headers, body, stream)
    message = _start_line(start, headers, body)
    validate(message)
    return message


def _unfold(text: str) -> list[str]:
    """Lines, with a continuation line (leading whitespace) joined to the one before (§7.3.1)."""
    lines: list[str] = []
    for line in re.split(r"\r?\n", text):
        if line[:1] in (" ", "\t") and lines:
            lines[-1] += " " + line.strip()
        elif line:
            lines.append(line)
    if not lines:
        raise SipError("an empty message")
    return lines


def _add_field(headers: Headers, name: str, value: str) -> None:
    if canonical(name).lower() in LISTS and "," in value:
        for part in split_list(value):
            headers.add(name, part)
    else:
        headers.add(name, value)


def _framed_body(headers: Headers, body: bytes, stream: bool) -> bytes:
    lengths = headers.all("Content-Length")
    if len(lengths) > 1:  # which one frames the body? (RFC 4475 §3.3.9)
        raise SipError(f"{len(lengths)} Content-Length fields")
    length = lengths[0] if lengths else None
    if length is None:
        if stream:
            raise SipError("a message on a stream without Content-Length")
        return body
    if not re.match(r"^-?[0-9]+$", length):  # int() would also take '+5', '1_0' and other scripts' digits
        raise SipError(f"Content-Length is not a number: {length[:20]!r}")
    size = int(length)
    if size < 0 or size > len(body):
        raise SipError(f"Content-Length {size} but {len(body)} bytes of body")
    return body[:size]


def _start_line(start: str, headers: Headers, body: bytes) -> Message:
    if start.startswith("SIP/"):
        match = _STATUS_LINE.match(start)
        if match is None:
            raise SipError(f"a bad status line: {start[:60]!r}")
        return Response(int(match.group(1)), match.group(2) or "", headers, body)
    parts = start.split(" ")
    if len(parts) != 3 or not _TOKEN.match(parts[0]) or not parts[1]:
        raise SipError(f"a bad request line: {start[:60]!r}")
    if parts[2] != "SIP/2.0":
        raise SipError(f"version {parts[2][:20]!r} (SIP/2.0 only)", 505)
    return Request(parts[0].upper(), parts[1], headers, body)


def validate(message: Message) -> None:
    """The header fields every message needs (§8.1.1), readable."""
    for name in MANDATORY:
        if message.headers.get(name) is None:
            raise SipError(f"no {name} header")
    number, method = message.cseq
    if isinstance(message, Request) and method != message.method:
        raise SipError(f"CSeq's method {method} is not the request's {message.method}")
    message.top_via  # noqa: B018 (parsed: SipError when unreadable)
    NameAddr.parse(message.headers.get("From") or "")
    NameAddr.parse(message.headers.get("To") or "")


class StreamFramer:
    """Messages out of a TCP/TLS byte stream, framed by Content-Length (§18.3); keep-alive CRLFs skipped."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> Iterator[Message]:
        self._buffer += data
        while True:
            while self._buffer[:2] == b"\r\n":
                del self._buffer[:2]
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > MAX_MESSAGE_BYTES:
                    raise SipError("headers longer than a message may be", 413)
                return
            length = _content_length(bytes(self._buffer[:end]))
            total = end + 4 + length
            if total > MAX_MESSAGE_BYTES:
                raise SipError(f"a message of {total} bytes (at most {MAX_MESSAGE_BYTES})", 413)
            if len(self._buffer) < total:
                return
            data, self._buffer = bytes(self._buffer[:total]), self._buffer[total:]
            yield parse(data, stream=True)


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() in (b"content-length", b"l"):
            try:
                return max(0, int(value.strip()))
            except ValueError:
                raise SipError("Content-Length is not a number") from None
    raise SipError("a message on a stream without Content-Length")


# ---------------------------------------------------------------- header values


def split_list(value: str) -> list[str]:
    """A header's comma-separated values, commas inside quotes or <...> kept."""
    parts, current, quoted, angle = [], [], False, False
    escaped = False
    for char in value:
        if escaped:
            escaped = False
        elif char == "\\" and quoted:
            escaped = True
        elif char == '"':
            quoted = not quoted
        elif char == "<" and not quoted:
            angle = True
        elif char == ">" and not quoted:
            angle = False
        elif char == "," and not quoted and not angle:
            parts.append("".join(current).strip())
            current = []
            continue
        current.append(char)
    parts.append("".join(current).strip())
    return [part for part in parts if part]


def parse_params(text: str) -> dict[str, str]:
    """`;a=b;c` -> {"a": "b", "c": ""} (names lower-cased; quoted values unquoted)."""
    params: dict[str, str] = {}
    for part in _split_outside_quotes(text, ";"):
        name, _, value = part.strip().partition("=")
        if name:
            params[name.strip().lower()] = value.strip().strip('"')
    return params


def _split_outside_quotes(text: str, separator: str) -> list[str]:
    parts, current, quoted = [], [], False
    for char in text:
        if char == '"':
            quoted = not quoted
        if char == separator and not quoted:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return parts


def _find_unquoted(text: str, char: str) -> int:
    """Where `char` first occurs outside a quoted string (-1: nowhere); SipError for an unclosed quote."""
    quoted = escaped = False
    for index, current in enumerate(text):
        if escaped:
            escaped = False
        elif quoted and current == "\\":
            escaped = True
        elif current == '"':
            quoted = not quoted
        elif current == char and not quoted:
            return index
    if quoted:
        raise SipError(f"an unclosed quoted string: {text[:60]!r}")
    return -1


def _unquote(display: str) -> str:
    """A display name: a quoted-string's content with its escapes undone, or the tokens as they are."""
    if len(display) < 2 or not (display.startswith('"') and display.endswith('"')):
        return display
    return re.sub(r"\\(.)", r"\1", display[1:-1], flags=re.DOTALL)


def format_params(params: dict[str, str]) -> str:
    return "".join(f";{name}={value}" if value else f";{name}" for name, value in params.items())


def parse_cseq(value: str) -> tuple[int, str]:
    parts = value.split()
    if len(parts) != 2 or not _DIGITS.match(parts[0]) or not _TOKEN.match(parts[1]) or int(parts[0]) >= 2**31:
        raise SipError(f"a bad CSeq: {value[:40]!r}")
    return int(parts[0]), parts[1].upper()


@dataclass(frozen=True)
class SipUri:
    """sip:user@host:port;params (sips: too; a tel: URI is kept whole in `host`)."""

    scheme: str
    user: str | None
    host: str
    port: int | None = None
    params: dict[str, str] = field(default_factory=dict, compare=False)

    @staticmethod
    def parse(text: str) -> SipUri:
        text = text.strip()
        scheme, colon, rest = text.partition(":")
        scheme = scheme.lower()
        if not colon or scheme not in ("sip", "sips", "tel"):
            raise SipError(f"not a SIP URI: {text[:60]!r}")
        if scheme == "tel":
            return SipUri(scheme, None, rest)
        user, at, rest = rest.partition("@")  # a user part may hold ';' and '?', never '@'
        if not at:
            user, rest = "", user
        rest = rest.split("?", 1)[0]
        hostport, *params = rest.split(";")
        host, port = split_hostport(hostport)
        return SipUri(scheme, user if at else None, host, port, parse_params(";" + ";".join(params)))

    def __str__(self) -> str:
        if self.scheme == "tel":
            return f"tel:{self.host}"
        user = f"{self.user}@" if self.user else ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = f":{self.port}" if self.port else ""
        return f"{self.scheme}:{user}{host}{port}{format_params(self.params)}"

    def with_params(self, **params: str) -> SipUri:
        return replace(self, params={**self.params, **params})


def split_hostport(text: str) -> tuple[str, int | None]:
    text = text.strip()
    if text.startswith("["):  # an IPv6 reference
        end = text.find("]")
        if end < 0:
            raise SipError(f"a bad host: {text[:60]!r}")
        host, rest = text[1:end], text[end + 1:]
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port_text = text.partition(":")
    host, port_text = host.strip(), port_text.strip()  # sent-by's COLON may have LWS around it
    if not host or any(char in host for char in ' <>"'):
        raise SipError(f"a bad host: {text[:60]!r}")
    if not port_text:
        return host, None
    if not _DIGITS.match(port_text) or not 0 < int(port_text) < 65536:
        raise SipError(f"a bad port: {port_text[:20]!r}")
    return host, int(port_text)


@dataclass(frozen=True)
class NameAddr:
    """From, To, Contact, Refer-To: `"Display" <uri>;params` or a bare `uri;params`."""

    uri: str
    display: str = ""
    params: dict[str, str] = field(default_factory=dict, compare=False)

    @staticmethod
    def parse(text: str) -> NameAddr:
        text = text.strip()
        opening = _find_unquoted(text, "<")
        if opening >= 0:
            display, rest = text[:opening], text[opening + 1:]
            uri, closing, params = rest.partition(">")
            if not closing:
                raise SipError(f"a '<' without '>': {text[:60]!r}")
            display = _unquote(display.strip())
        else:  # addr-spec: its parameters are the header's (§20.10)
            uri, _, params = text.partition(";")
            params, display = ";" + params if params else "", ""
        if not uri.strip():
            raise SipError(f"no URI in {text[:60]!r}")
        if uri.strip() == "*":
            return NameAddr("*")
        SipUri.parse(uri)
        return NameAddr(uri.strip(), display, parse_params(params))

    @property
    def tag(self) -> str | None:
        return self.params.get("tag") or None

    def __str__(self) -> str:
        quoted = self.display.replace("\\", "\\\\").replace('"', '\\"')
        display = f'"{quoted}" ' if self.display else ""
        return f"{display}<{self.uri}>{format_params(self.params)}"

    def with_tag(self, tag: str) -> NameAddr:
        return replace(self, params={**self.params, "tag": tag})


@dataclass(frozen=True)
class Via:
    """`SIP/2.0/UDP host:port;branch=...;rport;received=...`."""

    transport: str
    host: str
    port: int | None
    params: dict[str, str] = field(default_factory=dict, compare=False)

    @staticmethod
    def parse(text: str) -> Via:
        match = _VIA_PROTOCOL.match(text.strip())  # SLASH may have LWS around it (RFC 4475 §3.1.1.1)
        if match is None:
            raise SipError(f"a bad Via: {text[:60]!r}")
        sent_by, *params = match.group(2).strip().split(";")
        host, port = split_hostport(sent_by)
        return Via(match.group(1).upper(), host, port, parse_params(";" + ";".join(params)))

    @property
    def branch(self) -> str:
        return self.params.get("branch", "")

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = f":{self.port}" if self.port else ""
        return f"SIP/2.0/{self.transport} {host}{port}{format_params(self.params)}"


def new_branch() -> str:
    return BRANCH_MAGIC + secrets.token_hex(8)


def new_tag() -> str:
    return secrets.token_hex(6)


def new_call_id(host: str) -> str:
    return f"{secrets.token_hex(12)}@{host}"


def response_to(request: Request, status: int, reason: str = "", *, to_tag: str | None = None,
                headers: Iterable[tuple[str, str]] = (), body: bytes = b"",
                content_type: str | None = None) -> Response:
    """A response with what §8.2.6.2 copies from its request (Vias, From, To with our tag, Call-ID, CSeq)."""
    out = Headers()
    for via in request.headers.all("Via"):
        out.add("Via", via)
    out.add("From", request.headers.get("From") or "")
    to = request.headers.get("To") or ""
    if to_tag is not None and status > 100:
        parsed = NameAddr.parse(to)
        if parsed.tag is None:
            to = str(parsed.with_tag(to_tag))
    out.add("To", to)
    out.add("Call-ID", request.call_id)
    out.add("CSeq", request.headers.get("CSeq") or "")
    for name, value in headers:
        out.add(name, value)
    if body:
        out.add("Content-Type", content_type or "application/sdp")
    return Response(status, reason or REASONS.get(status, ""), out, body)
