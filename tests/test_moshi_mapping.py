"""Moshi's protocol (`/api/chat`) as a pure mapping, with no socket, codec or session: the client's
messages are written here byte by byte as Moshi's own server reads them (a kind byte, then the
payload: 0 handshake, 1 Ogg/Opus, 2 text, 4 metadata JSON, 5 error, 6 ping; 7, 8 and 9 are KAME's
JSON events, JSON control messages and PCM16), not with kame.protocol's encoder."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kame.commands import Configure, PushAudio
from kame.protocol import ProtocolError
from kame.session_events import AssistantAudio, AssistantText, SessionFailed, SessionStats, Transcript
from server.moshi.mapping import (
    DecodeOpus,
    EncodeOpus,
    End,
    MoshiFacts,
    MoshiMapping,
    Record,
    Send,
    SessionOptions,
)

FACTS = MoshiFacts("s1", "tiny-copy", "whisper", "local", ("local", "openai"), "Be brief.",
                   {"temp": 0.8, "session_id": "s1", "max_sessions": 4})
FRAME = np.linspace(-0.5, 0.5, 1920, dtype=np.float32)


def mapping(**options) -> MoshiMapping:
    return MoshiMapping(SessionOptions(**options), max_message_bytes=64_000)


def sent(actions) -> list[bytes]:
    return [a.message for a in actions if isinstance(a, Send)]


def json_events(actions) -> list[dict]:
    return [json.loads(m[1:]) for m in sent(actions) if m[:1] == b"\x07"]


def test_the_greeting_is_moshis_handshake_then_its_metadata():
    plain = mapping()
    plain.greet(FACTS)
    actions = plain.take()
    assert sent(actions) == [b"\x00", b"\x04" + json.dumps(FACTS.metadata).encode()]
    ready = [a.event for a in actions if isinstance(a, Record)]
    assert ready[0]["type"] == "ready" and ready[0]["backends"] == ["local", "openai"]  # recorded, not sent

    with_events = mapping(events=True, audio="pcm")
    with_events.greet(FACTS)
    events = json_events(with_events.take())
    assert events[0]["type"] == "ready" and events[0]["audio"] == "pcm" and events[0]["session_id"] == "s1"


def test_the_clients_messages_become_commands_and_audio_to_decode():
    m = mapping()
    pcm = (np.arange(1920, dtype=np.int16) - 960).astype("<i2")
    m.on_client(b"\x09" + pcm.tobytes())
    m.on_client(b"\x01OggS-page")
    m.on_client(b"\x08" + json.dumps({"type": "configure", "backend": "openai"}).encode())
    m.on_client(b"\x06")  # a ping: nothing
    push, decode, configure = m.take()
    assert isinstance(push, PushAudio) and np.allclose(push.pcm, pcm / 32768, atol=1e-4)
    assert decode == DecodeOpus(b"OggS-page")
    assert configure == Configure(backend="openai", system_prompt=None)


@pytest.mark.parametrize(("message", "says"), [
    ("hello", "text frames are not part of the protocol"),
    (b"", "empty message"),
    (b"\x02hi", r"may not send message kind 2 \(text\)"),
    (b"\x08{not json", "control message is not JSON"),
    (b"\x08" + b'{"type": "configure", "bogus": 1}', "bad control message"),
    (b"\x09" + bytes(64_000), "exceeds 64000"),
])
def test_a_bad_message_is_refused_and_queues_nothing(message, says):
    m = mapping()
    with pytest.raises(ProtocolError, match=says):
        m.on_client(message)
    assert m.take() == []


def test_the_assistants_audio_goes_out_as_opus_or_pcm_and_may_be_dropped():
    opus = mapping()
    opus.on_session(AssistantAudio(3, FRAME, True, 0.1))
    (encode,) = opus.take()
    assert isinstance(encode, EncodeOpus) and encode.pcm is FRAME
    opus.encoded(b"")  # the encoder's first frames give no page yet
    opus.encoded(b"OggS")
    assert opus.take() == [Send(b"\x01OggS", droppable=True)]

    pcm = mapping(audio="pcm")
    pcm.on_session(AssistantAudio(3, FRAME, True, 0.1))
    (send,) = pcm.take()
    assert send.droppable and send.message[:1] == b"\x09"
    assert np.allclose(np.frombuffer(send.message[1:], "<i2") / 32767, FRAME, atol=1e-4)


def test_text_stats_and_json_events():
    m = mapping(events=True)
    m.on_session(AssistantText(4, " Hello"))
    m.on_session(SessionStats(frames_in=10, frames_out=9, frames_dropped=1, frame_latency_ms=12.5), queue_dropped=2)
    m.on_session(Transcript(False, "what is", 0.5, 1.0, 0.1))
    actions = m.take()
    assert sent(actions)[0] == b"\x02 Hello"
    stats, transcript = json_events(actions)
    assert stats == {"type": "stats", "frames_in": 10, "frames_out": 9, "frames_dropped": 3,
                     "frame_latency_ms": 12.5}
    assert transcript["type"] == "transcript" and transcript["text"] == "what is"
    assert not any(isinstance(a, Record) for a in actions)  # the recorder observes the session itself

    quiet = mapping()  # without ?events=1: no JSON events at all
    quiet.on_session(Transcript(False, "what is", 0.5, 1.0, 0.1))
    quiet.on_session(SessionStats(1, 1, 0, None))
    assert quiet.take() == []


def test_a_failed_session_says_why_and_ends():
    plain = mapping()
    plain.on_session(SessionFailed("engine", "the engine stopped"))
    assert plain.take() == [Send(b"\x05the engine stopped"), End("engine failure")]

    with_events = mapping(events=True)
    with_events.on_session(SessionFailed("internal", "boom"))
    actions = with_events.take()
    assert json_events(actions) == [{"type": "error", "code": "internal", "message": "boom"}]
    assert actions[-1] == End("internal error")


def test_an_error_is_recorded_and_sent_in_the_clients_form():
    plain = mapping()
    plain.error("limit", "no message for 60 s")
    assert plain.take() == [Record({"type": "error", "code": "limit", "message": "no message for 60 s"}),
                            Send(b"\x05no message for 60 s")]
    with_events = mapping(events=True)
    with_events.error("protocol", "empty message")
    record, send = with_events.take()
    assert record == Record({"type": "error", "code": "protocol", "message": "empty message"})
    assert json.loads(send.message[1:]) == record.event and send.message[:1] == b"\x07"


def test_query_options():
    options = SessionOptions.from_query({"audio": "pcm", "events": "1", "asr": "off", "oracle_delay": "0.5",
                                         "text_temperature": "0.6", "seed": "3"})
    assert (options.audio, options.events, options.asr, options.oracle_delay_s) == ("pcm", True, False, 0.5)
    assert options.sampling == {"text_temperature": 0.6} and options.ignored == ("seed",)
    for bad, says in (({"audio": "wav"}, "audio must be"), ({"oracle_delay": "31"}, "between 0 and 30"),
                      ({"events": "maybe"}, "events must be 1 or 0")):
        with pytest.raises(ProtocolError, match=says):
            SessionOptions.from_query(bad)
