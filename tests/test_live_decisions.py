"""GPT-Live's Decisions: Decisions delegation (each delegation's questions evaluated, sent as decision.event),
transcript triggers, decision.create and the Decision items, on the mapping (no socket); the questions answered
by an LLM in the Decision API's shape (kame/backend/decide.py); and end to end through the openai SDK against
the scripted LLM. Every server event is checked by the SDK's types."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.types.decision import Decision

from kame.backend.decide import Question, answer_of, decide
from kame.commands import Configure
from kame.session_events import AssistantText, Transcript
from kame.testing.fakes import FakeLLM, FakeReply
from server.live import actions as act

from .test_live_mapping import Rig

PREDICATE = {"type": "predicate", "name": "asks_capital", "instructions": "Does the user ask for a capital?"}
CHOICE = {"type": "choice", "name": "topic", "instructions": "What is the topic?",
          "choices": [{"value": "geography"}, {"value": "weather", "description": "rain, sun"}, {"value": False}]}
SCORE = {"type": "score", "name": "urgency", "instructions": "How urgent is it?",
         "levels": [{"label": "low"}, {"label": "high"}]}
QUESTIONS = [PREDICATE, CHOICE, SCORE]


def decisions(**extra) -> dict:
    return {"type": "decisions", "decisions": {"model": "scripted", "questions": QUESTIONS}, **extra}


def trigger(event_type: str = "session.input_transcript.delta", questions=(PREDICATE,)) -> dict:
    return {"type": "decisions", "event_type": event_type, "decisions": {"questions": list(questions)}}


def test_decisions_delegation_evaluates_each_delegations_questions():
    rig = Rig()
    started = rig.start(delegation=decisions())
    assert started["session"]["delegation"]["type"] == "decisions"
    assert started["session"]["delegation"]["acknowledgement_delay_ms"] == 400  # the protocol's default here
    assert rig.of(act.Delegate)  # the client's commentary is what the voice says, as in client delegation
    rig.mapping.delegated("deleg_1")
    (created,) = rig.events()
    assert created["delegation"]["target"] == "decisions"
    (asked,) = rig.of(act.Decide)
    assert asked.delegation_id == "deleg_1" and [q.name for q in asked.questions] == ["asks_capital", "topic",
                                                                                    "urgency"]
    decision = {"answers": [{"type": "predicate", "name": "asks_capital", "probability": 0.8}], "model": "m",
                "usage": {"input_tokens": 1, "input_tokens_details": {"cache_write_tokens": 0, "cached_tokens": 0},
                          "output_tokens": 1, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 2}}
    rig.mapping.decided(asked, decision)
    (event,) = rig.events()
    assert event["type"] == "decision.event" and event["delegation_id"] == "deleg_1"
    assert event["event"] == {"type": "decision.completed", "decision": decision}
    rig.mapping.decided(asked, None, "the backend is down")
    (error,) = rig.events()
    assert error["error"]["code"] == "decision_failed"  # the session goes on


def test_triggers_fire_on_their_transcript_deltas_only():
    rig = Rig()
    rig.start(triggers=[trigger()])
    rig.mapping.on_session(Transcript(False, "what is the capital", 0.0, 1.0, 0.1), rig.now)
    rig.mapping.on_session(Transcript(True, "what is the capital of France", 0.0, 1.5, 0.1), rig.now)
    rig.mapping.on_session(AssistantText(3, " Paris"), rig.now)  # an output delta: no trigger on its type
    deltas = [e for e in rig.events() if e["type"] == "session.input_transcript.delta"]
    fired = rig.of(act.Decide)
    assert len(fired) == len(deltas) >= 1
    assert [f.source_event_id for f in fired] == [d["event_id"] for d in deltas]
    assert all(f.source_event_type == "session.input_transcript.delta" and f.trigger_id for f in fired)
    rig.send(type="session.update", session={"triggers": []})
    rig.mapping.on_session(Transcript(True, "and Spain", 2.0, 3.0, 0.1), rig.now)
    assert len(rig.of(act.Decide)) == len(fired)  # [] turns them off


def test_two_triggers_on_one_event_type_are_refused():
    rig = Rig()
    err = rig.error(type="session.start", session={"model": "gpt-live-1", "triggers": [trigger(), trigger()]})
    assert err.param == "session.triggers[1].event_type"


def test_decision_create_items_and_their_deletion():
    rig = Rig()
    rig.start(delegation=decisions())
    rig.send(type="decision.item.create", event_id="i1", item={"type": "message", "role": "user",
                                                               "content": "The caller is in Lyon."})
    (created,) = rig.events()
    item_id = created["item"]["id"]
    assert created["client_event_id"] == "i1" and created["item"]["content"] == "The caller is in Lyon."
    rig.send(type="decision.create", event_id="d1")
    (asked,) = rig.of(act.Decide)
    assert asked.client_event_id == "d1" and asked.inputs == ("user: The caller is in Lyon.",)
    assert rig.error(type="decision.create", event_id="d1").code == "invalid_value"  # an event_id once a session
    rig.send(type="decision.item.delete", item_id=item_id, event_id="x1")
    (deleted,) = rig.events()
    assert deleted["type"] == "decision.item.deleted" and deleted["item_id"] == item_id
    assert rig.error(type="decision.item.delete", item_id=item_id).code == "invalid_value"
    rig.send(type="decision.create", event_id="d2")
    assert rig.of(act.Decide)[-1].inputs == ()


def test_decision_create_needs_questions():
    rig = Rig()
    rig.start()
    assert rig.error(type="decision.create", event_id="d1").code == "invalid_request"


def test_a_new_decisions_model_moves_the_decisions_and_leaves_the_voice_to_the_client():
    """Decisions delegation's model is the profile that answers the questions; the planner's LLM stays the
    client's stand-in (its commentary is what the voice says), so a session.update of the model configures
    no backend."""
    rig = Rig()
    rig.start(delegation=decisions())
    rig.send(type="decision.create", event_id="d1")
    assert rig.of(act.Decide)[-1].profile == "scripted"
    rig.calls.clear()
    rig.send(type="session.update", session={"delegation": {"type": "decisions", "decisions": {"model": "gpt-4.1"}}})
    (updated,) = rig.events()
    assert updated["session"]["delegation"]["decisions"]["model"] == "gpt-4.1"
    assert rig.of(Configure) == []
    rig.send(type="decision.create", event_id="d2")
    assert rig.of(act.Decide)[-1].profile == "other"


def test_a_decisions_model_no_profile_serves_is_named_in_the_info():
    rig = Rig()
    rig.start(delegation={"type": "decisions", "decisions": {"model": "gpt-5-nano", "questions": [PREDICATE]}})
    (info,) = rig.rest
    assert info["code"] == "delegation_model_substituted" and "'gpt-5-nano'" in info["message"]
    rig.send(type="session.update",
             session={"delegation": {"type": "decisions", "decisions": {"questions": QUESTIONS}}})
    assert rig.types() == ["session.updated"]  # the model did not change: no second info
    rig.send(type="session.update", session={"delegation": {"type": "decisions", "decisions": {"model": "o9"}}})
    updated, info = rig.events()
    assert info["type"] == "info" and "'o9'" in info["message"]


def test_a_trigger_judges_words_one_evaluation_at_a_time_the_newest_next():
    """Output deltas of only spaces or line breaks judge nothing; deltas that come while the trigger's
    evaluation runs wait, and when it ends the newest of them is evaluated (one LLM call at a time, not one
    per sub-word piece)."""
    rig = Rig()
    rig.start(triggers=[trigger("session.output_transcript.delta")])
    for frame, piece in enumerate([" ", "\n", " Par", "is", " is", " the"]):
        rig.mapping.on_session(AssistantText(frame, piece), rig.now)
    deltas = [e for e in rig.events() if e["type"] == "session.output_transcript.delta"]
    assert len(deltas) == 6
    (first,) = rig.of(act.Decide)
    assert first.source_event_id == deltas[2]["event_id"]
    rig.mapping.decided(first, None, "down")
    assert rig.types() == ["error"]
    first, second = rig.of(act.Decide)
    assert second.source_event_id == deltas[5]["event_id"] and second.trigger_id != first.trigger_id
    rig.mapping.on_session(AssistantText(6, " of"), rig.now)  # waits for the second
    rig.send(type="session.update", session={"triggers": []})
    rig.mapping.on_session(AssistantText(7, " capital"), rig.now)
    rig.mapping.decided(second, None, "down")
    assert len(rig.of(act.Decide)) == 2  # the triggers are gone: what waited for them is not evaluated


def test_a_decision_that_ends_after_the_close_says_nothing():
    rig = Rig()
    rig.start(delegation=decisions())
    rig.send(type="decision.create", event_id="d1")
    (asked,) = rig.of(act.Decide)
    rig.send(type="session.close", event_id="c1")
    assert "session.closed" in rig.types()
    rig.mapping.decided(asked, None, "cancelled")
    assert rig.events() == []


def test_json_and_refusal_parts_are_read_as_text():
    rig = Rig()
    rig.start(delegation=decisions())
    rig.send(type="decision.item.create", item={"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "Caller data:"}, {"type": "input_json", "data": {"city": "Lyon"}}]})
    rig.send(type="decision.item.create", item={"type": "message", "role": "assistant", "content": [
        {"type": "refusal", "refusal": "I cannot share that."}]})
    rig.send(type="decision.create", event_id="d1")
    assert rig.of(act.Decide)[-1].inputs == ('user: Caller data: {"city": "Lyon"}',
                                              "assistant: I cannot share that.")
    question = Question.of({**PREDICATE, "instructions": [{"type": "input_text", "text": "Is the city"},
                                                          {"type": "input_json", "data": ["Lyon", "Paris"]}]})
    assert question.instructions == 'Is the city ["Lyon", "Paris"]'


def test_an_evaluation_that_breaks_is_an_error_and_the_close_cancels_those_still_running():
    """Through the adapter's carrier: an LLM client failing outside LLMError (a bug, an odd reply) ends its
    decision in an error event, the session going on; a decision still being made when the carrier closes is
    cancelled, and says nothing after."""
    from types import SimpleNamespace

    from openai.types.live import SessionConfig

    from kame.clock import ManualClock
    from kame.session import TandemSession
    from server.live.adapter import LiveCarrier
    from server.live.config import LiveFacts
    from server.live.mapping import LiveMapping
    from tests.mapping_rig import bare_runner, sent

    asked = asyncio.Event()

    class Broken:
        structured_output = False

        async def stream_chat(self, messages, **options):
            raise RuntimeError("not an LLMError")
            yield

    class Hanging:
        structured_output = False

        async def stream_chat(self, messages, **options):
            asked.set()
            await asyncio.Event().wait()
            yield

    llms = {"scripted": Broken()}

    class Tandem:
        backend, conversation = "scripted", []
        runtime = SimpleNamespace(llm=lambda profile: llms[profile], profile_named=lambda name: name,
                                  profiles={"scripted": SimpleNamespace(model="scripted-model")})

        def configure(self, backend=None, system_prompt=None):
            pass

        def use_llm(self, llm):
            pass

        apply = TandemSession.apply

    async def go():
        clock = ManualClock()
        mapping = LiveMapping(LiveFacts("s1", {"scripted": "scripted-model"}, "scripted", "Be brief.", 1 << 20, 0))
        runner = bare_runner(clock)
        carrier = LiveCarrier(runner, Tandem(), mapping)
        mapping.start(SessionConfig.model_validate({"model": "gpt-live-1", "delegation": decisions()}), clock.now())
        carrier.carry_out()
        await carrier.on_message(json.dumps({"type": "decision.create", "event_id": "d1"}))
        for _ in range(5):
            await asyncio.sleep(0)
        failed = sent(runner)
        llms["scripted"] = Hanging()
        await carrier.on_message(json.dumps({"type": "decision.create", "event_id": "d2"}))
        await asyncio.wait_for(asked.wait(), 5)
        await carrier.aclose()
        for _ in range(5):
            await asyncio.sleep(0)
        return failed, sent(runner), carrier._tasks

    failed, after, running = asyncio.run(go())
    (error,) = [e for e in failed if e["type"] == "error"]
    assert error["error"]["code"] == "decision_failed" and error["error"]["client_event_id"] == "d1"
    assert [e for e in after if e["type"] in ("decision.event", "error")] == [] and not running


@pytest.mark.parametrize(("event", "code", "param"), [
    ({"type": "session.start", "session": {"model": "gpt-live-1", "delegation": {
        "type": "decisions", "decisions": {"model": "scripted", "questions": [{"type": "predicate"}]}}}},
     "missing_required_parameter", "session.delegation.decisions.questions[0].instructions"),
    ({"type": "session.start", "session": {"model": "gpt-live-1", "delegation": {
        "type": "decisions", "decisions": {"questions": [{**CHOICE, "choices": [{"value": [1]}]}]}}}},
     "invalid_value", "session.delegation.decisions.questions[0].choices[0].value"),
    ({"type": "decision.item.create", "item": {"type": "function_call", "name": "f"}},
     "missing_required_parameter", "item.arguments"),
    ({"type": "decision.item.create", "item": {"role": "user", "content": [5]}}, "invalid_value", "item.content[0]"),
    ({"type": "session.start", "session": {"model": "gpt-live-1", "delegation": {
        "type": "decisions", "decisions": {"model": "scripted", "questions": [{**PREDICATE, "type": "predicat"}]}}}},
     "invalid_value", "session.delegation.decisions.questions[0].type"),
])
def test_a_bad_question_or_item_is_named_where_it_is_wrong(event, code, param):
    """The error names the member the client's own `type` (or a message's `role`) picked, not the first
    member of the union that pydantic tried."""
    rig = Rig()
    if event["type"] != "session.start":
        rig.start(delegation=decisions())
    err = rig.error(**event)
    assert (err.code, err.param) == (code, param)


# ---------------------------------------------------------------- the questions, answered


def test_answers_take_the_decision_apis_shape_and_bad_ones_are_refusals():
    questions = [Question.of(q) for q in QUESTIONS]
    reply = json.dumps({"answers": [{"index": 0, "answer": True, "confidence": 0.9},
                                    {"index": 1, "answer": "weather", "confidence": 0.7},
                                    {"index": 2, "answer": "extreme", "confidence": 0.5}]})
    llm = FakeLLM([FakeReply((reply[:10], reply[10:]))])
    decision = asyncio.run(decide(llm, "model-x", questions, ["user: will it rain?"], ["user: in Lyon"]))
    Decision.model_validate(decision)  # the SDK's own type
    predicate, choice, score = decision["answers"]
    assert predicate == {"type": "predicate", "name": "asks_capital", "probability": 0.9}
    assert choice["choice"] == "weather" and choice["confidence"] == 0.7
    assert {p["value"]: p["probability"] for p in choice["probabilities"]} == {"geography": 0.15, "weather": 0.7,
                                                                             False: 0.15}
    assert score == {"type": "refusal", "name": "urgency"}  # not one of its levels
    asked = llm.calls[0][-1].content
    assert "user: will it rain?" in asked and "user: in Lyon" in asked and '"weather" = rain, sun' in asked


@pytest.mark.parametrize("reply", ['{"answers": 5}', '{"answers": true}', '{"answers": {"0": true}}',
                                   '{"answers": [{"index": true, "answer": true, "confidence": 1}]}'])
def test_answers_of_the_wrong_shape_are_refusals(reply):
    decision = asyncio.run(decide(FakeLLM([FakeReply((reply,))]), "m", [Question.of(PREDICATE)], [], []))
    assert decision["answers"] == [{"type": "refusal", "name": "asks_capital"}]


def test_a_score_and_typed_choice_values():
    score = Question.of(SCORE)
    assert answer_of(score, {"answer": "high", "confidence": 1})["score"] == 2.0
    assert answer_of(Question.of(CHOICE), {"answer": "false", "confidence": 1})["type"] == "refusal"  # not False
    assert answer_of(Question.of(CHOICE), {"answer": False, "confidence": 1})["choice"] is False
    assert answer_of(Question.of(PREDICATE), {"answer": "yes"})["type"] == "refusal"


# ---------------------------------------------------------------- end to end: the openai SDK as the client


@pytest.mark.slow
def test_decisions_through_the_sdk(tandem_server, scripted_llm):
    """decision.create answered by the scripted LLM (structured output asked for), a trigger firing on the
    front-end's words (the output transcript: the client's commentary, said), and the delegation that commentary
    opened evaluated too."""
    from .test_live import LIVE_EVENT, sdk
    from .test_realtime import Events

    url, _ = tandem_server
    before = len(scripted_llm.requests)

    async def go():
        async with sdk(url).live.connect() as conn:
            events = Events(conn, LIVE_EVENT)
            await conn.session.start(session={"model": "gpt-live-1", "delegation": decisions(), "triggers": [
                trigger("session.output_transcript.delta", (CHOICE,))]})
            await events.type("session.started")
            await conn.decision.item.create(item={"role": "user", "content": "We talk about France."},
                                            event_id="item")
            await events.type("decision.item.created")
            await conn.decision.create(event_id="now")
            asked = await events.wait_for(lambda e: e["type"] == "decision.event" and e.get("client_event_id") ==
                                          "now", 20, "the decision.create's decision")
            # the voice says the client's words here (tiny-copy: its oracle); no delegation open: one starts
            await conn.session.commentary.append(delegation_id=None, content="Paris is lovely in spring.")
            fired = await events.wait_for(lambda e: e["type"] == "decision.event" and e.get("trigger_id"), 30,
                                          "a trigger's decision on the front-end's words")
            delegated = await events.wait_for(lambda e: e["type"] == "decision.event" and e.get("delegation_id"),
                                              20, "the delegation's decision")
            events.close()
            return asked, fired, delegated, events

    asked, fired, delegated, events = asyncio.run(go())
    predicate, choice, score = asked["event"]["decision"]["answers"]
    assert predicate["probability"] == 0.8  # "france" was among the inputs
    assert choice["choice"] == "geography" and score["score"] == 2.0
    assert fired["source_event_type"] == "session.output_transcript.delta" and fired["delegation_id"] is None
    created = events.of("session.delegation.created")
    assert created[0]["delegation"]["target"] == "decisions"
    assert delegated["delegation_id"] == created[0]["delegation"]["id"]
    assert any(e["event_id"] == fired["source_event_id"] for e in events.of("session.output_transcript.delta"))
    requests = scripted_llm.requests[before:]
    assert any(r.get("response_format", {}).get("type") == "json_schema" for r in requests)
    assert not events.of("error")


def test_an_unanswered_delegation_is_acknowledged_after_the_delay_unless_the_client_speaks():
    rig = Rig()
    rig.start(delegation=decisions(acknowledgement_delay_ms=500))
    rig.mapping.delegated("deleg_1")
    rig.events()
    assert rig.mapping.wake_at() <= rig.now + 0.5
    rig.time(0.3)
    assert rig.of(act.Commentary) == []
    rig.time(0.3)
    assert [(c.delegation_id, c.text) for c in rig.of(act.Commentary)] == [("deleg_1", "One moment.")]
    rig.mapping.delegated("deleg_2")
    rig.send(type="session.thinking.append", delegation_id=None, content="Looking it up.")
    rig.time(1.0)
    assert len(rig.of(act.Commentary)) == 1  # thinking cancelled deleg_2's acknowledgement
