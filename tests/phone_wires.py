"""Telnyx's, Vonage's and Plivo's messages for the test caller (tests/phone_caller.py's `Wire`), written from
each carrier's own reference (Telnyx's "Stream call media over WebSocket", Vonage's "WebSockets" guide,
Plivo's "Stream Event Protocol"), not from the server's code. A `read` raises AssertionError for what the
carrier would not take."""

from __future__ import annotations

import base64
import binascii
import json
import time
import uuid

from tests.phone_caller import FRAME_S, Audio, Cleared, LineFormat, MarkAsked, Message, ServerSaid


def _media_payload(data: dict, message: str) -> bytes:
    try:
        return base64.b64decode(data["media"]["payload"], validate=True)
    except (binascii.Error, KeyError, TypeError) as exc:
        raise AssertionError(f"a media message without base64 media.payload: {message[:120]}") from exc


class TelnyxWire:
    """Telnyx media streaming, bidirectional (`stream_bidirectional_mode: rtp`): JSON text frames, G.711 at
    8 kHz; every message from Telnyx but `connected` carries a `sequence_number` and the `stream_id`."""

    name = "telnyx"

    def __init__(self, encoding: str = "PCMU") -> None:
        self.encoding = encoding
        self.format = LineFormat("pcmu" if encoding == "PCMU" else "pcma", 8000)
        self.stream_id = str(uuid.uuid4()).upper()
        self.call_control_id = "v3:" + uuid.uuid4().hex
        self._sequence = self._chunk = 0

    def _say(self, event: str, **body) -> str:
        self._sequence += 1
        return json.dumps({"event": event, "sequence_number": str(self._sequence), **body, "stream_id": self.stream_id})

    def opening(self, parameters: dict[str, str]) -> list[Message]:
        return [json.dumps({"event": "connected", "version": "1.0.0"}), self._say("start", start={
            "user_id": str(uuid.uuid4()), "call_control_id": self.call_control_id,
            "call_session_id": str(uuid.uuid4()), "from": "+13122010094", "to": "+13122123456",
            "client_state": base64.b64encode(b"kame-test").decode(), "custom_parameters": parameters,
            "media_format": {"encoding": self.encoding, "sample_rate": 8000, "channels": 1}})]

    def media(self, data: bytes) -> list[Message]:
        self._chunk += 1
        return [self._say("media", media={"track": "inbound", "chunk": str(self._chunk),
                                          "timestamp": str(round((self._chunk - 1) * FRAME_S * 1000)),
                                          "payload": base64.b64encode(data).decode()})]

    def dtmf(self, digit: str) -> list[Message]:
        return [self._say("dtmf", occurred_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          dtmf={"digit": digit})]

    def marked(self, name: str) -> list[Message]:
        return [self._say("mark", mark={"name": name})]

    def stop(self) -> list[Message]:
        return [self._say("stop", stop={"call_control_id": self.call_control_id})]

    def read(self, message: Message) -> list[ServerSaid]:
        assert isinstance(message, str), "Telnyx's media stream takes JSON text frames"
        data = json.loads(message)
        match data.get("event"):
            case "media":
                return [Audio(_media_payload(data, message))]
            case "mark":
                name = data.get("mark", {}).get("name")
                assert isinstance(name, str), f"a mark without mark.name: {message[:120]}"
                return [MarkAsked(name)]
            case "clear":
                return [Cleared()]
        raise AssertionError(f"Telnyx takes media, mark and clear; the server sent {message[:120]}")


class VonageWire:
    """The Vonage Voice API's WebSocket: a JSON websocket:connected with the NCCO's headers, then binary
    16-bit PCM in 20 ms packets both ways; `notify` comes back as websocket:notify once its audio has played.
    There is no stop message: a hang-up closes the socket (the test closes it)."""

    name = "vonage"

    def __init__(self, rate: int = 16000) -> None:
        self.format = LineFormat("pcm16", rate)
        self.uuid = str(uuid.uuid4())

    def opening(self, parameters: dict[str, str]) -> list[Message]:
        return [json.dumps({"event": "websocket:connected", "content-type": f"audio/l16;rate={self.format.rate}",
                            "uuid": self.uuid, **parameters})]

    def media(self, data: bytes) -> list[Message]:
        return [data]

    def dtmf(self, digit: str) -> list[Message]:
        return [json.dumps({"event": "websocket:dtmf", "digit": digit, "duration": 260})]

    def marked(self, name: str) -> list[Message]:
        return [json.dumps({"event": "websocket:notify", "payload": json.loads(name)})]

    def stop(self) -> list[Message]:
        return []

    def read(self, message: Message) -> list[ServerSaid]:
        if isinstance(message, bytes):
            assert len(message) == self.format.frame_bytes, \
                f"Vonage takes 20 ms packets ({self.format.frame_bytes} bytes), got {len(message)}"
            return [Audio(message)]
        data = json.loads(message)
        match data.get("action"):
            case "notify":
                assert isinstance(data.get("payload"), dict), f"notify without its payload object: {message[:120]}"
                return [MarkAsked(json.dumps(data["payload"]))]
            case "clear":
                return [Cleared()]
        raise AssertionError(f"Vonage takes binary audio, notify and clear; the server sent {message[:120]}")


class PlivoWire:
    """Plivo's bidirectional audio stream with contentType audio/x-mulaw;rate=8000: JSON text frames; marks
    are checkpoints, played back as playedStream. No stop message: the stream's end closes the socket."""

    name = "plivo"
    format = LineFormat("pcmu", 8000)

    def __init__(self) -> None:
        self.call_id, self.stream_id = str(uuid.uuid4()), str(uuid.uuid4())
        self._sequence = self._chunk = 0

    def _say(self, event: str, **body) -> str:
        self._sequence += 1
        return json.dumps({"event": event, "sequenceNumber": self._sequence, "streamId": self.stream_id, **body})

    def opening(self, parameters: dict[str, str]) -> list[Message]:
        self._sequence += 1
        return [json.dumps({"event": "start", "sequenceNumber": self._sequence, "start": {
            "callId": self.call_id, "streamId": self.stream_id, "accountId": "MA" + "X" * 18, "tracks": ["inbound"],
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000}},
            "extra_headers": ";".join(f"{k}={v}" for k, v in parameters.items())})]

    def media(self, data: bytes) -> list[Message]:
        self._chunk += 1
        return [self._say("media", media={"track": "inbound", "timestamp": str(int(time.time() * 1000)),
                                          "chunk": self._chunk, "payload": base64.b64encode(data).decode()})]

    def dtmf(self, digit: str) -> list[Message]:
        return [self._say("dtmf", dtmf={"track": "inbound", "digit": digit, "timestamp": str(int(time.time() * 1000))})]

    def marked(self, name: str) -> list[Message]:
        return [self._say("playedStream", name=name)]

    def stop(self) -> list[Message]:
        return []

    def read(self, message: Message) -> list[ServerSaid]:
        assert isinstance(message, str), "Plivo's audio stream takes JSON text frames"
        data = json.loads(message)
        event = data.get("event")
        assert event not in ("checkpoint", "clearAudio") or data.get("streamId") == self.stream_id, \
            f"a {event} for another stream: {message[:120]}"
        match event:
            case "playAudio":
                media = data.get("media", {})
                assert (media.get("contentType"), media.get("sampleRate")) == ("audio/x-mulaw", 8000), \
                    f"playAudio in another format than the stream's: {message[:120]}"
                return [Audio(_media_payload(data, message))]
            case "checkpoint":
                assert isinstance(data.get("name"), str), f"a checkpoint without its name: {message[:120]}"
                return [MarkAsked(data["name"])]
            case "clearAudio":
                return [Cleared()]
        raise AssertionError(f"Plivo takes playAudio, checkpoint and clearAudio; the server sent {message[:120]}")
