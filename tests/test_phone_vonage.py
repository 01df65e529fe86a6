"""Vonage's side of a phone call, without a server: the Voice API WebSocket's messages read as Vonage's
"WebSockets" guide writes them (a JSON websocket:connected with the NCCO's headers, then binary 16-bit PCM),
what goes back (20 ms binary packets, notify, clear), and garbage refused by name."""

from __future__ import annotations

import json

import pytest

from server.phone.streams import CallAudio, CallDigit, CallMarked, CallStarted, PhoneProtocolError
from server.phone.vonage import VonageStream

# as the guide shows them: the connect action's headers come back at the top level of websocket:connected
CONNECTED = {"event": "websocket:connected", "content-type": "audio/l16;rate=16000",
             "uuid": "63f61863-4a51-4f6b-86e1-46edebcf9356", "instructions": "Be brief.", "keypad": "off"}
LEGACY_CONNECTED = {"app": "demo", "content-type": "audio/l16;rate=16000"}  # the older Nexmo guide: no event
DTMF = {"event": "websocket:dtmf", "digit": "5", "duration": 260}
NOTIFY = {"event": "websocket:notify", "payload": {"name": "7"}}
CLEARED = {"event": "websocket:cleared"}
FRAME = bytes(range(256)) * 2 + bytes(128)  # 640 bytes: 20 ms at 16 kHz


def read(stream: VonageStream, message: dict | bytes) -> list:
    return stream.read(message if isinstance(message, bytes) else json.dumps(message))


def connected(rate: int = 16000) -> VonageStream:
    stream = VonageStream()
    read(stream, CONNECTED | {"content-type": f"audio/l16;rate={rate}"})
    return stream


def test_a_call_reads_as_vonage_sends_it():
    stream = VonageStream()
    call_id = CONNECTED["uuid"]
    assert read(stream, CONNECTED) == [CallStarted(call_id, call_id, "audio/pcm", 16000, {
        "uuid": call_id, "instructions": "Be brief.", "keypad": "off"})]
    assert read(stream, FRAME) == [CallAudio(FRAME)]
    assert read(stream, DTMF) == [CallDigit("5")]
    assert read(stream, NOTIFY) == [CallMarked("7")]
    assert read(stream, CLEARED) == []
    assert read(stream, {"event": "websocket:notify", "payload": {"someone": "else's"}}) == []


def test_the_older_first_message_and_8_khz_are_read_and_a_call_without_uuid_gets_an_id():
    stream = VonageStream()
    call, = read(stream, LEGACY_CONNECTED | {"content-type": "audio/l16;rate=8000"})
    assert (call.encoding, call.rate, call.params) == ("audio/pcm", 8000, {"app": "demo"})
    assert call.call_id.startswith("vonage-") and call.stream_id == call.call_id
    assert read(stream, FRAME[:320]) == [CallAudio(FRAME[:320])]


@pytest.mark.parametrize(("rate", "packet"), [(16000, 640), (8000, 320)])
def test_audio_goes_back_in_20_ms_binary_packets_and_marks_as_notify(rate, packet):
    stream = connected(rate)
    frame = bytes(i % 251 for i in range(rate * 2 * 80 // 1000))  # one 80 ms frame
    packets = stream.audio(frame)
    assert all(isinstance(p, bytes) for p in packets) and b"".join(packets) == frame
    assert [len(p) for p in packets] == [packet] * 4
    assert [json.loads(m) for m in stream.mark("7")] == [{"action": "notify", "payload": {"name": "7"}}]
    assert [json.loads(m) for m in stream.clear()] == [{"action": "clear"}]


@pytest.mark.parametrize(("message", "complaint"), [
    (FRAME, "audio before websocket:connected"),
    ("{not json", "not JSON"),
    ("[" * 50_000, "not JSON"),  # deeper than json's recursion limit
    ("x" * 100_000, "over 65536 characters"),
    ("[1, 2]", "JSON object"),
    (json.dumps(DTMF), "first message is websocket:connected"),
    (json.dumps({"app": "demo"}), "first message is websocket:connected"),
    (json.dumps(CONNECTED | {"content-type": "audio/l16;rate=24000"}), "rate=8000 or 16000"),
    (json.dumps(CONNECTED | {"content-type": "audio/pcmu"}), "content-type is audio/l16"),
    (json.dumps(CONNECTED | {"content-type": 16000}), "content-type is audio/l16"),
])
def test_garbage_before_the_call_is_connected_is_refused_by_name(message, complaint):
    with pytest.raises(PhoneProtocolError, match=complaint):
        VonageStream().read(message)


@pytest.mark.parametrize(("message", "complaint"), [
    (FRAME[:-1], "16-bit PCM"),
    (bytes(40000), "at most 32000 bytes"),
    (json.dumps(DTMF | {"digit": "55"}), "websocket:dtmf.digit"),
    (json.dumps(DTMF | {"digit": 5}), "websocket:dtmf.digit"),
    (json.dumps(CONNECTED), "a second websocket:connected"),
    (json.dumps({"event": "websocket:hangup"}), "unknown event"),
])
def test_bad_messages_during_the_call_are_refused_by_name(message, complaint):
    with pytest.raises(PhoneProtocolError, match=complaint):
        connected().read(message)
