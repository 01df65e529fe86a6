"""Tools and knowledge end to end on the real server: tiny-copy (its text repeats its oracle), real
Whisper on synthesised questions, a scripted OpenAI-compatible LLM that calls tools."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from client.client import KameClient
from kame.testing import tools as testing_tools
from kame.testing.openai_server import ScriptedOpenAIServer, ScriptedReply, ScriptedToolCall, last_tool_results

from .server_harness import (
    Recording,
    audio_accounted_for,
    record,
    running_server,
    stream_realtime,
    wait_until,
    wait_until_all_slots_free,
)

pytestmark = pytest.mark.slow

DOCUMENT = ("# The sky of Kelp Harbour\n\nThe sky over Kelp Harbour looks blue by day because the harbour fog "
            "scatters blue light, which the locals call the kelp glow.\n")
FROM_THE_NOTES = "Locals call it the kelp glow"
WITHOUT_NOTES = "Sunlight scatters off the air"


def script(body: dict) -> ScriptedReply:
    """Calls a tool by topic; answers from a tool's result, or from the knowledge in its system message."""
    messages = body["messages"]
    results = last_tool_results(body)
    if results:
        content = results[0]["content"]
        if content.startswith("error:"):
            return ScriptedReply(text="The lookup failed, sorry.")
        return ScriptedReply(text=f"The tool says {content}.")
    line = messages[-1]["content"].split("\n")[-1].lower()
    offered = [tool["function"]["name"] for tool in body.get("tools", [])]
    if "lookup_author" in offered and ("hamlet" in line or "wrote" in line):
        return ScriptedReply(tool_calls=(ScriptedToolCall("lookup_author", {"play": "Hamlet"}),))
    if "legs" in line or "spider" in line:
        return ScriptedReply(text="Let me check.", tool_calls=(ScriptedToolCall("legs", {"animal": "spider"}),))
    if "hamlet" in line or "wrote" in line:
        return ScriptedReply(tool_calls=(ScriptedToolCall("explode", {"reason": "on purpose"}),))
    if "france" in line:  # says a few words first: this attempt takes the oracle and cancels the older ones
        return ScriptedReply(text="Let me look that up.", tool_calls=(ScriptedToolCall("slow", {"seconds": 2.0}),))
    if "what" in line:  # "what is the capital ...": unfinished, a long lookup, cancelled once France is heard
        return ScriptedReply(tool_calls=(ScriptedToolCall("ponder", {"seconds": 10.0}),))
    if "sky" in line:
        known = "kelp glow" in messages[0]["content"]
        return ScriptedReply(text=(FROM_THE_NOTES if known else WITHOUT_NOTES) + ".")
    return ScriptedReply(text="Let me think.")


TOOLS = {
    "legs": {"kind": "python", "callable": "kame.testing.tools:legs"},
    "explode": {"kind": "python", "callable": "kame.testing.tools:explode"},
    "slow": {"kind": "python", "callable": "kame.testing.tools:slow", "timeout_s": 0.5},
    "ponder": {"kind": "python", "callable": "kame.testing.tools:ponder", "timeout_s": 15.0},
}


@pytest.fixture(scope="module")
def tool_llm():
    server = ScriptedOpenAIServer(script)
    server.start_in_thread()
    yield server
    server.stop_thread()


def _profiles(llm):
    from server.settings import ProfileSettings

    return {"scripted": ProfileSettings(base_url=llm.base_url, model="scripted", api_key_env=None)}


@pytest.fixture(scope="module")
def tools_server(tool_llm, tmp_path_factory):
    notes = tmp_path_factory.mktemp("notes")
    (notes / "sky.md").write_text(DOCUMENT)
    recordings = tmp_path_factory.mktemp("recordings")
    with running_server(asr="whisper", max_sessions=4, profiles=_profiles(tool_llm), llm="scripted", tools=TOOLS,
                        knowledge_dir=str(notes), record_dir=recordings) as (url, services):
        yield url, services, recordings


async def converse(url: str, turns: list[tuple[np.ndarray, str]], max_after_s: float = 25.0) -> Recording:
    """Ask each question in turn in one session (speech, then real-time silence until that question's
    final transcript came and the assistant said the expected words since the question began)."""
    client = await KameClient.connect(url + "/api/chat")
    got = Recording()
    receiver = asyncio.create_task(record(client, got))
    try:
        await _speak(client, got, turns, max_after_s)
    finally:  # a failing check must not leave the session holding its slot
        await client.close()
        await receiver
    return got


async def _speak(client: KameClient, got: Recording, turns: list[tuple[np.ndarray, str]], max_after_s: float) -> None:
    silence = np.zeros(1920, np.float32)
    sent = 0
    for index, (pcm, until) in enumerate(turns):
        question = np.concatenate([np.zeros(7200, np.float32), pcm])
        # counted before the question is sent: the answer may begin while it is still being spoken
        # (a partial transcript starts an attempt), and words of it said by then count as said after it
        said_before = len(got.text_stream)
        await stream_realtime(client, question)
        sent += len(question)
        for _ in range(int(max_after_s / 0.08)):
            finals = sum(e.final for e in got.of("transcript"))
            if finals > index and until in got.text_stream[said_before:]:
                break
            await stream_realtime(client, silence)
            sent += len(silence)
        for _ in range(12):  # a little more: the answer's last events
            await stream_realtime(client, silence)
            sent += len(silence)
    # a loaded machine only makes it wait longer
    await wait_until(lambda: audio_accounted_for(got, sent), "the audio of the last frames sent", 30.0)


def test_a_spoken_question_is_answered_through_a_python_tool(tools_server, voices):
    url, services, recordings = tools_server
    wait_until_all_slots_free(services)
    testing_tools.LEG_CALLS.clear()
    got = asyncio.run(converse(url, [(voices["spider"], "spiders have eight legs")]))

    assert "spiders have eight legs" in got.text_stream  # the tool's result, spoken by the front-end
    assert "Let me check" in got.text_stream  # what the model said before the call is spoken too
    tool_events = got.of("tool")
    done = [e for e in tool_events if e.phase == "done" and e.name == "legs"]
    assert done and done[0].result == "spiders have eight legs"
    assert json.loads(done[0].arguments) == {"animal": "spider"}
    finals = sum(e.final for e in got.of("transcript"))
    assert 1 <= len(testing_tools.LEG_CALLS) <= finals  # at most one run per user turn ...
    assert len(done) > len(testing_tools.LEG_CALLS) and any(e.cached for e in done)  # ... restarts got the cache
    health = services.health()
    assert health["tools"] == [*TOOLS, "search_knowledge"] and health["knowledge"]
    metrics = services.metrics.render().decode()
    runs = float(len(testing_tools.LEG_CALLS))
    assert f'kame_tool_calls_total{{outcome="done",tool="legs"}} {runs}' in metrics
    assert f'kame_tool_call_seconds_count{{tool="legs"}} {runs}' in metrics
    assert 'kame_tool_calls_total{outcome="cached",tool="legs"}' in metrics
    lines = [json.loads(line) for folder in recordings.iterdir()
             for line in (folder / "events.jsonl").read_text().splitlines()]
    assert any(line["type"] == "tool" and line["name"] == "legs" and line["phase"] == "done" for line in lines)


def test_a_tool_that_raises_or_times_out_gives_an_error_result_and_the_session_goes_on(tools_server, voices):
    url, services, _ = tools_server
    wait_until_all_slots_free(services)
    testing_tools.PONDERED.clear()
    got = asyncio.run(converse(url, [(voices["hamlet"], "The lookup failed"), (voices["france"], "The lookup failed"),
                                     (voices["spider"], "spiders have eight legs")]))
    failed = {e.name: e for e in got.of("tool") if e.phase == "failed"}
    assert "RuntimeError: the tool broke: on purpose" in failed["explode"].error
    assert "did not answer within 0.5 s" in failed["slow"].error
    assert got.text_stream.count("The lookup failed") >= 2
    assert "spiders have eight legs" in got.text_stream  # the session went on
    assert not [e for e in got.of("error")]
    # a partial before "France" started a long lookup; the attempt on "... of France" took
    # the oracle, cancelled the older attempt, and with it (after its grace) the lookup
    assert testing_tools.PONDERED[:1] == ["started"] and "cancelled" in testing_tools.PONDERED
    assert "done" not in testing_tools.PONDERED
    assert any(e.name == "ponder" and e.phase == "cancelled" for e in got.of("tool"))


def test_a_question_answered_only_by_the_knowledge_base(tools_server, voices, tool_llm):
    url, services, _ = tools_server
    wait_until_all_slots_free(services)
    got = asyncio.run(converse(url, [(voices["sky"], FROM_THE_NOTES)]))
    assert FROM_THE_NOTES in got.text_stream and WITHOUT_NOTES not in got.text_stream
    retrievals = [e for e in got.of("knowledge") if e.passages]
    assert retrievals and retrievals[-1].sources == ["sky.md"] and retrievals[-1].tokens > 0
    systems = [body["messages"][0]["content"] for body in tool_llm.requests if "sky" in body["messages"][-1]["content"]]
    assert any("Reference notes" in s and "kelp glow" in s for s in systems)  # the passage reached the LLM
    assert "search_knowledge" in [t["function"]["name"] for t in tool_llm.requests[-1]["tools"]]


def test_without_knowledge_the_same_question_is_not_answered_from_it(tool_llm, voices, tiny_copy):
    with running_server(asr="whisper", max_sessions=1, profiles=_profiles(tool_llm), llm="scripted") as (url, _):
        got = asyncio.run(converse(url, [(voices["sky"], WITHOUT_NOTES)]))
    assert WITHOUT_NOTES in got.text_stream and FROM_THE_NOTES not in got.text_stream
    assert not got.of("knowledge") and not got.of("tool")


def test_a_realtime_client_declares_a_function_answers_its_call_and_hears_the_result(tools_server, voices):
    from .test_realtime import Events, sdk, stream

    url, services, _ = tools_server
    function = {"type": "function", "name": "lookup_author", "description": "Who wrote a play.",
                "parameters": {"type": "object", "properties": {"play": {"type": "string"}}, "required": ["play"]}}
    answer = "William Shakespeare wrote it around sixteen hundred"

    async def go():
        async with sdk(url).realtime.connect(model="kame") as conn:
            events = Events(conn)  # every GA event is validated against the SDK's own types
            await events.type("session.created")
            await conn.session.update(session={"type": "realtime", "tools": [function], "tool_choice": "auto",
                                               "kame": {"events": True}})
            updated = await events.type("session.updated")
            audio = np.concatenate([np.zeros(12000, np.float32), voices["hamlet"], np.zeros(24000 * 6, np.float32)])
            speaking = asyncio.ensure_future(stream(conn, audio))
            call = await events.type("response.function_call_arguments.done", 25)
            await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call["call_id"],
                                                      "output": answer})
            heard = await events.wait_for(
                lambda e: e["type"] == "response.output_audio_transcript.done" and "sixteen" in e["transcript"],
                25, "the function's result, spoken")
            speaking.cancel()
            events.close()
            return updated, call, heard, events

    updated, call, heard, events = asyncio.run(go())
    assert updated["session"]["tools"] == [function]
    assert call["name"] == "lookup_author" and json.loads(call["arguments"]) == {"play": "Hamlet"}
    added = next(e for e in events.of("response.output_item.added") if e["item"]["type"] == "function_call")
    assert added["item"]["call_id"] == call["call_id"] and added["item"]["name"] == "lookup_author"
    assert "".join(e["delta"] for e in events.of("response.function_call_arguments.delta")
                   if e["call_id"] == call["call_id"]) == call["arguments"]
    done = next(e for e in events.of("response.done") if e["response"]["output"]
                and e["response"]["output"][0]["type"] == "function_call")
    assert done["response"]["status"] == "completed"
    assert any(e["item"]["type"] == "function_call_output" for e in events.of("conversation.item.added"))
    assert answer in heard["transcript"]
    tool_events = [e for e in events.of("kame.tool") if e["name"] == "lookup_author"]
    assert [e["phase"] for e in tool_events][:2] == ["started", "done"] and tool_events[1]["result"] == answer
