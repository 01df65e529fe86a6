"""Plivo: its Audio Stream over WebSocket (`PlivoStream`), JSON text frames both ways, mu-law at 8 kHz.

Facts relied on, from Plivo's "Stream Event Protocol" / "Audio Streaming Protocol Reference" and the XML
`<Stream>` element's reference:
- The answer XML opens it: `<Stream bidirectional="true" keepCallAlive="true"
  contentType="audio/x-mulaw;rate=8000" extraHeaders="llm=fast,voice=alloy">wss://...</Stream>`. The
  default contentType is audio/x-l16;rate=8000, whose byte order the reference does not state: KAME takes
  mu-law. extraHeaders holds key=value pairs of letters and digits only (512 bytes), so a call's
  `instructions` cannot travel there; `llm`, `voice` and `keypad` can.
- Plivo to us: `start` {sequenceNumber, start: {callId, streamId, accountId, tracks, mediaFormat {encoding,
  sampleRate}}, extra_headers "k=v;k=v"}; `media` {streamId, media: {track, timestamp, chunk, payload}}
  (~20 ms of base64 audio); `dtmf` {streamId, dtmf: {track, digit, timestamp}}; `playedStream` {streamId,
  name} once the audio before our checkpoint has played; `clearedAudio` {streamId}. No stop message: the
  stream's end closes the socket (the status callback says why).
- Us to Plivo: `playAudio` {media: {contentType, sampleRate, payload}}, `checkpoint` {streamId, name},
  `clearAudio` {streamId}.
Pipecat's PlivoFrameSerializer sends the same playAudio and clearAudio (read for behaviour only).
"""

from __future__ import annotations

import base64
import json
import re

from server.phone.messages import caller_audio, json_message, json_object, keypad, text
from server.phone.streams import CallMarked, CallStarted, PhoneEvent, PhoneProtocolError

MULAW_8K = ("audio/x-mulaw", "8000")  # mediaFormat's encoding and sampleRate
_PAIR = re.compile(r"\s*([^=;,\s]+)\s*=\s*([^;,]*?)\s*(?:[;,]|$)")


class PlivoStream:
    """One call's Audio Stream: Plivo's messages in, ours out."""

    name = "plivo"
    marks = True  # checkpoint / playedStream

    def __init__(self) -> None:
        self.stream_id: str | None = None

    def read(self, message: str | bytes) -> list[PhoneEvent]:
        event, data = json_message(message, "Plivo")
        match event:
            case "start":
                return [self._start(data)]
            case "media" | "dtmf" | "playedStream" | "clearedAudio" if self.stream_id is None:
                raise PhoneProtocolError(f"a {event} message before the stream's start")
            case "media":
                return caller_audio(data)
            case "dtmf":
                return keypad(data)
            case "playedStream":
                return [CallMarked(text(data, "name", "playedStream"))]
            case "clearedAudio":
                return []
        raise PhoneProtocolError(f"unknown event {event!r}")

    def _start(self, data: dict) -> CallStarted:
        if self.stream_id is not None:
            raise PhoneProtocolError("a second start message")
        start = json_object(data, "start")
        call_id, stream_id = text(start, "callId", "start"), text(start, "streamId", "start")
        media = start.get("mediaFormat")
        if not isinstance(media, dict) or (media.get("encoding"), str(media.get("sampleRate"))) != MULAW_8K:
            raise PhoneProtocolError(f'KAME takes <Stream contentType="audio/x-mulaw;rate=8000"> (got {media})')
        headers = data.get("extra_headers") or ""
        if not isinstance(headers, str):
            raise PhoneProtocolError("extra_headers is text (key=value pairs)")
        self.stream_id = stream_id
        return CallStarted(call_id, stream_id, "audio/pcmu", 8000, dict(_PAIR.findall(headers)))

    def audio(self, data: bytes) -> list[str]:
        media = {"contentType": "audio/x-mulaw", "sampleRate": 8000, "payload": base64.b64encode(data).decode()}
        return [json.dumps({"event": "playAudio", "streamId": self.stream_id, "media": media})]

    def mark(self, name: str) -> list[str]:
        return [json.dumps({"event": "checkpoint", "streamId": self.stream_id, "name": name})]

    def clear(self) -> list[str]:
        return [json.dumps({"event": "clearAudio", "streamId": self.stream_id})]
