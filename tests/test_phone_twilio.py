"""Twilio's side of a phone call, without a server: the Media Streams messages read as Twilio's reference
writes them, what goes back, the request signature (checked against the twilio SDK's own validator), the
stream's one-call token and the TwiML."""

from __future__ import annotations

import base64
import contextlib
import json
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.phone.streams import CallAudio, CallDigit, CallMarked, CallStarted, CallStopped, PhoneProtocolError
from server.phone.twilio import StreamTokens, TwilioStream, signature, signed, twiml

# the messages as Twilio's "Media Streams - WebSocket Messages" reference shows them
CONNECTED = {"event": "connected", "protocol": "Call", "version": "1.0.0"}
START = {"event": "start", "sequenceNumber": "1", "start": {
    "accountSid": "AC123", "streamSid": "MZ18ad3ab5a668481ce02b83e7395059f0", "callSid": "CA123",
    "tracks": ["inbound", "outbound"], "customParameters": {"FirstName": "Jane", "instructions": "Be brief."},
    "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}},
    "streamSid": "MZ18ad3ab5a668481ce02b83e7395059f0"}
MEDIA = {"event": "media", "sequenceNumber": "3", "media": {"track": "inbound", "chunk": "1", "timestamp": "5",
         "payload": base64.b64encode(bytes(range(160))).decode()}, "streamSid": START["streamSid"]}
DTMF = {"event": "dtmf", "streamSid": START["streamSid"], "sequenceNumber": "5",
        "dtmf": {"track": "inbound_track", "digit": "1"}}
MARK = {"event": "mark", "sequenceNumber": "4", "streamSid": START["streamSid"], "mark": {"name": "my label"}}
STOP = {"event": "stop", "sequenceNumber": "5", "streamSid": START["streamSid"],
        "stop": {"accountSid": "AC123", "callSid": "CA123"}}


def read(stream: TwilioStream, message: dict) -> list:
    return stream.read(json.dumps(message))


def test_a_call_reads_as_twilio_sends_it():
    stream = TwilioStream()
    assert read(stream, CONNECTED) == []
    assert read(stream, START) == [CallStarted("CA123", START["streamSid"], "audio/pcmu", 8000,
                                               {"FirstName": "Jane", "instructions": "Be brief."})]
    assert read(stream, MEDIA) == [CallAudio(bytes(range(160)))]
    assert read(stream, DTMF) == [CallDigit("1")]
    assert read(stream, MARK) == [CallMarked("my label")]
    assert [type(e) for e in read(stream, STOP)] == [CallStopped]


def test_what_goes_back_names_the_stream():
    stream = TwilioStream()
    read(stream, START)
    media, = stream.audio(b"\xff" * 640)
    assert json.loads(media) == {"event": "media", "streamSid": START["streamSid"],
                                 "media": {"payload": base64.b64encode(b"\xff" * 640).decode()}}
    assert [json.loads(m) for m in stream.mark("7")] == [
        {"event": "mark", "streamSid": START["streamSid"], "mark": {"name": "7"}}]
    assert [json.loads(m) for m in stream.clear()] == [{"event": "clear", "streamSid": START["streamSid"]}]


@pytest.mark.parametrize(("message", "complaint"), [
    (b"\x00\x01", "text frames"),
    ("{not json", "not JSON"),
    ('"a string"', "a JSON object"),
    (json.dumps({"event": "hangup"}), "unknown event"),
    (json.dumps(MEDIA), "before the stream's start"),
])
def test_garbage_before_the_start_is_refused_by_name(message, complaint):
    with pytest.raises(PhoneProtocolError, match=complaint):
        TwilioStream().read(message)


@pytest.mark.parametrize(("change", "complaint"), [
    ({"media": {"payload": "not base64!"}}, "not valid base64"),
    ({"media": {"payload": 42}}, "base64 text"),
    ({"media": {"payload": base64.b64encode(b"\x00" * 9000).decode()}}, "over 8000 bytes"),
    ({"media": None}, "'media' object"),
    ({"event": "dtmf", "dtmf": {"digit": "12"}}, "dtmf.digit"),
    ({"event": "mark", "mark": {"name": 3}}, "mark.name"),
    ({"event": "start", "start": START["start"]}, "a second start"),
])
def test_bad_messages_during_the_call_are_refused_by_name(change, complaint):
    stream = TwilioStream()
    read(stream, START)
    with pytest.raises(PhoneProtocolError, match=complaint):
        read(stream, MEDIA | change)


def test_a_stream_in_another_format_is_refused():
    other = json.loads(json.dumps(START))
    other["start"]["mediaFormat"] = {"encoding": "audio/x-l16", "sampleRate": 16000, "channels": 1}
    with pytest.raises(PhoneProtocolError, match="mu-law at 8000"):
        read(TwilioStream(), other)


# ---- the request signature, against Twilio's own validator

def test_the_signature_is_twilios():
    from twilio.request_validator import RequestValidator

    token, url = "12345", "https://mycompany.com/myapp.php?foo=1&bar=2"
    params = {"CallSid": "CA1234567890ABCDE", "Caller": "+12349013030", "Digits": "1234", "From": "+12349013030",
              "To": "+18005551212"}
    validator = RequestValidator(token)
    expected = validator.compute_signature(url, params)
    assert signature(token, url, params) == expected
    assert signed(token, url, params, expected)
    assert not signed(token, url, params | {"Digits": "1235"}, expected)  # a parameter changed
    assert not signed("54321", url, params, expected)  # another account's token
    assert not signed(token, url, params, None)


def test_a_url_signed_with_or_without_its_default_port_passes():
    from twilio.request_validator import RequestValidator

    token, params = "12345", {"CallSid": "CA1"}
    validator = RequestValidator(token)
    with_port = validator.compute_signature("https://voice.example.com:443/twilio/voice", params)
    assert signed(token, "https://voice.example.com/twilio/voice", params, with_port)
    without = validator.compute_signature("https://voice.example.com/twilio/voice", params)
    assert signed(token, "https://voice.example.com:443/twilio/voice", params, without)


# ---- the stream's token

def test_a_stream_token_opens_one_stream_for_its_call_within_its_time():
    now = [1000.0]
    tokens = StreamTokens("secret", ttl_s=60, clock=lambda: now[0])
    token = tokens.issue("CA1")
    assert tokens.take(token) == "CA1"
    assert tokens.take(token) is None  # once
    late = tokens.issue("CA2")
    now[0] += 61
    assert tokens.take(late) is None  # expired
    forged = tokens.issue("CA3").replace("CA3", "CA4")
    assert tokens.take(forged) is None
    assert StreamTokens("another").take(tokens.issue("CA5")) is None  # another server's key
    for junk in (None, "", "a.b", "CA1.x.y.z"):
        assert tokens.take(junk) is None


# ---- TwiML

def test_the_twiml_connects_a_bidirectional_stream_with_the_parameters():
    text = twiml("wss://voice.example.com/twilio/media?stream_token=a.b.c.d",
                 {"From": "+15551234567", "instructions": 'Say "hi" & <wave>'})
    root = ET.fromstring(text)
    stream = root.find("./Connect/Stream")
    assert root.tag == "Response" and stream is not None
    assert stream.get("url") == "wss://voice.example.com/twilio/media?stream_token=a.b.c.d"
    assert {p.get("name"): p.get("value") for p in stream.findall("Parameter")} == {
        "From": "+15551234567", "instructions": 'Say "hi" & <wave>'}


# ---- whatever comes, the stream reads it or refuses it by name (never a crash that ends the call)

def _refused_or_read(stream: TwilioStream, message) -> None:
    with contextlib.suppress(PhoneProtocolError):
        stream.read(message)


@pytest.mark.parametrize("message", [
    "[" * 50_000,  # deeper than json's recursion limit (and under the size limit)
    json.dumps({"event": "start", "start": {**START["start"], "mediaFormat": "audio/x-mulaw"}}),
    json.dumps({"event": "start", "start": {**START["start"], "mediaFormat": {"sampleRate": "eight thousand"}}}),
    json.dumps({"event": "start", "start": {**START["start"], "mediaFormat": {"sampleRate": [8000]}}}),
    json.dumps({"event": "start", "start": {**START["start"], "customParameters": ["a"]}}),
    json.dumps({"event": "start", "start": []}),
    json.dumps({"event": ["media"]}),
])
def test_odd_messages_are_refused_by_name(message):
    with pytest.raises(PhoneProtocolError):
        TwilioStream().read(message)


def test_a_message_far_over_any_twilio_message_is_refused_unread():
    huge = json.dumps({"event": "connected", "padding": "x" * 10_000_000})
    with pytest.raises(PhoneProtocolError, match="over"):
        TwilioStream().read(huge)


def test_stop_ends_the_call_even_before_the_start():
    assert [type(e) for e in read(TwilioStream(), STOP)] == [CallStopped]


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=20),
       st.sampled_from(["connected", "start", "media", "dtmf", "mark", "stop", "clear", None]))
@settings(max_examples=300, deadline=None)
def test_any_json_is_read_or_refused_by_name(body, event):
    """Fields of any type where Twilio's have one: a start's, then a media, dtmf, mark or stop message's."""
    stream = TwilioStream()
    for message in ({"event": "start", "streamSid": "MZ1", "start": body}, {"event": event, event or "x": body},
                    body, {"event": "start", "start": START["start"] | {"mediaFormat": body}},
                    {"event": "start", "start": START["start"] | {"customParameters": body}},
                    {"event": event, "media": {"payload": body}, "dtmf": {"digit": body}, "mark": {"name": body}}):
        _refused_or_read(stream, json.dumps(message))
