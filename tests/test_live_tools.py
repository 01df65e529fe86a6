"""GPT-Live's client function tools under Responses delegation, on the mapping (no socket, no session): the
tools reach the backend, a round's calls come out as the response's function_call items and the response
completes; one `response.item.create` per call and one `response.create` hand the outputs back (a partial
batch is refused), the attempt goes on in a response of its own; a call nobody answers times out with an
error, a superseded attempt's calls end quietly. Every server event is checked by the SDK's types."""

from __future__ import annotations

import pytest

from kame.commands import AddContext, RequestAttempt
from kame.session_events import LLMAttempt, ToolRound
from server.live import actions as act

from .test_live_mapping import Rig

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"type": "function", "name": "get_time", "description": "The time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def responses(**extra) -> dict:
    return {"type": "responses", "responses": {"model": "scripted", "tools": [WEATHER, TIME], **extra}}


def attempt(phase: str, epoch: int = 1, **kw) -> LLMAttempt:
    return LLMAttempt(phase, epoch, "scripted", "partial", **kw)


def started_with_a_round(rig: Rig, calls=(("call_1", "get_weather", '{"city": "Paris"}'),), epoch: int = 1):
    rig.mapping.on_session(attempt("started", epoch), rig.now)
    rig.events()
    rig.mapping.on_session(ToolRound(epoch, tuple(calls)), rig.now)
    return rig.events()


def inner(events: list[dict]) -> list[dict]:
    return [e["event"] for e in events if e["type"] == "response.event"]


def output(call_id: str, text: str) -> dict:
    return {"type": "response.item.create", "item": {"type": "function_call_output", "call_id": call_id,
                                                     "output": text}}


def test_the_tools_and_the_choice_go_to_the_backend():
    rig = Rig()
    rig.start(delegation=responses(tool_choice={"type": "function", "name": "get_weather"}))
    (tools,) = rig.of(act.ClientTools)
    assert [spec.name for spec in tools.specs] == ["get_weather", "get_time"]
    assert tools.specs[0].parameters == WEATHER["parameters"]
    assert tools.tool_choice == {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(("tool", "code", "param"), [
    ({"type": "web_search"}, "unsupported_parameter", "session.delegation.responses.tools[0].type"),
    ({"type": "function", "name": "bad name!"}, "invalid_value", "session.delegation.responses.tools[0].name"),
])
def test_tools_that_cannot_run_here_are_refused_by_name(tool, code, param):
    rig = Rig()
    err = rig.error(type="session.start", session={"model": "gpt-live-1", "delegation": {
        "type": "responses", "responses": {"model": "scripted", "tools": [tool]}}})
    assert (err.code, err.param) == (code, param)


def test_a_round_of_client_calls_comes_out_as_items_and_the_response_completes():
    rig = Rig()
    rig.start(delegation=responses())
    events = started_with_a_round(rig, [("call_1", "get_weather", '{"city": "Paris"}'),
                                        ("call_s", "search_knowledge", "{}"),  # the server's: not the client's
                                        ("call_2", "get_time", '{"city": "Oslo"}')])
    kinds = [e["type"] for e in inner(events)]
    assert kinds == ["response.output_item.added", "response.function_call_arguments.done",
                     "response.output_item.done"] * 2 + ["response.completed"]
    done = [e["item"] for e in inner(events) if e["type"] == "response.output_item.done"]
    assert [(i["call_id"], i["name"], i["arguments"], i["status"]) for i in done] == [
        ("call_1", "get_weather", '{"city": "Paris"}', "completed"), ("call_2", "get_time", '{"city": "Oslo"}',
                                                                      "completed")]
    assert len({e["delegation_id"] for e in events}) == 1


def test_outputs_go_back_as_one_batch_and_the_attempt_goes_on_in_a_new_response():
    rig = Rig()
    rig.start(delegation=responses())
    first = started_with_a_round(rig, [("call_1", "get_weather", "{}"), ("call_2", "get_time", "{}")])
    rig.send(**output("call_1", "sunny"))
    err = rig.error(type="response.create", event_id="early")
    assert err.code == "function_call_outputs_required" and "call_2" in str(err)
    assert rig.of(act.AnswerCall) == []
    rig.send(**output("call_2", "noon"))
    rig.send(type="response.create")
    assert [(a.call_id, a.output) for a in rig.of(act.AnswerCall)] == [("call_1", "sunny"), ("call_2", "noon")]
    (created,) = inner(rig.events())
    assert created["type"] == "response.created"
    completed_before = [e for e in inner(first) if e["type"] == "response.completed"][0]
    assert created["response"]["id"] != completed_before["response"]["id"]
    rig.mapping.on_session(attempt("done", answer="Sunny in Paris at noon."), rig.now)
    done = inner(rig.events())
    assert done[-1]["type"] == "response.completed" and done[-1]["response"]["id"] == created["response"]["id"]


def test_a_newer_attempts_round_that_crossed_the_response_create_waits_for_its_outputs():
    """KAME's planner starts a newer attempt while the client answers an older one: the newer round's items
    may cross the client's `response.create` on the wire (seen in CI with LiveKit's GPTLiveModel, which sends
    it once every call it has seen is answered). The older round goes on and the newer waits, no error."""
    rig = Rig()
    rig.start(delegation=responses())
    started_with_a_round(rig, [("call_1", "get_weather", '{"city": "Paris"}')], epoch=1)
    started_with_a_round(rig, [("call_2", "get_weather", '{"city": "Paris"}')], epoch=2)
    rig.send(**output("call_1", "sunny"))
    rig.send(type="response.create")
    assert [e["type"] for e in rig.events() if e["type"] == "error"] == []
    assert [a.call_id for a in rig.of(act.AnswerCall)] == ["call_1"]
    rig.send(**output("call_2", "sunny"))
    rig.send(type="response.create")
    assert [a.call_id for a in rig.of(act.AnswerCall)] == ["call_1", "call_2"]


def test_a_late_output_with_a_newer_round_unseen_is_no_error():
    """The older attempt was superseded (its call ended quietly) and a newer one called the tool again: the
    client's late output and its `response.create` are taken quietly, the newer call waits for its own."""
    rig = Rig()
    rig.start(delegation=responses())
    started_with_a_round(rig, [("call_1", "get_weather", '{"city": "Paris"}')], epoch=1)
    rig.mapping.on_session(attempt("cancelled", epoch=1), rig.now)
    rig.mapping.call_ended("call_1", "cancelled")
    started_with_a_round(rig, [("call_2", "get_weather", '{"city": "Paris"}')], epoch=2)
    rig.send(**output("call_1", "sunny"))
    rig.send(type="response.create")
    assert rig.events() == [] and rig.of(act.AnswerCall) == rig.of(RequestAttempt) == []
    rig.send(**output("call_2", "sunny"))
    rig.send(type="response.create")
    assert [a.call_id for a in rig.of(act.AnswerCall)] == ["call_2"]
    assert [e["type"] for e in inner(rig.events())] == ["response.created"]


def test_an_output_whose_attempt_ended_before_the_response_create_is_no_error():
    """The client answered, then the attempt was superseded before its `response.create` came, while a newer
    round it has not seen waits: the `response.create` is taken quietly, as for a late output."""
    rig = Rig()
    rig.start(delegation=responses())
    started_with_a_round(rig, [("call_1", "get_weather", "{}")], epoch=1)
    rig.send(**output("call_1", "sunny"))
    rig.mapping.on_session(attempt("cancelled", epoch=1), rig.now)
    rig.mapping.call_ended("call_1", "cancelled")
    started_with_a_round(rig, [("call_2", "get_weather", "{}")], epoch=2)
    rig.send(type="response.create")
    assert rig.events() == [] and rig.of(act.AnswerCall) == []


def test_a_whole_round_goes_on_while_another_is_partly_answered():
    """A client that sends each output as its tool finishes and one `response.create` per response (Pipecat):
    the whole round goes on, the partial one waits for the rest (refusing both once stalled the whole one)."""
    rig = Rig()
    rig.start(delegation=responses())
    started_with_a_round(rig, [("call_1", "get_weather", "{}")], epoch=1)
    started_with_a_round(rig, [("call_2", "get_weather", "{}"), ("call_3", "get_time", "{}")], epoch=2)
    rig.send(**output("call_2", "rain"))
    rig.send(**output("call_1", "sunny"))
    rig.send(type="response.create")
    assert [e["type"] for e in rig.events() if e["type"] == "error"] == []
    assert [a.call_id for a in rig.of(act.AnswerCall)] == ["call_1"]
    err = rig.error(type="response.create")  # continues nothing: call_3 is still missing
    assert err.code == "function_call_outputs_required" and "call_3" in str(err) and "call_2" not in str(err)
    rig.send(**output("call_3", "noon"))
    rig.send(type="response.create")
    assert [a.call_id for a in rig.of(act.AnswerCall)] == ["call_1", "call_2", "call_3"]


def test_an_output_for_no_call_or_twice_is_an_error_and_the_session_goes_on():
    rig = Rig()
    rig.start(delegation=responses())
    started_with_a_round(rig)
    assert rig.error(**output("call_nope", "x")).code == "invalid_value"
    rig.send(**output("call_1", "sunny"))
    assert rig.error(**output("call_1", "again")).code == "invalid_value"
    rig.send(type="response.create")
    assert [a.call_id for a in rig.of(act.AnswerCall)] == ["call_1"]


def test_a_call_nobody_answers_times_out_with_an_error_and_the_attempt_goes_on():
    rig = Rig()
    rig.start(delegation=responses())
    started_with_a_round(rig)
    rig.mapping.call_ended("call_1", "timeout")
    events = rig.events()
    assert events[0]["type"] == "error" and events[0]["error"]["code"] == "function_call_output_timeout"
    assert [e["type"] for e in inner(events)] == ["response.created"]
    rig.send(**output("call_1", "too late"))  # taken quietly: no error
    rig.send(type="response.create")  # nothing waits, but an output just came: not a new response either
    assert rig.events() == [] and rig.of(AddContext) == rig.of(RequestAttempt) == []


def test_a_superseded_attempts_calls_end_quietly():
    rig = Rig()
    rig.start(delegation=responses())
    started_with_a_round(rig)
    rig.mapping.on_session(attempt("cancelled"), rig.now)
    assert rig.events() == []  # its response completed already, with its calls
    rig.mapping.call_ended("call_1", "cancelled")
    rig.send(**output("call_1", "late"))
    assert rig.events() == []


def test_response_create_with_nothing_waiting_asks_the_backend_for_a_response():
    rig = Rig()
    rig.start(delegation=responses())
    rig.send(type="response.item.create", item={"type": "message", "role": "user",
                                                "content": [{"type": "input_text", "text": "And tomorrow?"}]})
    rig.send(type="response.create")
    assert rig.of(AddContext | RequestAttempt) == [
        AddContext("user", "And tomorrow?"), RequestAttempt()]


def test_response_events_need_responses_delegation():
    rig = Rig()
    rig.start(delegation={"type": "client"})
    err = rig.error(type="response.create")
    assert err.code == "invalid_request"


# ---------------------------------------------------------------- end to end: the openai SDK as the client


@pytest.mark.slow
def test_a_client_function_tool_runs_through_the_sdk_and_its_result_is_spoken(tandem_server, scripted_llm):
    """The SDK asks (a typed user message and response.create, as an agent would), the backend calls the
    client's get_weather, the client answers through response.item.create and response.create, and the
    front-end (tiny-copy: it says its oracle) says the LLM's answer made from the tool's output."""
    import asyncio

    from .test_live import LIVE_EVENT, said, sdk
    from .test_realtime import Events

    url, _ = tandem_server
    before = len(scripted_llm.requests)

    async def go():
        async with sdk(url).live.connect() as conn:
            events = Events(conn, LIVE_EVENT)
            await conn.session.start(session={"model": "gpt-live-1", "delegation": {
                "type": "responses", "responses": {"model": "scripted", "tools": [WEATHER]}}})
            await events.type("session.started")
            await conn.response.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "What is the weather in Paris today?"}]})
            await conn.response.create()
            done = await events.wait_for(lambda e: e["type"] == "response.event" and e["event"]["type"] ==
                                         "response.output_item.done", 20, "the function call")
            item = done["event"]["item"]
            await conn.response.item.create(item={"type": "function_call_output", "call_id": item["call_id"],
                                                  "output": "sunny and 24 degrees"})
            await conn.response.create(event_id="go-on")
            await events.wait_for(lambda e: "degrees" in said(events, "session.output_transcript.delta"), 25,
                                  "the tool's result in the output transcript")
            events.close()
            return item, events

    item, events = asyncio.run(go())
    assert (item["name"], item["arguments"]) == ("get_weather", '{"city": "Paris"}')
    requests = scripted_llm.requests[before:]
    offered = [r for r in requests if any(t["function"]["name"] == "get_weather" for t in r.get("tools") or ())]
    assert offered, "the backend LLM was never offered the client's tool"
    assert any(m["role"] == "tool" and m["content"] == "sunny and 24 degrees" for r in requests
               for m in r["messages"])
    assert {"sunny", "degrees"} <= set(said(events, "session.output_transcript.delta"))
    assert not events.of("error")
