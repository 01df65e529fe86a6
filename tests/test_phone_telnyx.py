"""Telnyx's side of a phone call, without a server: the media streaming messages read as Telnyx's reference
("Stream call media over WebSocket") writes them, what goes back, and garbage refused by name."""

from __future__ import annotations

import base64
import json

import pytest

from server.phone.streams import CallAudio, CallDigit, CallMarked, CallStarted, CallStopped, PhoneProtocolError
from server.phone.telnyx import TelnyxStream

# connected and start as Telnyx's reference shows them; the others with the fields its message list names
CONNECTED = {"event": "connected", "version": "1.0.0"}
STREAM = "32DE0DEA-53CB-4B21-89A4-9E1819C043BC"
CALL = "v2:T02llQxIyaRkhfRKxgAP8nY511EhFLizdvdUKJiSw8d6A9BborherQ"
START = {"event": "start", "sequence_number": "1", "stream_id": STREAM, "start": {
    "user_id": "3E6F995F-85F7-4705-9741-53B116D28237", "call_control_id": CALL,
    "call_session_id": "ff55a038-6f5d-11ef-9692-02420aeffb1f", "from": "+13122010094", "to": "+13122123456",
    "tags": ["TAG1", "TAG2"], "client_state": "aGF2ZSBhIG5pY2UgZGF5ID1d",
    "custom_parameters": {"customer_id": "customer_123", "instructions": "Be brief."},
    "media_format": {"encoding": "PCMU", "sample_rate": 8000, "channels": 1}}}
MEDIA = {"event": "media", "sequence_number": "4", "media": {
    "track": "inbound", "chunk": "2", "timestamp": "5", "payload": base64.b64encode(bytes(range(160))).decode()},
    "stream_id": STREAM}
DTMF = {"event": "dtmf", "stream_id": STREAM, "occurred_at": "2024-09-11T15:13:09.390443Z", "sequence_number": "5",
        "dtmf": {"digit": "1"}}
MARK = {"event": "mark", "sequence_number": "6", "stream_id": STREAM, "mark": {"name": "7"}}
STOP = {"event": "stop", "sequence_number": "7", "stream_id": STREAM,
        "stop": {"user_id": START["start"]["user_id"], "call_control_id": CALL}}
ERROR = {"event": "error", "sequence_number": "8", "stream_id": STREAM,
         "payload": {"code": 100002, "title": "unknown_error", "detail": "An unknown error occurred"}}


def read(stream: TelnyxStream, message: dict) -> list:
    return stream.read(json.dumps(message))


def started() -> TelnyxStream:
    stream = TelnyxStream()
    read(stream, START)
    return stream


def test_a_call_reads_as_telnyx_sends_it():
    stream = TelnyxStream()
    assert read(stream, CONNECTED) == []
    assert read(stream, START) == [CallStarted(CALL, STREAM, "audio/pcmu", 8000, {
        "From": "+13122010094", "To": "+13122123456", "customer_id": "customer_123", "instructions": "Be brief."})]
    assert read(stream, MEDIA) == [CallAudio(bytes(range(160)))]
    assert read(stream, DTMF) == [CallDigit("1")]
    assert read(stream, MARK) == [CallMarked("7")]
    assert [type(e) for e in read(stream, STOP)] == [CallStopped]


def test_an_a_law_stream_is_a_law_and_the_outbound_track_is_not_the_caller():
    pcma = json.loads(json.dumps(START))
    pcma["start"]["media_format"]["encoding"] = "PCMA"
    stream = TelnyxStream()
    assert read(stream, pcma)[0].encoding == "audio/pcma"
    assert read(stream, MEDIA | {"media": MEDIA["media"] | {"track": "outbound"}}) == []


def test_what_goes_back_is_media_mark_and_clear():
    stream = started()
    media, = stream.audio(b"\xff" * 640)
    assert json.loads(media) == {"event": "media", "media": {"payload": base64.b64encode(b"\xff" * 640).decode()}}
    assert [json.loads(m) for m in stream.mark("7")] == [{"event": "mark", "mark": {"name": "7"}}]
    assert [json.loads(m) for m in stream.clear()] == [{"event": "clear"}]


@pytest.mark.parametrize(("message", "complaint"), [
    (b"\x00\x01", "text frames"),
    ("{not json", "not JSON"),
    ("[" * 50_000, "not JSON"),  # deeper than json's recursion limit
    ("x" * 100_000, "over 65536 characters"),
    ('"a string"', "JSON object"),
    (json.dumps({"event": "hangup"}), "unknown event"),
    (json.dumps(MEDIA), "before the stream's start"),
    (json.dumps(STOP), "before the stream's start"),
    (json.dumps(START | {"stream_id": None}), "start.stream_id"),
    (json.dumps(START | {"start": START["start"] | {"call_control_id": 7}}), "start.call_control_id"),
    (json.dumps(START | {"start": START["start"] | {"custom_parameters": ["a"]}}), "custom_parameters is an object"),
])
def test_garbage_before_the_start_is_refused_by_name(message, complaint):
    with pytest.raises(PhoneProtocolError, match=complaint):
        TelnyxStream().read(message)


@pytest.mark.parametrize("media_format", [
    {"encoding": "L16", "sample_rate": 16000, "channels": 1},
    {"encoding": "OPUS", "sample_rate": 8000, "channels": 1},
    {"encoding": "PCMU", "sample_rate": 16000, "channels": 1},
    "PCMU",
])
def test_a_stream_in_another_format_is_refused(media_format):
    with pytest.raises(PhoneProtocolError, match="PCMU or PCMA at 8000 Hz"):
        read(TelnyxStream(), START | {"start": START["start"] | {"media_format": media_format}})


@pytest.mark.parametrize(("change", "complaint"), [
    ({"media": {"payload": "not base64!"}}, "not valid base64"),
    ({"media": {"payload": 42}}, "base64 text"),
    ({"media": {"payload": base64.b64encode(b"\x00" * 9000).decode()}}, "over 8000 bytes"),
    ({"media": None}, "'media' object"),
    ({"event": "dtmf", "dtmf": {"digit": "12"}}, "dtmf.digit"),
    ({"event": "mark", "mark": {"name": 3}}, "mark.name"),
    ({"event": "start", "start": START["start"]}, "a second start"),
    (ERROR, "Telnyx reports an error: .*unknown_error"),
])
def test_bad_messages_during_the_call_are_refused_by_name(change, complaint):
    with pytest.raises(PhoneProtocolError, match=complaint):
        read(started(), MEDIA | change)
