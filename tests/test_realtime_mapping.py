"""The Realtime mapping as a state machine, with no socket and no session: client events and the
tandem's events in, with the time; server events and session calls out. Bursts, quiet, barge-in,
cancel, push-to-talk (turn_detection null), settling commits, silence feeding, client functions,
the beta names, and every odd shape of a client event."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import random
import re
from types import SimpleNamespace

import numpy as np
import pytest

from kame.clock import ManualClock, settle
from kame.commands import Configure, PushAudio, SetOracleDelay, TruncateAssistant
from kame.session import TandemSession
from kame.session_events import AssistantAudio, AssistantText, SessionFailed, Transcript
from server.realtime import RealtimeCarrier, RealtimeError, RealtimeMapping
from server.realtime import actions as act
from server.realtime.config import SessionFacts
from server.runner import SessionRunner
from server.settings import RealtimeSettings, ServerSettings
from tests.mapping_rig import ActionLog

NOISE = np.full(1920, 0.1, np.float32)
START = 1000.0


def facts(**options) -> SessionFacts:
    vad = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 600,
           "create_response": True, "interrupt_response": True, "idle_timeout_ms": None}
    return SessionFacts("s1", "tiny-copy", "whisper", ("scripted", "other"), "scripted", "Be brief.", vad,
                        RealtimeSettings(**options), 1 << 20)


class Rig(ActionLog):
    """One mapping on a hand-driven clock; `events()` are the server events it sent since the last
    call, `calls` every session call it made."""

    def __init__(self, beta: bool = False, **options) -> None:
        self.now = START
        super().__init__(RealtimeMapping(facts(**options), "kame", beta, self.now), act.Send)
        self.frame = 0

    def session_calls(self, kind: type) -> list:
        self._collect()
        return [call for call in self.calls if isinstance(call, kind)]

    def tick(self) -> None:
        """The timer, when the mapping asked for it by now."""
        at = self.mapping.wake_at()
        if at is not None and at <= self.now:
            self.mapping.on_time(self.now)

    def step(self, text: str | None = None, frames: int = 1) -> None:
        """`frames` output frames of the front-end, the first with `text`."""
        for index in range(frames):
            self.now += 0.08
            self.tick()
            self.mapping.on_session(AssistantAudio(self.frame, NOISE, True, 0.01), self.now)
            if text and index == 0:
                self.mapping.on_session(AssistantText(self.frame, text), self.now)
            self.frame += 1

    def quiet(self, seconds: float = 1.0) -> None:
        self.step(frames=int(seconds / 0.08) + 1)

    def wait(self, seconds: float) -> None:
        """Time passes with no frame at all (the client stopped sending): only the timer runs."""
        end = self.now + seconds
        while (at := self.mapping.wake_at()) is not None and at <= end:
            self.now = max(self.now, at)
            self.mapping.on_time(self.now)
        self.now = end

    def hear(self, text: str, final: bool, start_s: float = 1.0, end_s: float = 2.0) -> None:
        self.mapping.on_session(Transcript(final, text, start_s, end_s, 0.1), self.now)

    def send(self, event: dict) -> None:
        self.mapping.on_client(json.dumps(event), self.now)


def pushed(rig: Rig) -> list[np.ndarray]:
    return [call.pcm for call in rig.session_calls(PushAudio)]


def silence(rig: Rig) -> list[np.ndarray]:
    return [pcm for pcm in pushed(rig) if len(pcm) == 1920 and not pcm.any()]


def truncations(rig: Rig) -> list[tuple]:
    return [(call.said, call.heard) for call in rig.session_calls(TruncateAssistant)]


def types(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]


def test_a_burst_of_speech_is_one_response_and_quiet_closes_it():
    rig = Rig()
    rig.quiet()
    assert rig.events() == []  # quiet frames between responses are not sent
    rig.step(" Paris")
    rig.step(" is", frames=3)
    rig.quiet()
    events = rig.events()
    assert types(events)[:4] == ["response.created", "response.output_item.added", "conversation.item.added",
                                 "response.content_part.added"]
    audio = [e for e in events if e["type"] == "response.output_audio.delta"]
    assert 4 <= len(audio) <= 4 + 8  # the burst's frames, then up to quiet_s of its tail
    done = events[-1]
    assert done["type"] == "response.done" and done["response"]["status"] == "completed"
    assert done["response"]["output"][0]["content"][0]["transcript"] == "Paris is"
    assert types(events).count("response.created") == 1
    assert [e["event_id"] for e in events] == [f"event_s1_{n}" for n in range(1, len(events) + 1)]


def test_quiet_closes_a_burst_on_time_when_no_frame_comes():
    """The client stopped sending audio, so no frame comes out: the timer ends the response at
    quiet_s after the last speech, not later."""
    rig = Rig(quiet_s=0.6)
    rig.step(" Paris")
    spoke = rig.now
    assert rig.mapping.wake_at() == pytest.approx(spoke + 0.6)
    rig.wait(0.59)
    assert "response.done" not in types(rig.events())
    rig.wait(0.02)
    assert types(rig.events())[-1] == "response.done"


def test_barge_in_ends_the_response_as_cancelled_once_the_front_end_yields():
    rig = Rig()
    rig.step(" Paris")
    rig.hear("wait", final=False)  # the user starts talking over it
    rig.step(" is")
    rig.quiet()
    events = rig.events()
    started = types(events).index("input_audio_buffer.speech_started")
    assert started < types(events).index("response.done")
    done = events[-1]["response"]
    assert (done["status"], done["status_details"]["reason"]) == ("cancelled", "turn_detected")


def test_a_backchannel_is_no_barge_in_and_no_user_turn():
    """"Mm-hmm." while the assistant speaks (the session marked it): the response goes on and completes,
    with no speech_started, no user item, no transcript of it; the kame extension still tells it."""
    rig = Rig()
    rig.send({"type": "session.update", "session": {"kame": {"events": True}}})
    rig.step(" Paris")
    for final in (False, True):
        rig.mapping.on_session(Transcript(final, "Mm-hmm.", 1.0, 1.4, 0.1, backchannel=True), rig.now)
    rig.step(" is")
    rig.quiet()
    events = rig.events()
    assert [e["type"] for e in events if not e["type"].startswith(("response.", "kame.", "conversation.item.",
                                                                  "session.updated"))] == []
    assert not [e for e in events if e["type"].startswith("conversation.item.") and e["item"]["role"] == "user"]
    assert events[-1]["type"] == "response.done" and events[-1]["response"]["status"] == "completed"
    told = [e for e in events if e["type"] == "kame.transcript"]
    assert [e["backchannel"] for e in told] == [True, True]


def test_without_interrupt_response_a_barge_in_completes_the_response():
    rig = Rig()
    rig.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "server_vad", "interrupt_response": False}}}}})
    rig.step(" Paris")
    rig.hear("wait", final=False)
    rig.quiet()
    assert rig.events()[-1]["response"]["status"] == "completed"


def test_cancel_stops_sending_the_rest_of_the_burst():
    rig = Rig()
    rig.step(" one")
    rig.send({"type": "response.cancel"})
    rig.events()
    rig.step(" two", frames=3)  # the model goes on: full duplex, it yields by itself
    assert rig.events() == []
    rig.quiet()
    rig.step(" three")  # a new burst after quiet is a new response
    assert types(rig.events())[0] == "response.created"


def test_push_to_talk_keeps_what_the_model_said_for_response_create():
    rig = Rig()
    rig.send({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}}})
    rig.events()
    rig.hear("what is", final=False)
    rig.step(" Paris")
    rig.step(" is", frames=2)
    rig.hear("what is the capital of France", final=True)
    assert "input_audio_buffer.speech_started" not in types(rig.events())  # no server VAD events
    rig.send({"type": "input_audio_buffer.commit"})
    committed = rig.events()
    rig.send({"type": "response.create"})  # while the model is still speaking
    released = rig.events()
    rig.step(" capital")
    rig.quiet()
    live = rig.events()
    assert types(committed)[:2] == ["input_audio_buffer.committed", "conversation.item.added"]
    done = next(e for e in committed if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert done["transcript"] == "what is the capital of France"
    assert types(released)[0] == "response.created"
    assert [e["delta"] for e in released if e["type"] == "response.output_audio_transcript.delta"] == [" Paris", " is"]
    # the kept frames at once: those after the one whose text opened the burst (audio lags text)
    assert sum(e["type"] == "response.output_audio.delta" for e in released) == 2
    assert live[-1]["type"] == "response.done"
    assert live[-1]["response"]["output"][0]["content"][0]["transcript"] == "Paris is capital"


def test_a_commit_during_an_utterance_waits_for_its_final_then_settles_empty():
    """turn_detection null: a commit while the user still speaks asks the ASR to finish (a Flush);
    the final commits the item. No final within a second after the flush: an empty item."""
    rig = Rig()
    rig.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}},
                                                    "kame": {"feed_silence": False}}})  # no other deadline
    rig.hear("what is", final=False)
    rig.events()
    rig.send({"type": "input_audio_buffer.commit"})
    (flush,) = rig.session_calls(act.Flush)
    assert "input_audio_buffer.committed" not in types(rig.events())
    rig.wait(5.0)  # the flush has not finished: nothing settles yet
    assert "input_audio_buffer.committed" not in types(rig.events())
    rig.mapping.on_flushed(flush.token, rig.now)
    assert rig.mapping.wake_at() == pytest.approx(rig.now + 1.0)
    rig.wait(0.9)
    assert rig.events() == []
    rig.wait(0.2)
    events = rig.events()
    assert types(events)[0] == "input_audio_buffer.committed" and events[0]["item_id"] == flush.token
    assert next(e for e in events if e["type"].endswith("transcription.completed"))["transcript"] == ""
    # the same again, but the final comes in time: it is the item, and nothing settles later
    rig.hear("and this", final=False)
    rig.send({"type": "input_audio_buffer.commit"})
    rig.mapping.on_flushed(rig.session_calls(act.Flush)[-1].token, rig.now)
    rig.hear("and this one", final=True)
    completed = next(e for e in rig.events() if e["type"].endswith("transcription.completed"))
    assert completed["transcript"] == "and this one"
    assert rig.mapping.wake_at() is None


def test_a_response_create_nobody_answers_ends_empty():
    rig = Rig()
    rig.send({"type": "response.create"})
    with pytest.raises(RealtimeError, match="in progress"):
        rig.send({"type": "response.create"})
    rig.wait(4.9)
    assert types(rig.events()) == ["response.created"]
    rig.wait(0.2)  # response_timeout_s (5 s) after it was created
    events = rig.events()
    assert types(events) == ["response.done"] and events[-1]["response"]["output"] == []


def test_truncate_keeps_what_the_user_heard():
    rig = Rig()
    rig.step(" Paris")
    rig.step(" is", frames=3)
    rig.step(" lovely", frames=3)
    rig.quiet()
    item_id = next(e for e in rig.events() if e["type"] == "response.done")["response"]["output"][0]["id"]
    rig.send({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0, "audio_end_ms": 200})
    events = rig.events()
    assert events[-1] == events[-1] | {"type": "conversation.item.truncated", "audio_end_ms": 200}
    assert truncations(rig) == [("Paris is lovely", "Paris is")]
    with pytest.raises(RealtimeError, match="within"):  # a later truncate can only cut more
        rig.send({"type": "conversation.item.truncate", "item_id": item_id, "audio_end_ms": 400})
    rig.send({"type": "conversation.item.retrieve", "item_id": item_id})
    retrieved = rig.events()[-1]["item"]
    assert retrieved["content"][0]["transcript"] == "Paris is" and "_pieces" not in retrieved


def test_beta_clients_get_beta_names():
    rig = Rig(beta=True)
    rig.step(" Paris")
    rig.quiet()
    names = types(rig.events())
    assert "response.audio.delta" in names and "response.audio_transcript.done" in names
    assert "conversation.item.created" in names and "response.output_audio.delta" not in names


CRASHERS = [  # shapes no field check foresaw once ended the whole session (found by review)
    {"type": "session.update", "session": {"output_modalities": True}},
    {"type": "session.update", "session": {"modalities": 1.5}},
    {"type": "session.update", "session": {"audio": "x"}},
    {"type": "session.update", "session": {"audio": {"input": 5}}},
    {"type": "session.update", "session": {"audio": {"input": ["turn_detection"]}}},
    {"type": "session.update", "session": {"audio": {"output": "voice"}}},
    {"type": "session.update", "session": {"tools": True}},
    {"type": "session.update", "session": {"tools": "abc"}},
    {"type": "session.update", "session": {"kame": {"backend": ["scripted"]}}},
    {"type": "session.update", "session": {"kame": {"events": "false"}}},
    {"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "server_vad", "create_response": "false"}}}}},
    {"type": "conversation.item.create", "item": {"id": {"a": 1}, "type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "hi"}]}},
    {"type": "conversation.item.truncate", "item_id": [], "content_index": 0, "audio_end_ms": 0},
    {"type": "conversation.item.retrieve", "item_id": {"x": 1}},
    {"type": "response.create", "response": {"metadata": {"k": 1}}},
]


def test_every_odd_shape_is_a_realtime_error_never_a_crash():
    rig = Rig()
    outcomes = []
    for event in CRASHERS:
        try:
            rig.send(event)
            outcomes.append("accepted")
        except RealtimeError as exc:
            outcomes.append(exc.code)
    for text in ("[" * 100000, '{"type": "session.update", "session": {"kame": {"quiet_s": NaN}}}'):
        with pytest.raises(RealtimeError, match="not JSON"):
            rig.mapping.on_client(text, rig.now)
    assert outcomes == ["invalid_value"] * len(CRASHERS[:-4]) + [
        "invalid_value", "item_truncate_invalid_item_id", "item_retrieve_invalid_item_id", "invalid_value"]
    rig.events()
    assert rig.calls == []  # the bad item never reached the conversation


@pytest.mark.parametrize(("event", "code", "param"), [
    ({"type": "no.such.event"}, "unknown_event", "type"),
    ({"type": "input_audio_buffer.append", "audio": "not base64!"}, "invalid_base64", "audio"),
    ({"type": "input_audio_buffer.append"}, "invalid_value", "audio"),
    ({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}},
     "invalid_value", "session.audio.input.format"),
    ({"type": "session.update", "session": {"kame": {"quiet_s": 9}}}, "invalid_value", "session.kame.quiet_s"),
    ({"type": "session.update", "session": {"kame": {"backend": "nope"}}}, "invalid_value", "session.kame.backend"),
    ({"type": "session.update", "session": {"tools": [{"type": "function", "name": "bad name!"}]}},
     "invalid_value", "session.tools[0].name"),
    ({"type": "session.update", "session": {"type": "transcription"}}, "invalid_value", "session.type"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "assistant",
                                                   "content": [{"type": "input_text", "text": "x"}]}},
     "invalid_value", "item.role"),
    ({"type": "conversation.item.create", "item": {"type": "function_call", "name": "f"}}, "invalid_value",
     "item.type"),
    ({"type": "conversation.item.delete", "item_id": "x"}, "unsupported_event", "type"),
    ({"type": "input_audio_buffer.commit"}, "invalid_request", None),  # server VAD commits by itself
])
def test_a_bad_event_names_its_code_and_parameter_and_changes_nothing(event, code, param):
    rig = Rig()
    before = rig.mapping.config
    with pytest.raises(RealtimeError) as error:
        rig.send(event | {"event_id": "evt_1"})
    assert (error.value.code, error.value.param, error.value.client_event_id) == (code, param, "evt_1")
    assert rig.mapping.config == before and rig.events() == [] and rig.calls == []
    rig.mapping.refuse(error.value)
    (reported,) = rig.events()
    assert reported["error"] == {"type": "invalid_request_error", "code": code, "message": str(error.value),
                                 "param": param, "event_id": "evt_1"}


def test_session_update_applies_the_fields_it_names_and_asks_the_session_for_the_rest():
    rig = Rig()
    rig.events()
    rig.send({"type": "session.update", "session": {
        "type": "realtime", "instructions": "Talk like a pirate.", "output_modalities": ["text"],
        "audio": {"output": {"format": {"type": "audio/pcmu"}, "voice": "marin"}},
        "kame": {"backend": "other", "oracle_delay_s": 1.5, "events": True},
        "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]}})
    (updated,) = rig.events()
    session = updated["session"]
    assert session["instructions"] == "Talk like a pirate." and session["output_modalities"] == ["text"]
    assert session["audio"]["output"] == {"format": {"type": "audio/pcmu"}, "voice": "marin", "speed": 1.0}
    assert session["kame"]["backend"] == "other" and session["kame"]["events"] is True
    assert session["tools"][0]["name"] == "lookup"
    calls = rig.calls
    assert calls[0] == Configure("other", "Talk like a pirate.")
    assert calls[1] == SetOracleDelay(1.5)
    assert [spec.name for spec in calls[2].specs] == ["lookup"]
    # beta fields, and null turn detection
    rig.send({"type": "session.update", "session": {"input_audio_format": "g711_alaw", "turn_detection": None}})
    session = rig.events()[0]["session"]
    assert session["audio"]["input"]["format"] == {"type": "audio/pcma"}
    assert session["audio"]["input"]["turn_detection"] is None


def test_the_playing_item_can_be_truncated_at_a_barge_in():
    """What Pipecat does on speech_started: truncate the item still being spoken."""
    rig = Rig()
    rig.step(" Paris")
    rig.step(" is", frames=3)
    item_id = next(e for e in rig.events() if e["type"] == "response.output_item.added")["item"]["id"]
    rig.send({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0, "audio_end_ms": 80})
    closing = rig.events()
    rig.step(" the", frames=2)  # the model goes on a moment: not sent
    done = next(e for e in closing if e["type"] == "response.done")["response"]
    assert (done["status"], done["status_details"]["reason"]) == ("cancelled", "turn_detected")
    assert closing[-1]["type"] == "conversation.item.truncated"
    # both pieces came within the first 80 ms
    assert truncations(rig) == [("Paris is", "Paris is")]
    assert rig.events() == []


def test_response_done_has_a_usage_object_and_echoes_metadata():
    rig = Rig()
    rig.send({"type": "response.create", "response": {"metadata": {"client_event_id": "abc"}}})
    rig.step(" Paris")
    rig.quiet()
    events = rig.events()
    created = events[0]["response"]
    done = next(e for e in events if e["type"] == "response.done")["response"]
    assert created["metadata"] == done["metadata"] == {"client_event_id": "abc"}
    assert created["usage"] is None and done["usage"]["input_tokens"] == 0


def test_push_to_talk_transcripts_keep_one_item_id_and_a_stale_burst_is_not_the_answer():
    rig = Rig()
    rig.send({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}}})
    rig.step(" mm-hm")  # a backchannel while the user talks, nobody asked for it
    rig.quiet()
    rig.hear("what is", final=False)
    rig.hear("what is the capital", final=True)
    rig.send({"type": "input_audio_buffer.commit"})
    rig.send({"type": "response.create"})
    events = rig.events()
    delta = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.delta")
    committed = next(e for e in events if e["type"] == "input_audio_buffer.committed")
    assert delta["item_id"] == committed["item_id"]
    assert types(events)[-1] == "response.created"  # waiting for the answer, not releasing "mm-hm"
    assert "response.output_audio_transcript.delta" not in types(events)


def test_silence_is_fed_only_when_the_clients_audio_falls_behind_the_clock():
    rig = Rig()
    chunk = {"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\0" * 48000).decode()}
    rig.wait(0.5)  # the grace for configuring the session
    for _ in range(4):  # a client sending 1 s chunks in real time: never padded
        rig.send(chunk)
        rig.wait(1.0)
    assert len(silence(rig)) == 0
    rig.wait(2.6)  # then it stops sending: after the slack, one frame of silence per frame of time
    fed = len(silence(rig))
    assert abs(fed - (2.6 - 0.3) / 0.08) <= 1
    rig.now += 5.0  # the loop stalled: a few frames at once, the rest skipped, the clock live again
    rig.mapping.on_time(rig.now)
    assert len(silence(rig)) == fed + 3
    assert rig.now < rig.mapping.wake_at() <= rig.now + 0.08
    rig.send({"type": "session.update", "session": {"kame": {"feed_silence": False}}})
    assert rig.mapping.wake_at() is None  # nothing else pending: no timer at all
    rig.wait(3.0)
    rig.send({"type": "session.update", "session": {"kame": {"feed_silence": True}}})
    before = len(pushed(rig))
    rig.wait(0.25)  # it counts from when it was turned on again: within the slack, nothing yet
    assert len(pushed(rig)) == before


def test_the_deadline_always_moves_on():
    """After on_time(now), the next deadline is later than now whatever happened before (the
    adapter's timer would spin otherwise): random walks through the mapping's states."""
    random.seed(7)
    for walk in range(40):
        rig = Rig(quiet_s=random.choice([0.16, 0.6, 1.0]))
        if walk % 2:
            rig.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        for _ in range(60):
            choice = random.random()
            if choice < 0.4:
                rig.step(random.choice([None, " a", " b"]))
            elif choice < 0.5:
                rig.hear("x", final=random.random() < 0.5)
            elif choice < 0.6:
                kind = random.choice(["response.create", "response.cancel", "input_audio_buffer.commit"])
                with contextlib.suppress(RealtimeError):
                    rig.send({"type": kind})
                for flush in rig.session_calls(act.Flush):
                    rig.mapping.on_flushed(flush.token, rig.now)
            else:
                rig.now += random.choice([0.0, 0.01, 0.3, 1.0, 6.0]) + random.random() * 1e-9
            at = rig.mapping.wake_at()
            if at is not None and at <= rig.now:
                rig.mapping.on_time(rig.now)
                after = rig.mapping.wake_at()
                assert after is None or after > rig.now
            rig.events()


def test_a_function_output_that_comes_after_its_call_stopped_waiting_is_kept_not_an_error():
    """A call times out (or its attempt is superseded) before the client answers: the late output
    is stored in the conversation, with no error event (some frameworks end their session on one);
    an output for a call never made, or a second one, is still an error."""
    rig = Rig()
    call_id = rig.mapping.function_call("lookup", {"q": "x"}, rig.now)
    sent = rig.events()
    assert types(sent)[0] == "response.created" and types(sent)[-1] == "response.done"
    assert next(e for e in sent if e["type"] == "response.function_call_arguments.done")["call_id"] == call_id
    rig.mapping.call_ended(call_id, answered=False)  # the tool's timeout, or a newer attempt
    output = {"type": "conversation.item.create",
              "item": {"type": "function_call_output", "call_id": call_id, "output": "late"}}
    rig.send(output)
    late = rig.events()
    assert [e["type"] for e in late] == ["conversation.item.added", "conversation.item.done"]
    assert late[0]["item"]["output"] == "late" and rig.session_calls(act.AnswerCall) == []
    for event in (output, {"type": "conversation.item.create", "item": {
            "type": "function_call_output", "call_id": "call_never", "output": "x"}}):
        with pytest.raises(RealtimeError) as error:
            rig.send(event)
        assert error.value.code == "invalid_value"
    # a call still waiting is answered once
    waiting = rig.mapping.function_call("lookup", {"q": "y"}, rig.now)
    rig.send({"type": "conversation.item.create",
              "item": {"type": "function_call_output", "call_id": waiting, "output": "42"}})
    assert rig.session_calls(act.AnswerCall) == [act.AnswerCall(waiting, "42")]


def test_an_engine_failure_is_reported_and_ends_the_session():
    rig = Rig()
    rig.events()
    rig.mapping.on_session(SessionFailed("engine", "the engine failed"), rig.now)
    (error,) = rig.events()
    assert error["error"]["type"] == "server_error" and rig.calls == [act.End("engine failure")]


def test_extension_events_only_when_asked_for():
    rig = Rig()
    rig.hear("hello", final=False)
    assert "kame.transcript" not in types(rig.events())
    rig.send({"type": "session.update", "session": {"kame": {"events": True}}})
    rig.hear("hello there", final=False)
    rig.step(" Hi")
    names = types(rig.events())
    assert "kame.transcript" in names
    assert all("kame_frame" in e for e in rig.events() if e["type"] == "response.output_audio.delta")


class FakeTandem:
    """What the adapter calls on the session."""

    backend, system_prompt, tools_on = "scripted", "Be brief.", True

    def __init__(self) -> None:
        self.pushed: list[int] = []

    def push_pcm(self, pcm) -> None:
        self.pushed.append(len(pcm))

    apply = TandemSession.apply  # the session's own dispatch, onto these methods

    async def flush(self) -> None:
        pass


def test_the_carrier_sleeps_on_its_clock_until_the_mappings_next_deadline():
    """The carrier without a link: its one timer runs on the injected clock, feeds silence
    in step with it, and wakes sooner when a client event brings a deadline nearer."""
    async def go():
        clock = ManualClock(START)
        services = SimpleNamespace(settings=ServerSettings(), metrics=None, runtime=SimpleNamespace(
            asr=SimpleNamespace(name="whisper"), profiles={"scripted": None},
            frontend=SimpleNamespace(source="tiny-copy")))
        runner = SessionRunner(services, link=None, transport="realtime", clock=clock)
        tandem = FakeTandem()
        carrier = RealtimeCarrier(runner, tandem, "kame", beta=False)
        await carrier.greet()
        timer = asyncio.create_task(*carrier.tasks())
        await settle()
        await clock.advance(0.5 + 0.3)  # the grace, the slack: the first frame of silence is due
        for _ in range(10):  # then one frame of silence per frame of time
            await clock.advance(0.08)
        fed_early = len(tandem.pushed)
        await carrier.on_message(json.dumps({"type": "session.update", "session": {"kame": {"feed_silence": False}}}))
        await carrier.on_message(json.dumps({"type": "response.create"}))
        await clock.advance(4.9)
        sent_before = [json.loads(runner.outbox.get_nowait())["type"] for _ in range(len(runner.outbox))]
        await clock.advance(0.2)
        sent_after = [json.loads(runner.outbox.get_nowait())["type"] for _ in range(len(runner.outbox))]
        timer.cancel()
        await asyncio.gather(timer, return_exceptions=True)
        return fed_early, tandem.pushed, sent_before, sent_after

    fed_early, pushed, before, after = asyncio.run(go())
    assert fed_early == 11
    assert pushed == [1920] * 11  # none after feed_silence went off
    assert before == ["session.created", "session.updated", "response.created"]
    assert after == ["response.done"]  # the response timeout, found by the timer with no frame coming


def test_a_pause_without_a_final_keeps_the_users_turn_open():
    """The ASR's end of turn holds the final through a pause in mid-question (docs/turn-taking.md): with
    partials only, nothing stops, commits or starts again, even when the front-end speaks in the pause;
    the final then closes one turn holding the whole question."""
    rig = Rig()
    rig.hear("how many legs", final=False, start_s=0.5, end_s=1.2)
    rig.hear("how many legs does a", final=False, start_s=0.5, end_s=1.6)
    rig.step(" mm", frames=2)  # a backchannel in the pause
    rig.quiet(1.5)
    rig.wait(1.0)  # and time with no frame at all
    rig.hear("how many legs does a", final=False, start_s=0.5, end_s=3.0)  # a re-decode in the pause
    paused = types(rig.events())
    assert "input_audio_buffer.speech_stopped" not in paused and "input_audio_buffer.committed" not in paused
    assert paused.count("input_audio_buffer.speech_started") == 1
    rig.hear("how many legs does a spider have", final=False, start_s=0.5, end_s=4.0)
    rig.hear("How many legs does a spider have?", final=True, start_s=0.5, end_s=4.4)
    events = rig.events()
    assert "input_audio_buffer.speech_started" not in types(events)
    assert types(events).count("input_audio_buffer.speech_stopped") == 1
    assert types(events).count("input_audio_buffer.committed") == 1
    done = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert done["transcript"] == "How many legs does a spider have?"


def test_transcription_deltas_add_up_to_the_words_when_partials_revise_their_end():
    """Whisper's partials end in punctuation that the next one changes ("What's the..." then "What's the
    weather..."): the deltas are the words that will not change, a settled partial (a pause) sends the rest,
    and joined they are the transcript's words, none twice (they went out as prefixes of the partial text,
    which glued "Cap." to "rance" and, partial after partial, sent nothing for seconds)."""
    rig = Rig()
    for text in ["What's the...", "What's the weather...", "What's the weather going to be?",
                 "What's the weather going to be like in Boston?"]:
        rig.hear(text, final=False)
    early = "".join(e["delta"] for e in rig.events()
                    if e["type"] == "conversation.item.input_audio_transcription.delta")
    assert early == "What's the weather going to be"
    rig.mapping.on_session(Transcript(False, "What's the weather going to be like in Boston?", 1.0, 2.0, 0.1,
                                      settled=True), rig.now)
    settled = "".join(e["delta"] for e in rig.events())
    assert settled == " like in Boston?"
    rig.hear("What's the weather going to be like in Boston tomorrow afternoon?", final=True)
    events = rig.events()
    tail = "".join(e["delta"] for e in events if e["type"] == "conversation.item.input_audio_transcription.delta")
    (completed,) = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"]

    def plain(text: str) -> list[str]:  # a word sent before the final may keep the partial's punctuation
        return [re.sub(r"[^\w']", "", w.lower()) for w in text.split()]

    assert tail == " tomorrow afternoon?"  # no word twice
    assert plain(early + settled + tail) == plain(completed["transcript"])


def test_an_utterance_that_ends_as_a_backchannel_leaves_the_next_one_whole():
    """A word settled before the rest showed a backchannel ("I" of "I see."): the next utterance is an item of
    its own, every word of it under its id (the stale tracker swallowed its first word)."""
    rig = Rig()
    rig.events()
    rig.mapping.on_session(Transcript(False, "I", 0.5, 0.9, 0.1, settled=True), rig.now)
    rig.mapping.on_session(Transcript(True, "I see.", 0.5, 1.4, 0.1, backchannel=True), rig.now)
    for partial in ["What", "What time", "What time is", "What time is it"]:
        rig.hear(partial, final=False, start_s=3.0, end_s=3.5)
    rig.hear("What time is it?", final=True, start_s=3.0, end_s=4.0)
    events = rig.events()
    (completed,) = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"]
    deltas = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.delta"
              and e["item_id"] == completed["item_id"]]
    assert "".join(d["delta"] for d in deltas) == "What time is it?"


def test_an_announced_utterance_that_ends_as_a_backchannel_is_stopped_and_deleted():
    """"I" settled, then the final "I see." is a backchannel: the item speech_started announced (its "I" delta
    under its id) never comes. The client sees its speech_stopped, then conversation.item.deleted, and no
    commit, then or later (every event as the openai SDK's types take it)."""
    from openai.types.realtime import RealtimeServerEvent
    from pydantic import TypeAdapter

    rig = Rig()
    rig.events()
    rig.mapping.on_session(Transcript(False, "I", 0.5, 0.9, 0.1, settled=True), rig.now)
    rig.now += 0.6
    rig.mapping.on_session(Transcript(True, "I see.", 0.5, 1.4, 0.1, backchannel=True), rig.now)
    rig.wait(5.0)
    events = [e for e in rig.events() if not e["type"].startswith("response.")]
    for event in events:
        TypeAdapter(RealtimeServerEvent).validate_python(event)
    item = events[0]["item_id"]
    assert [(e["type"], e["item_id"]) for e in events] == [
        ("input_audio_buffer.speech_started", item), ("conversation.item.input_audio_transcription.delta", item),
        ("input_audio_buffer.speech_stopped", item), ("conversation.item.deleted", item)]
    assert events[2]["audio_end_ms"] == 1400


def test_push_to_talk_utterances_before_the_commit_are_one_items_deltas():
    rig = Rig()
    rig.send({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}}})
    rig.events()
    rig.hear("what is the capital", final=True, start_s=1.0, end_s=2.0)
    rig.hear("of France", final=True, start_s=3.0, end_s=4.0)
    rig.send({"type": "input_audio_buffer.commit"})
    events = rig.events()
    deltas = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.delta"]
    (committed,) = [e for e in events if e["type"] == "input_audio_buffer.committed"]
    assert {d["item_id"] for d in deltas} == {committed["item_id"]}
    assert "".join(d["delta"] for d in deltas) == "what is the capital of France"
