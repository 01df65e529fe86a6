"""Reading a carrier's JSON messages: the checks every JSON media stream (Telnyx, Plivo, ...) makes, each
complaint a PhoneProtocolError that names the field at fault."""

from __future__ import annotations

import base64
import binascii
import json

from server.phone.streams import CallAudio, CallDigit, CallMarked, PhoneEvent, PhoneProtocolError

MAX_PAYLOAD_BYTES = 8000  # of one media message's audio: 1 s of G.711 (carriers send 20 ms, 160 bytes)
MAX_MESSAGE_CHARS = 64 * 1024  # of any message: a start with long parameters is a few kB; more is not read
DIGITS = frozenset("0123456789*#ABCD")


def json_message(message: str | bytes, carrier: str) -> tuple[object, dict]:
    """(its `event`, the message) of a text frame holding a JSON object."""
    if not isinstance(message, str):
        raise PhoneProtocolError(f"{carrier}'s stream messages are text frames (a binary frame came)")
    if len(message) > MAX_MESSAGE_CHARS:  # refused before the parser spends time on it
        raise PhoneProtocolError(f"a message over {MAX_MESSAGE_CHARS} characters")
    try:
        data = json.loads(message)
    except (ValueError, RecursionError) as exc:  # (nested deeper than the parser goes: RecursionError)
        raise PhoneProtocolError(f"not JSON: {type(exc).__name__}") from None
    if not isinstance(data, dict):
        raise PhoneProtocolError(f"a message is a JSON object (got {type(data).__name__})")
    return data.get("event"), data


def json_object(data: dict, key: str) -> dict:
    value = data.get(key)
    if not isinstance(value, dict):
        raise PhoneProtocolError(f"a {data.get('event')} message has its {key!r} object")
    return value


def text(data: dict, key: str, where: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise PhoneProtocolError(f"{where}.{key} is a string")
    return value


def shown(value: object) -> str:
    """A value the carrier sent, short enough for the log."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def digit(value: object, where: str) -> str:
    if not isinstance(value, str) or value not in DIGITS:
        raise PhoneProtocolError(f"{where} is one of 0-9, *, #, A-D (got {shown(value)})")
    return value


def payload(media: dict, limit: int = MAX_PAYLOAD_BYTES) -> bytes:
    """media.payload: base64 audio of at most `limit` bytes."""
    value = media.get("payload")
    if not isinstance(value, str):
        raise PhoneProtocolError("media.payload is base64 text")
    if len(value) > limit * 4 // 3 + 4:
        raise PhoneProtocolError(f"media.payload over {limit} bytes of audio")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise PhoneProtocolError("media.payload is not valid base64") from None


def caller_audio(data: dict) -> list[CallAudio]:
    """A `media` message's audio, where it is the caller's: a stream of both tracks also carries the
    `outbound` one, what the caller hears."""
    media = json_object(data, "media")
    return [] if media.get("track") == "outbound" else [CallAudio(payload(media))]


def keypad(data: dict) -> list[CallDigit]:
    """A `dtmf` message's {dtmf: {digit}}."""
    return [CallDigit(digit(json_object(data, "dtmf").get("digit"), "dtmf.digit"))]


def strings(values: object, where: str) -> dict[str, str]:
    """An object of the application's parameters, each value as text."""
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise PhoneProtocolError(f"{where} is an object")
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in values.items()}


def media_dtmf_mark(event: object, data: dict) -> list[PhoneEvent]:
    """`media`, `dtmf` and `mark` after the start, which Twilio's and Telnyx's streams write alike."""
    match event:
        case "media":
            return caller_audio(data)
        case "dtmf":
            return keypad(data)
        case "mark":
            return [CallMarked(text(json_object(data, "mark"), "name", "mark"))]
    raise PhoneProtocolError(f"unknown event {shown(event)}")
