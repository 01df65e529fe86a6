"""Vonage: the Voice API's WebSocket endpoint (`VonageStream`): 16-bit linear PCM as binary frames both ways,
JSON text frames for events and commands.

Facts relied on, from Vonage's "WebSockets" guide (Voice API) and the NCCO reference's `connect` action:
- The answer webhook's NCCO connects the call: {"action": "connect", "endpoint": [{"type": "websocket",
  "uri": "wss://...", "content-type": "audio/l16;rate=16000", "headers": {...}}]}; `headers` (512 bytes at
  most in the older guide) is the application's data for the socket.
- Vonage to us: first a text message, `websocket:connected` with the `content-type` and every header at its
  top level (the older Nexmo guide: the same object without `event`); then binary frames of 16-bit
  little-endian mono PCM, 20 ms each (640 bytes at 16 kHz, 320 at 8 kHz); `websocket:dtmf` {digit, duration};
  `websocket:notify` {payload} once the audio sent before our `notify` has played; `websocket:cleared` after
  a `clear`. The call's end closes the socket (there is no stop message).
- Us to Vonage: binary frames of 20 ms in the same format (Vonage buffers about 3072 of them, ~60 s);
  {"action": "notify", "payload": {...}} and {"action": "clear"}.
So Vonage has marks of its own: a `notify` whose payload names the mark; its `websocket:notify` says played.
The call id is the `uuid` header where the NCCO passed the call's uuid (the answer webhook has it); the call's
settings are the headers `instructions`, `llm`, `voice`, `keypad`. Pipecat's VonageFrameSerializer reads the
same events (read for behaviour only).
"""

from __future__ import annotations

import json
import re
import secrets

from server.phone.messages import digit, json_message, strings
from server.phone.streams import CallAudio, CallDigit, CallMarked, CallStarted, PhoneEvent, PhoneProtocolError

RATES = (8000, 16000)  # audio/l16;rate=...
CHUNK_S = 0.02  # Vonage's packets, both ways
MAX_AUDIO_BYTES = 32000  # of one binary frame: 1 s at 16 kHz (Vonage sends 20 ms)
CALL_ID_HEADERS = ("uuid", "call_uuid", "conversation_uuid")  # where an NCCO may pass the call's ids
_CONTENT_TYPE = re.compile(r"audio/l16;\s*rate=(\d+)", re.IGNORECASE)


class VonageStream:
    """One call's WebSocket: Vonage's messages in, ours out."""

    name = "vonage"
    marks = True  # notify / websocket:notify

    def __init__(self) -> None:
        self.rate: int | None = None

    def read(self, message: str | bytes) -> list[PhoneEvent]:
        if isinstance(message, bytes):
            return [self._audio(message)]
        event, data = json_message(message, "Vonage")
        if self.rate is None:
            if event in ("websocket:connected", None) and "content-type" in data:
                return [self._connected(data)]
            raise PhoneProtocolError(f"the first message is websocket:connected with its content-type (got {event!r})")
        match event:
            case "websocket:dtmf":
                return [CallDigit(digit(data.get("digit"), "websocket:dtmf.digit"))]
            case "websocket:notify":
                mark = data.get("payload")
                name = mark.get("name") if isinstance(mark, dict) else None
                return [CallMarked(name)] if isinstance(name, str) else []  # not one of ours
            case "websocket:cleared":
                return []
            case "websocket:connected":
                raise PhoneProtocolError("a second websocket:connected")
        raise PhoneProtocolError(f"unknown event {event!r}")

    def _connected(self, data: dict) -> CallStarted:
        content = data.get("content-type")
        found = _CONTENT_TYPE.fullmatch(content.strip()) if isinstance(content, str) else None
        if found is None or int(found.group(1)) not in RATES:
            raise PhoneProtocolError(f"content-type is audio/l16;rate=8000 or 16000 (got {content!r})")
        params = strings({k: v for k, v in data.items() if k not in ("event", "content-type")}, "the headers")
        call_id = next((params[k] for k in CALL_ID_HEADERS if params.get(k)), None) or f"vonage-{secrets.token_hex(6)}"
        self.rate = int(found.group(1))
        return CallStarted(call_id, call_id, "audio/pcm", self.rate, params)

    def _audio(self, data: bytes) -> CallAudio:
        if self.rate is None:
            raise PhoneProtocolError("audio before websocket:connected")
        if len(data) % 2 or len(data) > MAX_AUDIO_BYTES:
            raise PhoneProtocolError(f"an audio frame is 16-bit PCM of at most {MAX_AUDIO_BYTES} bytes "
                                     f"(got {len(data)})")
        return CallAudio(data)

    def audio(self, data: bytes) -> list[bytes]:
        """In Vonage's 20 ms packets (the last one shorter where `data` is not whole packets)."""
        size = round((self.rate or RATES[-1]) * CHUNK_S) * 2
        return [data[i:i + size] for i in range(0, len(data), size)]

    def mark(self, name: str) -> list[str]:
        return [json.dumps({"action": "notify", "payload": {"name": name}})]

    def clear(self) -> list[str]:
        return [json.dumps({"action": "clear"})]
