"""Telnyx: its Media Streaming WebSocket (`TelnyxStream`), JSON text frames both ways, G.711 at 8 kHz.

Facts relied on, from Telnyx's "Stream call media over WebSocket" reference (its AsyncAPI) and "Streaming
start" (Call Control):
- A Call Control command (`answer`, `dial`, `streaming_start`) or TeXML `<Stream>` names `stream_url`; audio
  goes back to the caller only with `stream_bidirectional_mode: "rtp"`, in `stream_bidirectional_codec`
  (PCMU by default): set it to the stream's own codec (`stream_codec`), as one encoding serves both ways here.
- Telnyx to us: `connected` {version}; `start` {stream_id, start: {call_control_id, call_session_id, from, to,
  client_state, custom_parameters {...}, media_format {encoding "PCMU"|"PCMA"|..., sample_rate, channels}}};
  `media` {media: {track, chunk, timestamp, payload}}: base64 RTP payload, no header; `dtmf` {dtmf: {digit}};
  `mark` {mark: {name}} once the audio before our mark has played (at once if none is queued; a `clear`
  returns the queued ones); `error` {payload}; `stop`. Each carries `stream_id` and a `sequence_number`.
- Us to Telnyx: `media` {media: {payload}} (20 ms to 30 s of RTP payload), `mark` {mark: {name}}, `clear`.
- Media frames may come out of order (Telnyx: "use chunk, timestamp and sequence_number"); over one socket
  they come in order in practice, and KAME plays them as they come.
The call's settings are its `custom_parameters` (Call Control `custom_parameters`, TeXML `<Parameter>`s):
`instructions`, `llm`, `voice`, `keypad`; `client_state` is the application's own and is not read.
Pipecat's TelnyxFrameSerializer behaves the same way (read for behaviour only).
"""

from __future__ import annotations

import base64
import json

from server.phone.messages import json_message, json_object, media_dtmf_mark, strings, text
from server.phone.streams import (
    CallStarted,
    CallStopped,
    Encoding,
    PhoneEvent,
    PhoneProtocolError,
)

ENCODINGS: dict[object, Encoding] = {"PCMU": "audio/pcmu", "PCMA": "audio/pcma"}
AUTH_HEADER = "x-telnyx-streaming-auth-token"  # Telnyx sends the command's `stream_auth_token` in it


class TelnyxStream:
    """One call's media stream: Telnyx's messages in, ours out."""

    name = "telnyx"
    marks = True

    def __init__(self) -> None:
        self.stream_id: str | None = None

    def read(self, message: str | bytes) -> list[PhoneEvent]:
        event, data = json_message(message, "Telnyx")
        match event:
            case "connected":
                return []
            case "start":
                return [self._start(data)]
            case "media" | "dtmf" | "mark" | "stop" if self.stream_id is None:
                raise PhoneProtocolError(f"a {event} message before the stream's start")
            case "media" | "dtmf" | "mark":
                return media_dtmf_mark(event, data)
            case "stop":
                return [CallStopped("the call ended (stop)")]
            case "error":
                raise PhoneProtocolError(f"Telnyx reports an error: {json.dumps(data.get('payload'))[:300]}")
        raise PhoneProtocolError(f"unknown event {event!r}")

    def _start(self, data: dict) -> CallStarted:
        if self.stream_id is not None:
            raise PhoneProtocolError("a second start message")
        start = json_object(data, "start")
        stream_id = text(data, "stream_id", "start")
        call_id = text(start, "call_control_id", "start")
        media = start.get("media_format") or {}
        encoding = ENCODINGS.get(media.get("encoding", "PCMU")) if isinstance(media, dict) else None
        if encoding is None or media.get("sample_rate", 8000) not in (8000, "8000"):
            raise PhoneProtocolError(f"KAME takes PCMU or PCMA at 8000 Hz (stream_codec; got {media})")
        params = {key.title(): start[key] for key in ("from", "to") if isinstance(start.get(key), str)}
        params |= strings(start.get("custom_parameters"), "start.custom_parameters")
        self.stream_id = stream_id
        return CallStarted(call_id, stream_id, encoding, 8000, params)

    def audio(self, data: bytes) -> list[str]:
        return [json.dumps({"event": "media", "media": {"payload": base64.b64encode(data).decode()}})]

    def mark(self, name: str) -> list[str]:
        return [json.dumps({"event": "mark", "mark": {"name": name}})]

    def clear(self) -> list[str]:
        return [json.dumps({"event": "clear"})]
