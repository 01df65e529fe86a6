"""Plivo's side of a phone call, without a server: the Audio Stream's messages read as Plivo's "Stream Event
Protocol" reference writes them, what goes back (playAudio, checkpoint, clearAudio), and garbage refused by
name."""

from __future__ import annotations

import base64
import json

import pytest

from server.phone.plivo import PlivoStream
from server.phone.streams import CallAudio, CallDigit, CallMarked, CallStarted, PhoneProtocolError

# as the reference shows them
STREAM, CALL = "87654321-4321-4321-4321-cba987654321", "12345678-1234-1234-1234-123456789abc"
START = {"event": "start", "sequenceNumber": 1, "start": {
    "callId": CALL, "streamId": STREAM, "accountId": "MAXXXXXXXXXXXXXXXXXX", "tracks": ["inbound"],
    "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000}},
    "extra_headers": "userId=12345;sessionId=abc-xyz"}
MEDIA = {"event": "media", "sequenceNumber": 42, "streamId": STREAM, "media": {
    "track": "inbound", "timestamp": "1705312200000", "chunk": 41,
    "payload": base64.b64encode(bytes(range(160))).decode()}, "extra_headers": START["extra_headers"]}
DTMF = {"event": "dtmf", "sequenceNumber": 43, "streamId": STREAM,
        "dtmf": {"track": "inbound", "digit": "5", "timestamp": "1705312201000"}}
PLAYED = {"event": "playedStream", "sequenceNumber": 44, "streamId": STREAM, "name": "7"}
CLEARED = {"event": "clearedAudio", "sequenceNumber": 45, "streamId": STREAM}


def read(stream: PlivoStream, message: dict) -> list:
    return stream.read(json.dumps(message))


def started() -> PlivoStream:
    stream = PlivoStream()
    read(stream, START)
    return stream


def test_a_call_reads_as_plivo_sends_it():
    stream = PlivoStream()
    assert read(stream, START) == [CallStarted(CALL, STREAM, "audio/pcmu", 8000,
                                               {"userId": "12345", "sessionId": "abc-xyz"})]
    assert read(stream, MEDIA) == [CallAudio(bytes(range(160)))]
    assert read(stream, MEDIA | {"media": MEDIA["media"] | {"track": "outbound"}}) == []
    assert read(stream, DTMF) == [CallDigit("5")]
    assert read(stream, PLAYED) == [CallMarked("7")]
    assert read(stream, CLEARED) == []


def test_extra_headers_in_the_xml_attributes_form_are_the_calls_parameters():
    call, = read(PlivoStream(), START | {"extra_headers": "llm=fast,voice=alloy, keypad = off"})
    assert call.params == {"llm": "fast", "voice": "alloy", "keypad": "off"}
    call, = read(PlivoStream(), {k: v for k, v in START.items() if k != "extra_headers"})
    assert call.params == {}


def test_what_goes_back_is_play_audio_checkpoint_and_clear_audio():
    stream = started()
    play, = stream.audio(b"\xff" * 640)
    assert json.loads(play) == {"event": "playAudio", "streamId": STREAM, "media": {
        "contentType": "audio/x-mulaw", "sampleRate": 8000, "payload": base64.b64encode(b"\xff" * 640).decode()}}
    assert [json.loads(m) for m in stream.mark("7")] == [{"event": "checkpoint", "streamId": STREAM, "name": "7"}]
    assert [json.loads(m) for m in stream.clear()] == [{"event": "clearAudio", "streamId": STREAM}]


@pytest.mark.parametrize(("message", "complaint"), [
    (b"\x00\x01", "text frames"),
    ("{not json", "not JSON"),
    ("[" * 50_000, "not JSON"),  # deeper than json's recursion limit
    ("x" * 100_000, "over 65536 characters"),
    (json.dumps({"event": "stop"}), "unknown event"),
    (json.dumps(MEDIA), "before the stream's start"),
    (json.dumps(PLAYED), "before the stream's start"),
    (json.dumps(START | {"start": START["start"] | {"streamId": ""}}), "start.streamId"),
    (json.dumps(START | {"extra_headers": {"a": 1}}), "extra_headers is text"),
    (json.dumps(START | {"start": START["start"] | {"mediaFormat": {"encoding": "audio/x-l16", "sampleRate": 8000}}}),
     'contentType="audio/x-mulaw;rate=8000"'),
])
def test_garbage_before_the_start_is_refused_by_name(message, complaint):
    with pytest.raises(PhoneProtocolError, match=complaint):
        PlivoStream().read(message)


@pytest.mark.parametrize(("change", "complaint"), [
    ({"media": {"payload": "not base64!"}}, "not valid base64"),
    ({"media": {"payload": base64.b64encode(b"\x00" * 9000).decode()}}, "over 8000 bytes"),
    ({"event": "dtmf", "dtmf": {"digit": "x"}}, "dtmf.digit"),
    ({"event": "playedStream", "name": None}, "playedStream.name"),
    ({"event": "start", "start": START["start"]}, "a second start"),
])
def test_bad_messages_during_the_call_are_refused_by_name(change, complaint):
    with pytest.raises(PhoneProtocolError, match=complaint):
        read(started(), MEDIA | change)
