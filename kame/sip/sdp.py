"""SDP for phone calls (RFC 4566) and the offer/answer of RFC 3264, for audio only: reading an offer or an
answer, choosing a codec, and writing our own answer or offer. Anything malformed is an SdpError naming the line."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MAX_SDP_BYTES = 16 * 1024  # a softphone's offer is well under 2 KB; a bigger body is a mistake or an attack
SUPPORTED = ("PCMU", "PCMA")  # our preference order by default
DIRECTIONS = ("sendrecv", "sendonly", "recvonly", "inactive")
# RFC 3264 §6.1: the answer's direction is the offer's seen from the other end
MIRRORED = {"sendrecv": "sendrecv", "sendonly": "recvonly", "recvonly": "sendonly", "inactive": "inactive"}
AUDIO_PROTOS = ("RTP/AVP", "RTP/AVPF")  # plain RTP; SAVP would need SRTP keys we do not negotiate
TELEPHONE_EVENT = "telephone-event"  # RFC 4733 keypad digits
DTMF_PAYLOAD_TYPE = 101  # the dynamic payload type nearly every phone uses for telephone-event
DTMF_EVENTS = "0-16"  # the 16 keypad digits and flash

# RFC 3551 tables 4 and 5: payload types an m= line may use without an a=rtpmap (name, clock rate, channels)
STATIC_PAYLOAD_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("PCMU", 8000, 1), 3: ("GSM", 8000, 1), 4: ("G723", 8000, 1), 5: ("DVI4", 8000, 1),
    6: ("DVI4", 16000, 1), 7: ("LPC", 8000, 1), 8: ("PCMA", 8000, 1),
    9: ("G722", 8000, 1),  # G.722 samples at 16 kHz but its RTP clock is 8000 (RFC 3551 §4.5.2)
    10: ("L16", 44100, 2), 11: ("L16", 44100, 1), 12: ("QCELP", 8000, 1), 13: ("CN", 8000, 1),
    14: ("MPA", 90000, 1), 15: ("G728", 8000, 1), 16: ("DVI4", 11025, 1), 17: ("DVI4", 22050, 1),
    18: ("G729", 8000, 1), 25: ("CelB", 90000, 1), 26: ("JPEG", 90000, 1), 28: ("nv", 90000, 1),
    31: ("H261", 90000, 1), 32: ("MPV", 90000, 1), 33: ("MP2T", 90000, 1), 34: ("H263", 90000, 1),
}

_DIGITS = re.compile(r"[0-9]{1,30}")  # bounded: int() refuses over 4300 digits with a plain ValueError
_LINE_BREAK = re.compile(r"\r\n|\n|\r")


class SdpError(ValueError):
    """An SDP that cannot be read (-> SIP 400 or 488)."""


class NoCommonCodec(SdpError):
    """Nothing offered that we speak (-> 488 Not Acceptable Here)."""


@dataclass(frozen=True)
class Codec:
    """One RTP payload format of an m= line."""

    payload_type: int
    name: str  # as in rtpmap, upper-cased for audio codecs ("PCMU", "G722"); "telephone-event" kept lower
    clock_rate: int  # the RTP clock: 8000 for PCMU, PCMA and G722
    channels: int = 1
    fmtp: str | None = None


@dataclass(frozen=True)
class Media:
    """One m= line, with what its c= and a= lines (or the session's) say about it."""

    kind: str  # "audio", "video", ...
    port: int  # 0: a refused or disabled stream
    proto: str  # "RTP/AVP", "RTP/SAVP", ...
    codecs: tuple[Codec, ...]  # in the m= line's order; formats we cannot name (no rtpmap, not static) left out
    address: str  # c= at media level, else session level ("" only for a stream that has neither and is not audio)
    direction: str  # media level, else session level, else sendrecv
    ptime: int | None
    formats: tuple[str, ...] = ()  # the m= line's formats as written: what a refusal of a non-RTP stream echoes

    def summary(self) -> str:
        """The m= line in a few words, for error messages."""
        names = ", ".join(codec.name for codec in self.codecs) or " ".join(self.formats) or "nothing"
        return f"m={self.kind} {self.port} {self.proto} ({names})"


@dataclass(frozen=True)
class SessionDescription:
    """A whole SDP body: the origin (o=) and the media streams in order."""

    origin_user: str
    session_id: int
    session_version: int
    origin_address: str
    media: tuple[Media, ...]

    def audio(self) -> Media | None:
        """The first audio m= line that is in use (port != 0) over plain RTP."""
        return next((media for media in self.media if _usable_audio(media)), None)


@dataclass
class _Section:
    """The session part or one m= part while it is read (mutable: lines add to it one by one)."""

    line: int
    connection: str | None = None
    direction: str | None = None
    ptime: int | None = None
    rtpmap: dict[int, tuple[str, int, int]] = field(default_factory=dict)
    fmtp: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _MediaLine:
    """An m= line's fields."""

    kind: str
    port: int
    proto: str
    formats: tuple[str, ...]


def parse(text: str) -> SessionDescription:
    """Read an SDP body; SdpError for a missing or garbled v=, o=, c= or m= line, or one over 16 KiB."""
    if len(text) > MAX_SDP_BYTES or len(text.encode("utf-8", "replace")) > MAX_SDP_BYTES:
        raise SdpError(f"the SDP is over {MAX_SDP_BYTES} bytes")
    session = _Section(line=0)
    streams: list[tuple[_MediaLine, _Section]] = []
    origin: tuple[str, int, int, str] | None = None
    seen_version = False
    for number, raw in enumerate(_LINE_BREAK.split(text), 1):
        line = raw.strip()
        if not line:
            continue
        kind, value = _split_line(line, number)
        if not seen_version:
            _check_version(kind, value, number)
            seen_version = True
            continue
        current = streams[-1][1] if streams else session
        if kind == "o" and origin is None:
            origin = _origin(value)
        elif kind == "m":
            streams.append((_media_line(value, number), _Section(line=number)))
        elif kind == "c":
            current.connection = _connection(value, number)
        elif kind == "a":
            _attribute(current, value, number)
        # s=, t=, b=, i=, u=, e=, p=, z=, k=, r= and the rest say nothing about where or how audio flows
    if not seen_version:
        raise SdpError("no v= line: the body is empty, not an SDP")
    if origin is None:
        raise SdpError("no o= line")
    if not streams:
        raise SdpError("no m= line: the SDP offers no media")
    media = tuple(_media(line, section, session) for line, section in streams)
    return SessionDescription(*origin, media=media)


def _split_line(line: str, number: int) -> tuple[str, str]:
    if len(line) < 2 or line[1] != "=" or not ("a" <= line[0] <= "z"):
        raise SdpError(f"line {number} is not <type>=<value>: {line[:60]!r}")
    return line[0], line[2:].strip()


def _check_version(kind: str, value: str, number: int) -> None:
    if kind != "v":
        raise SdpError(f"line {number}: an SDP starts with v=0, not {kind}=")
    if value != "0":
        raise SdpError(f"v=: version {value!r}, not 0")


def _number(text: str, what: str, top: int | None = None) -> int:
    """A decimal field; int() alone would also take '+5', ' 5', '5_0' and non-ASCII digits."""
    if not _DIGITS.fullmatch(text) or (top is not None and int(text) > top):
        limit = f" 0-{top}" if top is not None else ""
        raise SdpError(f"{what}: {text!r} is not a number{limit}")
    return int(text)


def _origin(value: str) -> tuple[str, int, int, str]:
    fields = value.split()
    if len(fields) != 6:
        raise SdpError(f"o=: expected <username> <sess-id> <sess-version> IN <addrtype> <address>, got {value!r}")
    user, session_id, version, _nettype, _addrtype, address = fields
    return user, _number(session_id, "o= sess-id"), _number(version, "o= sess-version"), address


def _connection(value: str, number: int) -> str:
    fields = value.split()
    if len(fields) != 3 or fields[0] != "IN" or fields[1] not in ("IP4", "IP6"):
        raise SdpError(f"c= (line {number}): expected 'IN IP4 <address>' or 'IN IP6 <address>', got {value!r}")
    # a multicast address carries /ttl (IP4) or /count: the address is what comes before
    address = fields[2].split("/")[0]
    if not address:
        raise SdpError(f"c= (line {number}): no address in {value!r}")
    return address


def _media_line(value: str, number: int) -> _MediaLine:
    fields = value.split()
    if len(fields) < 4:
        raise SdpError(f"m= (line {number}): expected '<media> <port> <proto> <format> ...', got {value!r}")
    kind, port, proto, formats = fields[0].lower(), fields[1].split("/")[0], fields[2], tuple(fields[3:])
    if _is_rtp(proto):
        for payload_type in formats:
            _number(payload_type, f"m={kind} (line {number}) payload type", 127)
    return _MediaLine(kind, _number(port, f"m={kind} (line {number}) port", 65535), proto, formats)


def _attribute(section: _Section, value: str, number: int) -> None:
    name, _, rest = value.partition(":")
    name, rest = name.strip().lower(), rest.strip()
    if name in DIRECTIONS:
        section.direction = name
    elif name == "rtpmap":
        payload_type, mapping = _rtpmap(rest, number)
        section.rtpmap[payload_type] = mapping
    elif name == "fmtp":
        payload_type, _, parameters = rest.partition(" ")
        if _DIGITS.fullmatch(payload_type):  # fmtp of a non-RTP format says nothing about our codecs
            section.fmtp[int(payload_type)] = parameters.strip()
    elif name == "ptime" and _DIGITS.fullmatch(rest):
        # a garbled ptime is left out, not refused: it is a hint and 20 ms is what every phone does anyway
        section.ptime = int(rest)


def _rtpmap(rest: str, number: int) -> tuple[int, tuple[str, int, int]]:
    payload_type, _, encoding = rest.partition(" ")
    pieces = encoding.strip().split("/")
    if not _DIGITS.fullmatch(payload_type) or len(pieces) not in (2, 3) or not pieces[0]:
        raise SdpError(f"a=rtpmap (line {number}): {rest!r} is not '<payload type> <name>/<rate>[/<channels>]'")
    rate = _number(pieces[1], f"a=rtpmap:{payload_type} (line {number}) clock rate")
    channels = _number(pieces[2], f"a=rtpmap:{payload_type} (line {number}) channels") if len(pieces) == 3 else 1
    if pieces[0].upper() == "G722" and rate == 16000:
        rate = 8000  # some phones (baresip) write G.722's sample rate; its RTP clock is 8000 (RFC 3551 §4.5.2)
    return _number(payload_type, f"a=rtpmap (line {number}) payload type", 127), (pieces[0], rate, channels)


def _media(line: _MediaLine, section: _Section, session: _Section) -> Media:
    kind, port, proto, formats = line.kind, line.port, line.proto, line.formats
    address = section.connection or session.connection or ""
    if kind == "audio" and port != 0 and not address:
        raise SdpError(f"m=audio (line {section.line}): no c= line, neither for the stream nor for the session")
    codecs = _codecs(kind, formats, section) if _is_rtp(proto) else ()
    direction = section.direction or session.direction or "sendrecv"
    ptime = section.ptime if section.ptime is not None else session.ptime
    return Media(kind, port, proto, codecs, address, direction, ptime, formats)


def _codecs(kind: str, formats: tuple[str, ...], section: _Section) -> tuple[Codec, ...]:
    codecs = []
    for text in formats:
        payload_type = int(text)
        mapping = section.rtpmap.get(payload_type) or STATIC_PAYLOAD_TYPES.get(payload_type)
        if mapping is None:
            continue  # a dynamic payload type without rtpmap: nothing we could ever choose
        name, rate, channels = mapping
        codecs.append(Codec(payload_type, _codec_name(kind, name), rate, channels, section.fmtp.get(payload_type)))
    return tuple(codecs)


def _codec_name(kind: str, name: str) -> str:
    if name.lower() == TELEPHONE_EVENT:
        return TELEPHONE_EVENT
    return name.upper() if kind == "audio" else name


def _is_rtp(proto: str) -> bool:
    return "RTP/" in proto.upper()


def _is_dtmf(codec: Codec) -> bool:
    return codec.name.lower() == TELEPHONE_EVENT


def _usable_audio(media: Media) -> bool:
    return media.kind == "audio" and media.port != 0 and media.proto.upper() in AUDIO_PROTOS


def answer(offer: SessionDescription, *, address: str, port: int, session_id: int, session_version: int,
           supported: tuple[str, ...] = SUPPORTED, ptime: int = 20) -> tuple[str, Codec, Codec | None]:
    """Our answer to `offer` (RFC 3264 §6): the first usable audio stream that has a codec we speak, with the
    offerer's first such codec (its preference) and its telephone-event; every other stream refused with port 0.
    Returns the SDP text, the chosen codec and the telephone-event codec (or None)."""
    _check_port(port)
    index, codec = _choose(offer, tuple(name.upper() for name in supported))
    chosen = offer.media[index]
    dtmf = next((c for c in chosen.codecs if _is_dtmf(c) and c.clock_rate == codec.clock_rate), None)
    lines = _session_lines(address, session_id, session_version)
    for position, media in enumerate(offer.media):
        if position == index:
            formats = (codec,) if dtmf is None else (codec, dtmf)
            lines += _media_lines(media.kind, port, media.proto, formats, ptime, MIRRORED[media.direction])
        else:
            # RFC 3264 §6: a refused stream stays in its place, with port 0 and at least one of its formats
            lines.append(f"m={media.kind} 0 {media.proto} {_first_format(media)}")
    return _text(lines), codec, dtmf


def _choose(offer: SessionDescription, supported: tuple[str, ...]) -> tuple[int, Codec]:
    for index, media in enumerate(offer.media):
        if not _usable_audio(media):
            continue
        for codec in media.codecs:
            if codec.name.upper() in supported and not _is_dtmf(codec):
                return index, codec
    offered = "; ".join(media.summary() for media in offer.media)
    raise NoCommonCodec(f"no codec in common: the offer has {offered}; we speak {', '.join(supported)} over RTP/AVP")


def _first_format(media: Media) -> str:
    if media.formats:
        return media.formats[0]
    return str(media.codecs[0].payload_type) if media.codecs else "0"


def offer(*, address: str, port: int, session_id: int, session_version: int, codecs: tuple[Codec, ...],
          direction: str = "sendrecv", ptime: int = 20) -> str:
    """Our offer of one audio stream with `codecs` in our preference order (outbound calls, re-INVITEs)."""
    _check_port(port)
    if direction not in DIRECTIONS:
        raise ValueError(f"direction: {direction!r} is not one of {', '.join(DIRECTIONS)}")
    if not codecs:
        raise ValueError("codecs: an offer needs at least one codec")
    lines = _session_lines(address, session_id, session_version)
    lines += _media_lines("audio", port, "RTP/AVP", codecs, ptime, direction)
    return _text(lines)


def codecs_for(names: tuple[str, ...], dtmf: bool = True) -> tuple[Codec, ...]:
    """Codecs with static payload types for `names` (in that order), then telephone-event at 101 if `dtmf`."""
    by_name: dict[str, tuple[int, int, int]] = {}
    for payload_type, (name, rate, channels) in sorted(STATIC_PAYLOAD_TYPES.items()):
        by_name.setdefault(name.upper(), (payload_type, rate, channels))  # DVI4 and L16: the lowest type
    codecs = []
    for name in names:
        if name.upper() not in by_name:
            raise ValueError(f"codecs_for: {name!r} has no static RTP payload type (known: {', '.join(by_name)})")
        payload_type, rate, channels = by_name[name.upper()]
        codecs.append(Codec(payload_type, name.upper(), rate, channels))
    if dtmf:
        codecs.append(Codec(DTMF_PAYLOAD_TYPE, TELEPHONE_EVENT, 8000, fmtp=DTMF_EVENTS))
    return tuple(codecs)


def negotiated(answer: SessionDescription, offered: tuple[Codec, ...]) -> tuple[Codec, Codec | None]:
    """What the answer to our own offer chose: its first codec that we offered (same name and clock rate), with
    the answer's payload type, and telephone-event if both sides have it. NoCommonCodec otherwise."""
    media = answer.audio()
    if media is None:
        streams = "; ".join(m.summary() for m in answer.media)
        raise NoCommonCodec(f"the answer accepts no audio stream over RTP/AVP: {streams}")
    ours = {(codec.name.upper(), codec.clock_rate) for codec in offered if not _is_dtmf(codec)}
    codec = next((c for c in media.codecs if not _is_dtmf(c) and (c.name.upper(), c.clock_rate) in ours), None)
    if codec is None:
        names = ", ".join(c.name for c in offered)
        raise NoCommonCodec(f"the answer's {media.summary()} has none of the codecs we offered ({names})")
    dtmf_rates = {c.clock_rate for c in offered if _is_dtmf(c)}
    dtmf = next((c for c in media.codecs if _is_dtmf(c) and c.clock_rate in dtmf_rates), None)
    return codec, dtmf


def _check_port(port: int) -> None:
    if not 0 < port < 65536:
        raise ValueError(f"port: {port} is not a UDP port 1-65535")


def _session_lines(address: str, session_id: int, session_version: int) -> list[str]:
    if not address or any(c.isspace() for c in address):
        raise ValueError(f"address: {address!r} is not an address")
    if session_id < 0 or session_version < 0:
        raise ValueError(f"session_id, session_version: {session_id}, {session_version} must not be negative")
    family = "IP6" if ":" in address else "IP4"
    return ["v=0", f"o=kame {session_id} {session_version} IN {family} {address}", "s=kame",
            f"c=IN {family} {address}", "t=0 0"]


def _media_lines(kind: str, port: int, proto: str, codecs: tuple[Codec, ...], ptime: int, direction: str) -> list[str]:
    lines = [f"m={kind} {port} {proto} {' '.join(str(codec.payload_type) for codec in codecs)}"]
    for codec in codecs:
        channels = f"/{codec.channels}" if codec.channels != 1 else ""
        lines.append(f"a=rtpmap:{codec.payload_type} {codec.name}/{codec.clock_rate}{channels}")
        if codec.fmtp:
            lines.append(f"a=fmtp:{codec.payload_type} {codec.fmtp}")
    return [*lines, f"a=ptime:{ptime}", f"a={direction}"]


def _text(lines: list[str]) -> str:
    return "".join(f"{line}\r\n" for line in lines)
