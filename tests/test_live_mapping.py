"""The GPT-Live mapping as a state machine, with no socket and no session: client events and the
tandem's events in, with the time; server events and session calls out. Every server event is
checked against the openai SDK's own `ServerEvent` union (the schema)."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from openai.types.live import ServerEvent
from pydantic import TypeAdapter

from kame.commands import AddContext, Configure, PushAudio
from kame.pcm import pcm16_encode
from kame.session_events import AssistantAudio, AssistantText, LLMAttempt, SessionFailed, Transcript
from server.live import actions as act
from server.live.client_events import LiveError
from server.live.config import LiveFacts
from server.live.mapping import MAX_CONTENT_TOKENS, LiveMapping
from tests.mapping_rig import ActionLog, bare_runner

SERVER_EVENT = TypeAdapter(ServerEvent)
START = 1000.0
NOISE = np.full(1920, 0.1, np.float32)


def facts(**kw) -> LiveFacts:
    base = {"session_id": "s1", "profiles": {"scripted": "scripted-model", "other": "gpt-4.1"},
            "default_profile": "scripted", "system_prompt": "Be brief.", "max_event_bytes": 1 << 20,
            "expires_at": 2_000_000_000}
    return LiveFacts(**(base | kw))


class Rig(ActionLog):
    """One mapping on a hand-driven clock; `events()` are the server events since the last call (each
    validated by the SDK's types), `calls` every other action."""

    def __init__(self, **kw) -> None:
        self.now = START
        super().__init__(LiveMapping(facts(**kw)), act.Send)

    def check(self, event: dict) -> None:
        if not event["type"].startswith("kame."):
            SERVER_EVENT.validate_python(event)

    def types(self) -> list[str]:
        return [e["type"] for e in self.events()]

    def of(self, kind: type) -> list:
        self._collect()
        return [c for c in self.calls if isinstance(c, kind)]

    def send(self, **event) -> None:
        self.mapping.on_client(json.dumps(event), self.now)

    def error(self, **event) -> LiveError:
        with pytest.raises(LiveError) as caught:
            self.send(**event)
        self.mapping.refuse(caught.value)
        (sent,) = self.events()
        assert sent["type"] == "error" and sent["error"]["code"] == caught.value.code
        return caught.value

    def start(self, **session) -> dict:
        self.send(type="session.start", event_id="start-1", session={"model": "gpt-live-1", **session})
        (started, *rest) = self.events()
        assert started["type"] == "session.started"
        self.rest = rest
        return started

    def time(self, seconds: float) -> None:
        self.now += seconds
        self.mapping.on_time(self.now)


def test_nothing_but_an_error_before_session_start_then_the_resolved_session():
    rig = Rig()
    err = rig.error(type="session.input_audio.append", audio="AAAA", event_id="a1")
    assert err.code == "session_not_started" and err.client_event_id == "a1"
    assert rig.mapping.wake_at() is None  # no silence, no usage before the start
    started = rig.start(delegation={"type": "responses", "responses": {"model": "other", "instructions": "Cite."}},
                        instructions="Speak warmly.")
    session = started["session"]
    assert started["client_event_id"] == "start-1"
    assert session["id"] == "s1" and session["status"] == "active" and session["model"] == "gpt-live-1"
    assert session["delegation"]["type"] == "responses" and session["delegation"]["responses"]["model"] == "other"
    assert session["audio"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert rig.of(Configure) == [Configure("other", "Cite.\n\nSpeak warmly.")]
    assert rig.of(act.Delegate) == []
    assert rig.error(type="session.start", session={"model": "m"}).code == "session_already_started"


def test_a_responses_model_no_profile_serves_gets_the_default_profile_and_an_info():
    rig = Rig()
    rig.start(delegation={"type": "responses", "responses": {"model": "gpt-5.5"}})
    (info,) = rig.rest
    assert info["type"] == "info" and info["code"] == "delegation_model_substituted" and "gpt-5.5" in info["message"]
    assert rig.of(Configure)[0].backend == "scripted"
    rig2 = Rig()
    rig2.start(delegation={"type": "responses", "responses": {"model": "gpt-4.1"}})  # a profile's model
    assert rig2.rest == [] and rig2.of(Configure)[0].backend == "other"


@pytest.mark.parametrize(("event", "code", "param"), [
    ({"type": "session.start", "session": {"model": "m", "voice": "x"}}, "unknown_parameter", "session.voice"),
    ({"type": "session.start", "session": {"model": "m", "audio": {"format": {"type": "audio/pcm", "rate": 8000}}}},
     "invalid_value", "session.audio.format.rate"),
    ({"type": "session.start", "session": {}}, "missing_required_parameter", "session.model"),
    ({"type": "session.start", "session": {"model": "m", "delegation": {
        "type": "responses", "responses": {"model": "x", "tools": [{"type": "web_search"}]}}}},
     "unsupported_parameter", "session.delegation.responses.tools[0].type"),
    ({"type": "session.start", "session": {"model": "m", "input": [{"role": "user", "content": [{"txt": "a"}]}]}},
     "unknown_parameter", "session.input[0].content[0].txt"),
    ({"type": "session.begin"}, "invalid_value", "type"),
])
def test_a_bad_start_is_refused_naming_the_parameter_and_the_session_can_still_start(event, code, param):
    rig = Rig()
    err = rig.error(**event)
    assert (err.code, err.param) == (code, param)
    assert not rig.mapping.started
    rig.start()


def test_audio_formats_odd_bytes_and_bad_base64_and_mute():
    rig = Rig()
    rig.start()
    good = base64.b64encode(pcm16_encode(NOISE)).decode()
    rig.send(type="session.input_audio.append", audio=good)
    assert rig.error(type="session.input_audio.append", audio="%%%").code == "invalid_audio"
    assert rig.error(type="session.input_audio.append", audio=base64.b64encode(b"abc").decode()).code == "invalid_audio"
    rig.send(type="session.input_audio.mute", event_id="m1")
    (muted,) = rig.events()
    assert (muted["type"], muted["client_event_id"]) == ("session.input_audio.muted", "m1")
    rig.send(type="session.input_audio.append", audio=good)
    rig.send(type="session.input_audio.unmute")
    rig.send(type="session.input_audio.append", audio=good)
    pushed = [c.pcm for c in rig.of(PushAudio)]
    assert len(pushed) == 3 and np.abs(pushed[0]).max() > 0.09
    assert not pushed[1].any()  # muted: the front-end hears silence of the same length
    assert len(pushed[1]) == 1920 and np.abs(pushed[2]).max() > 0.09
    assert rig.mapping.audio_ms() == 240


def test_g711_at_8_khz_in_and_out():
    rig = Rig()
    rig.start(audio={"format": {"type": "audio/pcmu", "rate": 8000}})
    rig.send(type="session.input_audio.append", audio=base64.b64encode(b"\xff" * 640).decode())  # 80 ms
    (push,) = rig.of(PushAudio)
    assert len(push.pcm) == 1920
    rig.mapping.on_session(AssistantAudio(0, NOISE, True, 0.01), rig.now)
    (delta,) = rig.events()
    assert len(base64.b64decode(delta["delta"])) == 640  # 80 ms of 8 kHz mu-law


def test_16_khz_pcm_is_resampled_both_ways():
    rig = Rig()
    rig.start(audio={"format": {"type": "audio/pcm", "rate": 16000}})
    for _ in range(5):
        rig.send(type="session.input_audio.append", audio=base64.b64encode(pcm16_encode(NOISE[:1280])).decode())
    got = sum(len(c.pcm) for c in rig.of(PushAudio))
    assert 1920 * 5 - 1000 <= got <= 1920 * 5  # 400 ms at 24 kHz, less the resampler's delay (~35 ms)
    for frame in range(5):
        rig.mapping.on_session(AssistantAudio(frame, NOISE, True, 0.01), rig.now)
    out = sum(len(base64.b64decode(e["delta"])) // 2 for e in rig.events())
    assert 1280 * 5 - 700 <= out <= 1280 * 5


def test_the_front_end_speaks_continuously_with_its_transcript_on_the_output_timeline():
    rig = Rig()
    rig.start()
    for frame in range(3):
        rig.mapping.on_session(AssistantAudio(frame, NOISE, frame > 0, 0.01), rig.now)
    rig.mapping.on_session(AssistantText(12, " Paris"), rig.now)
    events = rig.events()
    assert [e["type"] for e in events] == ["session.output_audio.delta"] * 3 + ["session.output_transcript.delta"]
    assert "start_ms" not in events[0]  # omitted on the primary socket
    assert events[-1] | {"event_id": ""} == {"type": "session.output_transcript.delta", "event_id": "",
                                             "delta": " Paris", "start_ms": 960, "end_ms": 1040}


def test_the_users_words_go_out_once_stable_with_their_times():
    rig = Rig()
    rig.start()
    for text, end in (("what is", 0.8), ("what is the", 1.2), ("what is the capital of", 1.9)):
        rig.mapping.on_session(Transcript(False, text, 0.5, end, 0.1), rig.now)
    rig.mapping.on_session(Transcript(True, "What is the capital of France?", 0.5, 2.6, 0.1), rig.now)
    deltas = [(e["delta"], e["start_ms"], e["end_ms"]) for e in rig.events()]
    assert "".join(d for d, _, _ in deltas) == "what is the capital of France?"
    starts, ends = [s for _, s, _ in deltas], [e for _, _, e in deltas]
    assert starts[0] == 500 and ends[-1] == 2600
    assert all(a <= b for a, b in zip(ends, starts[1:], strict=False))  # no two deltas overlap


def test_a_pause_in_an_open_user_turn_gets_a_space_at_least_every_third_of_a_second():
    """Pipecat and LiveKit end a user turn after 0.8 s without a delta: while words of an utterance are out
    and its final has not come, the mapping's own clock sends a space (a slow decode delays the words, not
    the spaces); none after the final, and none once words stopped coming for 5 s (an ASR that never
    ends the utterance holds no turn open for ever)."""
    rig = Rig()
    rig.start()

    def deltas(seconds: float) -> list[tuple[float, str]]:
        """The deltas of the next `seconds`, the mapping woken when it asks (as the carrier's timer does)."""
        out, until = [], rig.now + seconds
        while (wake := rig.mapping.wake_at()) <= until:
            rig.time(max(wake - rig.now, 0.0))
            out += [(round(rig.now - START, 2), e["delta"]) for e in rig.events()
                    if e["type"] == "session.input_transcript.delta"]
        rig.time(until - rig.now)
        return out

    rig.time(1.0)
    for _ in range(2):
        rig.mapping.on_session(Transcript(False, "so what is", 0.5, 1.0, 0.1), rig.now)
    assert [e["delta"] for e in rig.events()] == ["so what"]
    pause = deltas(1.0)  # no transcript for a second: a decode stalled, or the user paused
    assert [d for _, d in pause] == [" "] * 3 and max(b - a for a, b in zip(
        [1.0] + [t for t, _ in pause], [t for t, _ in pause] + [2.0], strict=False)) <= 0.35
    rig.mapping.on_session(Transcript(True, "so what is the capital", 0.5, 2.4, 0.1), rig.now)
    assert [e["delta"] for e in rig.events()] == ["is the capital"]  # a space went ahead: no second one
    assert deltas(1.0) == []  # the turn ended
    rig.mapping.on_session(Transcript(False, "and spain", 3.5, 4.0, 0.1), rig.now)
    rig.mapping.on_session(Transcript(False, "and spain", 3.5, 4.0, 0.1), rig.now)
    assert [e["delta"] for e in rig.events()] == [" and"]
    spaces = deltas(7.0)
    assert 15 <= len(spaces) <= 17 and spaces[-1][0] - spaces[0][0] <= 5.0  # then the client may end the turn


def test_an_utterance_that_ends_as_a_backchannel_leaves_the_next_one_whole():
    """"I" settled before "I see." showed a backchannel: it went out, but the utterance ends there (no more
    spaces for it) and the next one's words all go out (a stale count swallowed the first)."""
    rig = Rig()
    rig.start()
    rig.mapping.on_session(Transcript(False, "I", 0.5, 0.9, 0.1, settled=True), rig.now)
    rig.mapping.on_session(Transcript(True, "I see.", 0.5, 1.4, 0.1, backchannel=True), rig.now)
    assert [e["delta"] for e in rig.events()] == ["I"]
    assert not rig.mapping._words.open and rig.mapping._keepalive.due() == ()
    rig.mapping.on_session(Transcript(True, "What time is it?", 3.0, 4.0, 0.1), rig.now)
    assert [e["delta"] for e in rig.events()] == [" What time is it?"]


def test_a_backchannel_sends_no_user_words():
    """"Mm-hmm." while the assistant speaks: no input transcript a client would make a user turn of;
    the user's next real words go out whole."""
    rig = Rig()
    rig.start()
    rig.mapping.on_session(Transcript(True, "Mm-hmm.", 0.5, 0.9, 0.1, backchannel=True), rig.now)
    assert rig.events() == []
    rig.mapping.on_session(Transcript(True, "And Spain?", 1.5, 2.2, 0.1), rig.now)
    assert "".join(e["delta"] for e in rig.events()) == "And Spain?"


def attempt(phase: str, epoch: int, **kw) -> LLMAttempt:
    return LLMAttempt(phase, epoch, "scripted", "partial", **kw)


def test_responses_delegation_each_attempt_a_delegation_with_its_progress():
    rig = Rig()
    rig.start(delegation={"type": "responses", "responses": {"model": "scripted"}})
    rig.send(type="session.input_audio.append", audio=base64.b64encode(pcm16_encode(NOISE)).decode())
    rig.events()
    rig.mapping.on_session(attempt("started", 1, user_text="what is"), rig.now)
    rig.mapping.on_session(attempt("started", 2, user_text="what is the capital"), rig.now)
    rig.mapping.on_session(attempt("first_token", 2, latency_s=0.3), rig.now)
    rig.mapping.on_session(attempt("cancelled", 1), rig.now)
    rig.mapping.on_session(attempt("done", 2, answer="Paris."), rig.now)
    events = rig.events()
    created = [e for e in events if e["type"] == "session.delegation.created"]
    assert [c["delegation"]["target"] for c in created] == ["responses", "responses"]
    assert created[0]["offset_ms"] == 80 and all(c["delegation"]["response_id"].startswith("resp_") for c in created)
    second = created[1]["delegation"]["id"]
    nested = [(e["delegation_id"] == second, e["event"]["type"]) for e in events if e["type"] == "response.event"]
    assert nested == [(False, "response.created"), (True, "response.created"), (True, "response.in_progress"),
                      (False, "response.completed"), (True, "response.output_text.delta"),
                      (True, "response.output_text.done"), (True, "response.completed")]
    superseded = next(e["event"]["response"] for e in events if e["type"] == "response.event"
                      and e["delegation_id"] != second and e["event"]["type"] == "response.completed")
    assert superseded["status"] == "cancelled" and superseded["incomplete_details"] == {"reason": "superseded"}
    completed = events[-1]["event"]["response"]
    assert completed["status"] == "completed" and completed["output"][0]["content"][0]["text"] == "Paris."
    assert completed["id"] == created[1]["delegation"]["response_id"]


def test_responses_delegation_refuses_a_delegation_id_and_takes_context_for_the_llm():
    rig = Rig()
    rig.start(delegation={"type": "responses", "responses": {"model": "scripted"}})
    err = rig.error(type="session.commentary.append", delegation_id="deleg_x", content="hi")
    assert (err.code, err.param) == ("invalid_value", "delegation_id")
    rig.send(type="session.thinking.append", delegation_id=None, content="The user is  a premium customer.",
             event_id="t1")
    (ack,) = rig.events()
    assert ack["type"] == "session.thinking.appended" and ack["client_event_id"] == "t1"
    assert rig.of(AddContext)[-1] == AddContext("context", "The user is a premium customer.")
    err = rig.error(type="session.thinking.append", delegation_id=None, content="word " * (MAX_CONTENT_TOKENS + 1))
    assert err.code == "string_above_max_length"
    err = rig.error(type="session.thinking.append", content="no delegation_id key")
    assert (err.code, err.param) == ("missing_required_parameter", "delegation_id")


def test_client_delegation_commentary_goes_to_its_delegation():
    rig = Rig()
    rig.start()
    assert rig.of(act.Delegate) == [act.Delegate()]
    rig.mapping.delegated("deleg_1")
    (created,) = rig.events()
    assert created["delegation"] == {"id": "deleg_1", "type": "delegation", "target": "client"}
    rig.send(type="session.commentary.append", delegation_id="deleg_1", content=" Zebras  sing. ")
    rig.send(type="session.commentary.append", delegation_id=None, content="In Oslo.")
    assert rig.of(act.Commentary) == [act.Commentary("deleg_1", "Zebras sing."), act.Commentary(None, "In Oslo.")]
    assert rig.types() == ["session.commentary.appended"] * 2
    err = rig.error(type="session.commentary.append", delegation_id="deleg_unknown", content="x")
    assert (err.code, err.param) == ("invalid_value", "delegation_id")
    rig.mapping.on_session(attempt("started", 1), rig.now)  # the client's own delegations announce themselves
    assert rig.events() == []


def test_instructions_append_extends_the_prompt_and_update_changes_delegation_settings_only():
    rig = Rig()
    rig.start(delegation={"type": "responses", "responses": {"model": "scripted", "instructions": "Be exact."}})
    rig.calls.clear()
    rig.send(type="session.instructions.append", delegation_id=None, content="Answer in French.")
    assert rig.types() == ["session.instructions.appended"]
    assert rig.of(Configure) == [Configure(None, "Be exact.\n\nAnswer in French.")]
    rig.send(type="session.update", session={"delegation": {"type": "responses", "acknowledgement_delay_ms": 300,
                                                            "responses": {"model": "other"}}})
    (updated,) = rig.events()
    assert updated["session"]["delegation"]["acknowledgement_delay_ms"] == 300
    assert rig.of(Configure)[-1] == Configure("other", "Be exact.\n\nAnswer in French.")
    err = rig.error(type="session.update", session={"delegation": {"type": "client"}})
    assert (err.code, err.param) == ("invalid_value", "session.delegation.type")
    err = rig.error(type="session.update", session={"instructions": "new"})
    assert (err.code, err.param) == ("unknown_parameter", "session.instructions")  # immutable after startup


def test_unsupported_events_are_refused_and_the_session_goes_on():
    rig = Rig()
    rig.start(delegation={"type": "responses", "responses": {"model": "scripted"}})
    for event in ({"type": "session.output_audio.fixture.play", "fixture": {"id": "f"}},):
        err = rig.error(**event)
        assert err.code in ("unsupported_event", "missing_required_parameter", "unknown_parameter")
    rig.send(type="session.input_audio.mute")
    assert rig.types() == ["session.input_audio.muted"]


def test_silence_is_fed_when_the_client_falls_behind_and_usage_is_reported_on_the_clock():
    rig = Rig(usage_interval_s=15.0)
    rig.start()
    assert rig.mapping.wake_at() == pytest.approx(START + 0.3)
    rig.time(0.3)
    for _ in range(10):
        rig.time(0.08)
    fed = rig.of(PushAudio)
    assert len(fed) == 11 and not any(c.pcm.any() for c in fed)
    rig.time(14.0 - 1.1 + 1.0)  # a stall: at most 3 frames at once, the rest skipped
    assert len(rig.of(PushAudio)) == 14
    (usage,) = [e for e in rig.events() if e["type"] == "session.usage.updated"]
    assert usage["usage"] == {"seconds": 15.0}


def test_close_sends_the_final_snapshot_and_usage_then_finishes():
    rig = Rig()
    rig.start()
    rig.now += 42.7
    rig.send(type="session.close", event_id="c1")
    (closed,) = rig.events()
    assert closed["reason"] == "close_requested" and closed["usage"] == {"seconds": 42.0}
    assert closed["client_event_id"] == "c1" and closed["session"]["id"] == "s1"
    assert rig.of(act.Finish) == [act.Finish(1000, "close_requested")]
    assert rig.error(type="session.input_audio.mute").code == "session_closed"
    assert rig.mapping.wake_at() is None


def test_an_engine_failure_is_an_error_then_session_closed():
    rig = Rig()
    rig.start()
    rig.mapping.on_session(SessionFailed("engine", "the engine failed"), rig.now)
    error, closed = rig.events()
    assert error["error"]["type"] == "server_error" and closed["reason"] == "connection_lost"
    assert rig.of(act.Finish)


def test_kame_events_only_when_asked():
    plain, opted = Rig(), Rig(events=True)
    for rig in (plain, opted):
        rig.start(delegation={"type": "responses", "responses": {"model": "scripted"}})
        rig.mapping.on_session(attempt("started", 1, user_text="hi"), rig.now)
    assert not [t for t in plain.types() if t.startswith("kame.")]
    assert "kame.llm" in opted.types()


def test_webrtc_sessions_carry_audio_on_the_track_not_in_events():
    rig = Rig(transport="webrtc")
    err = rig.error(type="session.start", session={"model": "m"})
    assert err.code == "session_not_started"  # the POST starts a WebRTC session, never the channel
    from openai.types.live import SessionConfig

    rig.mapping.start(SessionConfig(model="gpt-live-1"), rig.now)
    (started,) = rig.events()
    assert "format" not in started["session"]["audio"]
    rig.mapping.on_session(AssistantAudio(0, NOISE, True, 0.01), rig.now)
    assert rig.events() == [] and len(rig.of(act.Play)) == 1
    assert rig.error(type="session.input_audio.append", audio="AAAA").code == "invalid_request"



def test_a_sideband_replay_leads_with_the_sessions_snapshot_however_old():
    import asyncio

    from server.live.adapter import REPLAY_EVENTS, LiveCarrier

    async def carrier_of(mapping) -> LiveCarrier:  # it is built on the session's loop
        return LiveCarrier(bare_runner(None), tandem=None, mapping=mapping)

    carrier = asyncio.run(carrier_of(Rig().mapping))
    carrier._reflect({"type": "session.started", "event_id": "e1"})
    assert carrier.replayed() == [{"type": "session.started", "event_id": "e1"}]
    for n in range(REPLAY_EVENTS):
        carrier._reflect({"type": "session.output_transcript.delta", "event_id": f"d{n}"})
    replay = carrier.replayed()
    assert replay[0]["type"] == "session.started" and len(replay) == REPLAY_EVENTS + 1
    carrier._reflect({"type": "session.input_audio.append", "audio": ""}, True)  # audio is never replayed
    assert carrier.replayed()[-1]["event_id"] == f"d{REPLAY_EVENTS - 1}"


def test_a_pause_without_a_final_sends_the_words_once_and_closes_nothing():
    """A pause in mid-question: the ASR keeps the utterance open (partials only), the clock runs on; the
    user's words go out once, in order, and the session neither ends nor errs in the pause."""
    rig = Rig()
    rig.start()
    for text, end in (("how many legs", 1.2), ("how many legs does a", 1.6), ("how many legs does a", 2.4)):
        rig.mapping.on_session(Transcript(False, text, 0.5, end, 0.1), rig.now)
    for _ in range(25):  # two seconds of pause
        rig.mapping.on_session(AssistantAudio(0, NOISE, True, 0.01), rig.now)
        rig.time(0.08)
    paused = rig.events()
    assert {e["type"] for e in paused} <= {"session.input_transcript.delta", "session.output_audio.delta"}
    rig.mapping.on_session(Transcript(False, "how many legs does a spider have", 0.5, 4.0, 0.1), rig.now)
    rig.mapping.on_session(Transcript(True, "How many legs does a spider have?", 0.5, 4.4, 0.1), rig.now)
    deltas = [e["delta"] for e in paused + rig.events() if e["type"] == "session.input_transcript.delta"]
    assert " ".join("".join(deltas).split()).lower() == "how many legs does a spider have?"
    assert deltas.count(" ") >= 5  # through the pause, spaces kept the client's user turn open


def test_the_assistants_silence_goes_out_as_zeros_after_a_second_without_a_word():
    """GPT-Live's silence is digital (server/live/silence.py): with `zero_silence_s`, a front-end that has said
    no word for that long sends zeros (the first such frame faded out), and its next word opens the gate."""
    rig = Rig(zero_silence_s=1.0)
    rig.start()
    noise = np.full(1920, 0.05, np.float32)

    def sent(frame: int) -> np.ndarray:
        rig.mapping.on_session(AssistantAudio(frame, noise, True, 0.1), rig.now)
        (delta,) = [e for e in rig.events() if e["type"] == "session.output_audio.delta"]
        return np.frombuffer(base64.b64decode(delta["delta"]), "<i2") / 32767

    assert not sent(1).any()  # nothing said yet: silence
    rig.mapping.on_session(AssistantText(2, " Hello"), rig.now)
    rig.events()
    spoken = [sent(frame) for frame in range(2, 2 + 13)]  # 13 frames: 1.04 s from the word
    assert all(np.allclose(pcm, 0.05, atol=1e-3) for pcm in spoken)
    fading = sent(15)
    assert fading[0] > 0.04 and abs(fading[-1]) < 1e-3 and np.all(np.diff(fading) <= 1e-4)
    assert not sent(16).any() and not sent(40).any()
    rig.mapping.on_session(AssistantText(41, " again"), rig.now)
    rig.events()
    assert np.allclose(sent(41), 0.05, atol=1e-3)


def test_without_zero_silence_the_front_ends_audio_goes_out_as_made():
    rig = Rig()
    rig.start()
    rig.mapping.on_session(AssistantAudio(1, np.full(1920, 0.05, np.float32), True, 0.1), rig.now)
    (delta,) = [e for e in rig.events() if e["type"] == "session.output_audio.delta"]
    assert np.allclose(np.frombuffer(base64.b64decode(delta["delta"]), "<i2") / 32767, 0.05, atol=1e-3)
