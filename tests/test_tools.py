"""Tools: streamed tool-call assembly, the registry's kinds (python with a derived schema, http
against a real local server, the host allow-list), limits, errors as results, the per-turn
cache, cancellation, and the planner's tool-calling loop."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from openai.types.chat.chat_completion_chunk import ChoiceDeltaToolCall, ChoiceDeltaToolCallFunction

from kame.asr.events import FinalTranscript
from kame.backend.llm import OpenAICompatibleLLM, ToolCallAssembler, ToolCalls
from kame.backend.planner import DATA_NOTE, Planner, PlannerConfig
from kame.backend.profiles import BackendProfile
from kame.session_events import ToolCallEvent
from kame.testing.fakes import FakeLLM, FakeReply
from kame.testing.openai_server import ScriptedOpenAIServer, ScriptedReply, ScriptedToolCall, last_tool_results
from kame.tools import ToolBox, ToolCall, ToolError, ToolLimits, ToolSpec, run_tool
from kame.tools.config import HttpToolConfig, PythonToolConfig
from kame.tools.http_tool import HttpTool
from kame.tools.python_tool import PythonTool
from kame.tools.registry import ToolRegistry


def run(coro):
    return asyncio.run(coro)


# ------------------------------------------------------------------ assembly


def test_assembler_joins_arguments_split_across_deltas_by_index():
    assembler = ToolCallAssembler()
    assembler.push([ChoiceDeltaToolCall(index=0, id="call_a", type="function",
                                        function=ChoiceDeltaToolCallFunction(name="order_status", arguments=""))])
    assembler.push([{"index": 1, "id": "call_b", "function": {"name": "tide", "arguments": '{"da'}}])
    for piece in ['{"ord', 'er_id"', ': "A1', '7"}']:
        assembler.push([ChoiceDeltaToolCall(index=0, function=ChoiceDeltaToolCallFunction(arguments=piece))])
    assembler.push([{"index": 1, "function": {"arguments": 'y": "monday"}'}}])
    calls = assembler.calls()
    assert calls == (ToolCall("call_a", "order_status", '{"order_id": "A17"}'),
                     ToolCall("call_b", "tide", '{"day": "monday"}'))
    assert calls[0].parsed() == {"order_id": "A17"}


def test_assembler_splits_calls_sent_without_an_index_by_their_ids():
    """Gemini's OpenAI-compatible endpoint sends each call whole, with an id and no index."""
    assembler = ToolCallAssembler()
    assembler.push([{"id": "c1", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}])
    assembler.push([{"id": "c2", "function": {"name": "get_time", "arguments": '{"tz":"CET"}'}}])
    assert assembler.calls() == (ToolCall("c1", "get_weather", '{"city":"Oslo"}'),
                                 ToolCall("c2", "get_time", '{"tz":"CET"}'))
    pieces = ToolCallAssembler()  # without index and without a new id: the same call goes on
    pieces.push([{"id": "c1", "function": {"name": "tide", "arguments": '{"da'}}])
    pieces.push([{"function": {"arguments": 'y": "monday"}'}}])
    assert pieces.calls() == (ToolCall("c1", "tide", '{"day": "monday"}'),)


def test_assembler_refuses_a_call_without_a_name():
    assembler = ToolCallAssembler()
    assembler.push([{"index": 0, "function": {"arguments": "{}"}}])
    with pytest.raises(ValueError, match="no function name"):
        assembler.calls()


def test_openai_client_streams_text_then_assembled_calls_from_the_scripted_server():
    reply = ScriptedReply(text="Let me check.", tool_calls=(
        ScriptedToolCall("order_status", {"order_id": "A17"}), ScriptedToolCall("tide", {"day": "monday"})))

    async def scenario():
        async with ScriptedOpenAIServer([reply]) as server:
            llm = OpenAICompatibleLLM(BackendProfile("scripted", server.base_url, "m", None))
            spec = ToolSpec("order_status", "status", {"type": "object", "properties": {}})
            items = [item async for item in llm.stream_chat([], tools=[spec])]
            # the last round: the tools listed, none to be called
            [item async for item in llm.stream_chat([], tools=[spec], tool_choice="none")]
            await llm.aclose()
            return items, server.requests

    items, requests = run(scenario())
    assert "".join(i for i in items if isinstance(i, str)) == "Let me check."
    assert items[-1] == ToolCalls((ToolCall("call_0", "order_status", '{"order_id": "A17"}'),
                                   ToolCall("call_1", "tide", '{"day": "monday"}')))
    assert requests[0]["tools"][0]["function"]["name"] == "order_status" and "tool_choice" not in requests[0]
    assert requests[1]["tools"][0]["function"]["name"] == "order_status" and requests[1]["tool_choice"] == "none"


# ------------------------------------------------------------------ python tools


def test_python_tool_schema_is_derived_from_hints_and_docstring():
    tool = PythonTool("convert", "kame.testing.tools:convert")
    assert tool.spec.description == "Convert a distance between kilometres and miles."
    assert tool.spec.parameters == {
        "type": "object", "required": ["amount"],
        "properties": {"amount": {"type": "number", "description": "the distance"},
                       "unit": {"enum": ["km", "mi"], "description": "the unit the amount is in", "default": "km"},
                       "digits": {"type": "integer", "description": "round to this many digits", "default": None}}}
    result = run(run_tool(tool, ToolCall("1", "convert", '{"amount": 10, "digits": 2}')))
    assert result.ok and json.loads(result.content) == {"value": 6.21, "unit": "mi"}


def test_python_sync_tool_runs_and_a_bad_import_is_a_config_error():
    tool = PythonTool("order_status", "kame.testing.tools:order_status")
    assert tool.spec.parameters["required"] == ["order_id"]
    assert run(run_tool(tool, ToolCall("1", "order_status", '{"order_id": "a17"}'))).content.startswith("shipped")
    with pytest.raises(ToolError, match="cannot import"):
        PythonTool("x", "kame.testing.nope:f")
    with pytest.raises(ToolError, match="package.module:function"):
        PythonTool("x", "kame.testing.tools")


def test_failures_timeouts_and_bad_arguments_are_results_never_raised():
    limits = ToolLimits(timeout_s=0.2)
    explode = PythonTool("explode", "kame.testing.tools:explode", limits=limits)
    slow = PythonTool("slow", "kame.testing.tools:slow", limits=limits)

    async def scenario():
        return [await run_tool(explode, ToolCall("1", "explode", '{"reason": "boom"}')),
                await run_tool(slow, ToolCall("2", "slow", '{"seconds": 1.0}')),
                await run_tool(explode, ToolCall("3", "explode", '{"reason": ')),
                await run_tool(explode, ToolCall("4", "explode", '{"nope": 1}')),
                await run_tool(None, ToolCall("5", "ghost", "{}"))]

    failed = run(scenario())
    assert not any(r.ok for r in failed)
    assert "RuntimeError: the tool broke: boom" in failed[0].content
    assert "did not answer within 0.2 s" in failed[1].content
    assert "not valid JSON" in failed[2].content
    assert "bad arguments" in failed[3].content
    assert "no tool named 'ghost'" in failed[4].content
    assert all(r.content.startswith("error: ") for r in failed)


def test_a_long_result_is_truncated_with_a_marker():
    tool = PythonTool("big", lambda: "x" * 5000, "a big result", limits=ToolLimits(max_result_chars=100))
    result = run(run_tool(tool, ToolCall("1", "big", "{}")))
    assert result.ok and result.truncated
    assert result.content.startswith("x" * 100) and "truncated: the result was 5000 characters" in result.content
    assert len(result.content) < 200


def test_sync_tools_that_hang_hold_their_own_pool_not_asyncio_s():
    """A sync call past its timeout keeps its thread (threads cannot be cancelled): on the tools' own
    pool, so asyncio's default pool (the ASR's, the knowledge base's) stays free, and once every
    thread of the tools' pool is held a new sync call is refused at once."""
    import threading
    import time

    from kame.tools import python_tool

    def wait_for_a_free_pool() -> None:  # earlier tests' timed-out sync calls may still hold threads
        deadline, held = time.monotonic() + 10, 0
        while held < python_tool.SYNC_THREADS and time.monotonic() < deadline:
            held += python_tool._busy.acquire(timeout=0.1)
        for _ in range(held):
            python_tool._busy.release()
        assert held == python_tool.SYNC_THREADS, "the sync tools' pool never came free"

    wait_for_a_free_pool()
    release = threading.Event()
    hang = PythonTool("hang", lambda: release.wait(30), "hangs", limits=ToolLimits(timeout_s=0.2))

    async def scenario():
        hung = await asyncio.gather(*(run_tool(hang, ToolCall(str(i), "hang", "{}"))
                                      for i in range(python_tool.SYNC_THREADS)))
        started = time.monotonic()
        refused = await run_tool(hang, ToolCall("x", "hang", "{}"))
        refused_in = time.monotonic() - started
        started = time.monotonic()
        await asyncio.gather(*(asyncio.to_thread(time.sleep, 0.01) for _ in range(16)))
        default_pool_s = time.monotonic() - started
        return hung, refused, refused_in, default_pool_s

    try:
        hung, refused, refused_in, default_pool_s = run(scenario())
    finally:
        release.set()
    assert all(not r.ok and "did not answer within" in r.content for r in hung)
    assert not refused.ok and "busy" in refused.content and refused_in < 0.1
    assert default_pool_s < 1.0  # asyncio's pool was never held by the hung tools
    wait_for_a_free_pool()  # released, the threads come back
    again = run(run_tool(PythonTool("quick", lambda: "ok", "quick"), ToolCall("y", "quick", "{}")))
    assert again.ok and again.content == "ok"


# ------------------------------------------------------------------ http tools


async def loopback(*routes: tuple[str, object]) -> tuple[web.AppRunner, int]:
    """A real aiohttp server on a free loopback port with these GET routes: (its runner, the port)."""
    app = web.Application()
    for path, handler in routes:
        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


@pytest.fixture
def http_endpoint():
    """A real aiohttp server on loopback: /weather/{city} echoes what it got."""
    seen = []

    async def weather(request: web.Request) -> web.Response:
        seen.append({"city": request.match_info["city"], "query": dict(request.query),
                     "auth": request.headers.get("Authorization")})
        if request.match_info["city"] == "Atlantis":
            return web.Response(status=404, text="no such city")
        return web.json_response({"city": request.match_info["city"], "sky": "clear"})

    async def start():
        return await loopback(("/weather/{city}", weather))

    return start, seen


def test_http_tool_fills_the_template_sends_env_headers_and_reports_http_errors(http_endpoint, monkeypatch):
    start, seen = http_endpoint
    monkeypatch.setenv("WEATHER_TOKEN", "Bearer s3cret")

    async def scenario():
        runner, port = await start()
        tool = HttpTool("weather", f"http://127.0.0.1:{port}/weather/{{city}}", ["127.0.0.1"],
                        headers_env={"Authorization": "WEATHER_TOKEN"})
        try:
            good = await run_tool(tool, ToolCall("1", "weather", '{"city": "São Paulo/x", "units": "metric"}'))
            bad = await run_tool(tool, ToolCall("2", "weather", '{"city": "Atlantis"}'))
        finally:
            await runner.cleanup()
        return tool, good, bad

    tool, good, bad = run(scenario())
    assert tool.spec.parameters["required"] == ["city"]
    assert good.ok and json.loads(good.content) == {"city": "São Paulo/x", "sky": "clear"}
    assert seen[0] == {"city": "São Paulo/x", "query": {"units": "metric"}, "auth": "Bearer s3cret"}
    assert not bad.ok and "HTTP 404: no such city" in bad.content


def test_http_tool_reaches_only_allowed_hosts():
    with pytest.raises(ToolError, match="not in allowed_hosts"):
        HttpTool("w", "http://example.org/{q}", ["127.0.0.1"])
    with pytest.raises(ToolError, match="allowed_hosts is empty"):
        HttpTool("w", "http://127.0.0.1/{q}", [])
    tool = HttpTool("w", "http://{host}:1/x", ["127.0.0.1"])  # the host comes from the model: checked per call
    refused = run(run_tool(tool, ToolCall("1", "w", '{"host": "evil.example"}')))
    assert not refused.ok and "not one this tool may reach" in refused.content


def test_an_argument_cannot_climb_the_path_on_an_allowed_host():
    tool = HttpTool("w", "https://api.example.com/v1/users/{id}/profile", ["api.example.com"])
    for value in ("..", "."):
        refused = run(run_tool(tool, ToolCall("1", "w", json.dumps({"id": value}))))
        assert not refused.ok and "may not be '.' or '..'" in refused.content
    url, _ = tool.build_url({"id": "../admin"})  # a slash is quoted: one path segment
    assert url == "https://api.example.com/v1/users/..%2Fadmin/profile"


def test_a_body_sent_in_pieces_is_read_whole_and_a_long_one_cut_with_a_marker():
    async def pieces(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(int(request.query.get("n", "3"))):
            await response.write(b"y" * 1000)
            await asyncio.sleep(0.05)
        return response

    async def scenario():
        runner, port = await loopback(("/pieces", pieces))
        whole = HttpTool("p", f"http://127.0.0.1:{port}/pieces", ["127.0.0.1"])
        cut = HttpTool("p", f"http://127.0.0.1:{port}/pieces", ["127.0.0.1"], limits=ToolLimits(max_result_chars=500))
        try:
            return (await run_tool(whole, ToolCall("1", "p", '{"n": 3}')),
                    await run_tool(cut, ToolCall("2", "p", '{"n": 3}')))
        finally:
            await runner.cleanup()

    whole, cut = run(scenario())
    assert whole.ok and whole.content == "y" * 3000 and not whole.truncated
    assert cut.truncated and cut.content.startswith("y" * 500) and "truncated" in cut.content


def test_a_header_env_var_that_is_not_set_is_an_error_result(monkeypatch):
    monkeypatch.delenv("KAME_TEST_NO_SUCH_VAR", raising=False)
    tool = HttpTool("w", "http://127.0.0.1:1/{q}", ["127.0.0.1"], headers_env={"X-Key": "KAME_TEST_NO_SUCH_VAR"})
    result = run(run_tool(tool, ToolCall("1", "w", '{"q": "a"}')))
    assert not result.ok and "KAME_TEST_NO_SUCH_VAR" in result.content


def test_registry_from_config_and_name_clashes():
    registry = ToolRegistry.from_config({
        "order_status": PythonToolConfig(kind="python", callable="kame.testing.tools:order_status", timeout_s=1.5),
        "weather": HttpToolConfig(kind="http", url="https://api.example.com/w/{city}",
                                  allowed_hosts=["api.example.com"]),
    })
    assert [s.name for s in registry.specs] == ["order_status", "weather"]
    assert registry.get("order_status").limits.timeout_s == 1.5
    with pytest.raises(ToolError, match="two tools are named"):
        registry.add(PythonTool("weather", "kame.testing.tools:order_status"))
    with pytest.raises(ToolError, match="only letters"):
        registry.add(PythonTool("bad name", "kame.testing.tools:order_status"))


# ------------------------------------------------------------------ the per-turn cache, cancellation


class CountingTool:
    def __init__(self, delay_s: float = 0.0) -> None:
        self.spec = ToolSpec("count", "counts its calls")
        self.limits = ToolLimits(timeout_s=5)
        self.delay_s, self.calls, self.cancelled = delay_s, 0, 0

    async def call(self, arguments: dict) -> str:
        self.calls += 1
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return f"call {self.calls} with {arguments}"


def test_identical_calls_in_a_turn_are_served_once_and_a_new_turn_calls_again():
    tool = CountingTool(delay_s=0.05)

    async def scenario():
        box = ToolBox.of([tool])
        a, b = await asyncio.gather(box.run(ToolCall("1", "count", '{"x": 1, "y": 2}'), turn=1),
                                    box.run(ToolCall("2", "count", '{"y": 2, "x": 1}'), turn=1))  # in flight: shared
        c = await box.run(ToolCall("3", "count", '{"x":1,"y":2}'), turn=1)  # done: from the cache
        d = await box.run(ToolCall("4", "count", '{"x": 2}'), turn=1)  # other arguments
        e = await box.run(ToolCall("5", "count", '{"x": 1, "y": 2}'), turn=2)  # a new turn
        return a, b, c, d, e

    a, b, c, d, e = run(scenario())
    assert tool.calls == 3
    assert a.content == b.content == c.content and not a.cached and b.cached and c.cached
    assert c.call.id == "3"  # the result answers the call that asked
    assert not d.cached and not e.cached and e.content.startswith("call 3")


def test_a_tool_not_shared_runs_every_call_and_ends_each_with_its_attempt():
    """GPT-Live's client functions (`shared = False`): the client is shown every call of a round and answers
    each, so each call waits for its own output; cached, a second identical call waited on the first's
    output and the client's answer to it reached nothing (a response that never completed)."""
    tool = CountingTool(delay_s=0.05)
    tool.shared = False

    async def scenario():
        box = ToolBox.of([tool], orphan_grace_s=60)
        a, b = await asyncio.gather(box.run(ToolCall("1", "count", '{"x": 1}'), turn=1),
                                    box.run(ToolCall("2", "count", '{"x": 1}'), turn=1))
        tool.delay_s = 10
        waiter = asyncio.create_task(box.run(ToolCall("3", "count", '{"x": 1}'), turn=1))
        await asyncio.sleep(0.05)
        waiter.cancel()  # its attempt superseded: the call ends now, no grace
        await asyncio.gather(waiter, return_exceptions=True)
        await asyncio.sleep(0.01)
        return a, b

    a, b = run(scenario())
    assert tool.calls == 3 and not a.cached and not b.cached and a.call.id == "1" and b.call.id == "2"
    assert tool.cancelled == 1


def test_cancelling_the_only_waiter_cancels_the_call_and_leaves_no_cache_entry():
    tool = CountingTool(delay_s=10)

    async def scenario():
        box = ToolBox.of([tool], orphan_grace_s=0)
        waiter = asyncio.create_task(box.run(ToolCall("1", "count", "{}"), turn=1))
        await asyncio.sleep(0.05)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        await asyncio.sleep(0.01)
        assert tool.cancelled == 1
        tool.delay_s = 0
        return await box.run(ToolCall("2", "count", "{}"), turn=1)

    again = run(scenario())
    assert not again.cached and tool.calls == 2


def test_an_orphaned_call_is_kept_for_its_grace_then_cancelled():
    tool = CountingTool(delay_s=0.4)

    async def scenario():
        box = ToolBox.of([tool], orphan_grace_s=0.2)
        first = asyncio.create_task(box.run(ToolCall("1", "count", "{}"), turn=1))
        await asyncio.sleep(0.05)
        first.cancel()  # the attempt that asked is cancelled by a newer one ...
        await asyncio.sleep(0.1)
        again = await box.run(ToolCall("2", "count", "{}"), turn=1)  # ... which asks for the same call in time
        assert tool.calls == 1 and tool.cancelled == 0 and again.cached
        tool.delay_s = 10
        lone = asyncio.create_task(box.run(ToolCall("3", "count", '{"n": 2}'), turn=1))
        await asyncio.sleep(0.05)
        lone.cancel()  # nobody asks again: cancelled once the grace is over
        await asyncio.sleep(0.1)
        assert tool.cancelled == 0
        await asyncio.sleep(0.2)
        assert tool.cancelled == 1

    run(scenario())


def test_a_call_another_attempt_still_waits_for_is_not_cancelled():
    tool = CountingTool(delay_s=0.2)

    async def scenario():
        box = ToolBox.of([tool])
        first = asyncio.create_task(box.run(ToolCall("1", "count", "{}"), turn=1))
        second = asyncio.create_task(box.run(ToolCall("2", "count", "{}"), turn=1))
        await asyncio.sleep(0.05)
        first.cancel()
        return await second

    result = run(scenario())
    assert tool.calls == 1 and tool.cancelled == 0 and result.cached


# ------------------------------------------------------------------ the planner's loop


@pytest.fixture
def tok(tiny_copy):
    return tiny_copy.tokenizer


class PlannerRig:
    def __init__(self, tok, replies, tools=(), supports_tools=True, config=None):
        config = config or PlannerConfig()
        self.llm = FakeLLM(replies, supports_tools=supports_tools)
        self.updates, self.events = [], []
        self.planner = Planner(self.llm, tok, self.updates.append, self.events.append, config,
                               tools=ToolBox.of(list(tools)))

    def oracle_text(self) -> str:
        return " ".join(u.text for u in self.updates)

    async def ask(self, text: str, wait_s: float = 2.0) -> None:
        self.planner.on_transcript(FinalTranscript(text, 0.0, 1.0))
        for _ in range(int(wait_s / 0.01)):
            await asyncio.sleep(0.01)
            if not self.planner.running_streams:
                break


def test_planner_runs_the_tool_loop_and_the_final_text_extends_the_oracle(tok):
    order = PythonTool("order_status", "kame.testing.tools:order_status")
    replies = [FakeReply(("Let me check. ",), tool_calls=(ToolCall("c1", "order_status", '{"order_id": "A17"}'),)),
               FakeReply(("It shipped on Monday.",))]

    async def scenario():
        rig = PlannerRig(tok, replies, [order])
        await rig.ask("where is my order A17")
        await rig.planner.aclose()
        return rig

    rig = run(scenario())
    first, second = rig.llm.calls
    assert [t.name for t in rig.llm.tools_offered[0]] == ["order_status"]
    assert DATA_NOTE in first[0].content  # the system message says tool output is data
    assert second[-2].role == "assistant" and second[-2].tool_calls[0].name == "order_status"
    assert second[-1].role == "tool" and second[-1].tool_call_id == "c1"
    assert second[-1].content == "shipped on Monday, arriving Thursday"
    assert rig.oracle_text() == "Let me check. It shipped on Monday."
    calls = [e for e in rig.events if isinstance(e, ToolCallEvent)]
    assert [e.phase for e in calls] == ["started", "done"] and calls[1].result == "shipped on Monday, arriving Thursday"


def test_tool_rounds_are_bounded_and_the_last_round_offers_no_tools(tok):
    order = PythonTool("order_status", "kame.testing.tools:order_status")
    loop = FakeReply((), tool_calls=(ToolCall("c", "order_status", '{"order_id": "B42"}'),))

    async def scenario():
        rig = PlannerRig(tok, [loop, loop, FakeReply(("Still waiting for payment.",))], [order],
                         config=PlannerConfig(max_tool_rounds=2))
        await rig.ask("and order B42")
        await rig.planner.aclose()
        return rig

    rig = run(scenario())
    assert len(rig.llm.calls) == 3
    assert [t is not None for t in rig.llm.tools_offered] == [True, True, False]
    assert rig.oracle_text() == "Still waiting for payment."


def test_a_failing_tool_gives_the_llm_an_error_result_and_the_answer_goes_on(tok):
    explode = PythonTool("explode", "kame.testing.tools:explode")
    replies = [FakeReply((), tool_calls=(ToolCall("c1", "explode", "{}"),)), FakeReply(("Sorry, that failed.",))]

    async def scenario():
        rig = PlannerRig(tok, replies, [explode])
        await rig.ask("break it")
        await rig.planner.aclose()
        return rig

    rig = run(scenario())
    assert rig.llm.calls[1][-1].content.startswith("error: RuntimeError: the tool broke")
    assert rig.oracle_text() == "Sorry, that failed."


def test_an_llm_without_tool_support_gets_no_tools(tok):
    order = PythonTool("order_status", "kame.testing.tools:order_status")

    async def scenario():
        rig = PlannerRig(tok, [FakeReply(("Paris.",))], [order], supports_tools=False)
        await rig.ask("capital of France")
        await rig.planner.aclose()
        return rig

    rig = run(scenario())
    assert rig.llm.tools_offered == [None] and DATA_NOTE not in rig.llm.calls[0][0].content
    assert rig.oracle_text() == "Paris."


def test_a_cancelled_attempt_cancels_its_tool_call(tok):
    tool = CountingTool(delay_s=10)
    replies = [FakeReply((), tool_calls=(ToolCall("c1", "count", "{}"),))]

    async def scenario():
        rig = PlannerRig(tok, replies, [tool])
        rig.planner.on_transcript(FinalTranscript("count please", 0.0, 1.0))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if tool.calls:
                break
        await rig.planner.aclose()
        await asyncio.sleep(0.01)
        return rig

    rig = run(scenario())
    assert tool.calls == 1 and tool.cancelled == 1
    calls = [e for e in rig.events if isinstance(e, ToolCallEvent)]
    assert [e.phase for e in calls] == ["started", "cancelled"] and calls[1].result == ""


def test_scripted_server_gets_the_tool_result_back_as_a_tool_message(tok):
    order = PythonTool("order_status", "kame.testing.tools:order_status")

    def script(body: dict) -> ScriptedReply:
        results = last_tool_results(body)
        if results:
            return ScriptedReply(text=f"Your order is {results[0]['content']}.")
        return ScriptedReply(text="", tool_calls=(ScriptedToolCall("order_status", {"order_id": "A17"}),))

    async def scenario():
        async with ScriptedOpenAIServer(script) as server:
            llm = OpenAICompatibleLLM(BackendProfile("scripted", server.base_url, "m", None))
            updates = []
            planner = Planner(llm, tok, updates.append, tools=ToolBox.of([order]))
            planner.on_transcript(FinalTranscript("where is order A17", 0.0, 1.0))
            for _ in range(300):
                await asyncio.sleep(0.01)
                if not planner.running_streams:
                    break
            await planner.aclose()
            await llm.aclose()
            return server.requests, updates

    requests, updates = run(scenario())
    assert len(requests) == 2
    tool_message = requests[1]["messages"][-1]
    assert tool_message == {"role": "tool", "content": "shipped on Monday, arriving Thursday", "tool_call_id": "call_0"}
    assert requests[1]["messages"][-2]["tool_calls"][0]["function"] == {"name": "order_status",
                                                                         "arguments": '{"order_id": "A17"}'}
    assert " ".join(u.text for u in updates) == \
        "Your order is shipped on Monday, arriving Thursday."


def test_calls_made_in_the_round_that_offered_no_tools_are_not_run(tok):
    tool = CountingTool()
    loop = FakeReply(("Hm.",), tool_calls=(ToolCall("c", "count", "{}"),))

    async def scenario():
        rig = PlannerRig(tok, [loop], [tool], config=PlannerConfig(max_tool_rounds=1))
        await rig.ask("count forever")
        await rig.planner.aclose()
        return rig

    rig = run(scenario())
    assert len(rig.llm.calls) == 2 and tool.calls == 1  # the second round offered none: its call is ignored
    assert rig.llm.tools_offered[1] is None
    # but listed them, with tool_choice "none": endpoints that refuse tool messages without `tools`
    assert rig.llm.tool_choices == [None, "none"]


def test_a_profile_can_turn_tools_off_and_a_broken_index_does_not_end_the_attempt(tok):
    profile = BackendProfile("local", "http://127.0.0.1:1/v1", "m", None, tools=False)
    assert not OpenAICompatibleLLM(profile).supports_tools

    class BrokenIndex:
        def retrieve(self, query, *, limit=4, budget_tokens=400):
            raise RuntimeError("the index is closed")

    async def scenario():
        rig = PlannerRig(tok, [FakeReply(("Paris.",))])
        rig.planner.knowledge = BrokenIndex()
        await rig.ask("capital of France")
        await rig.planner.aclose()
        return rig

    assert run(scenario()).oracle_text() == "Paris."


def test_tool_metrics_label_only_the_server_s_tools_by_name():
    """A name the model made up (or a client's function) is counted as "other": bounded labels."""
    from prometheus_client import generate_latest

    from kame.session_events import ToolCallEvent
    from server.metrics import Metrics, SessionMetrics

    metrics = Metrics()
    observer = SessionMetrics(metrics, frozenset({"legs"}))
    for name in ("legs", "made_up_1", "made_up_2"):
        observer.on_event(ToolCallEvent("done", 0, "c", name, "{}", elapsed_s=0.1))
    text = generate_latest(metrics.registry).decode()
    assert 'kame_tool_calls_total{outcome="done",tool="legs"} 1.0' in text
    assert 'kame_tool_calls_total{outcome="done",tool="other"} 2.0' in text
    assert "made_up" not in text


def test_client_tools_never_replace_the_server_s_and_go_with_the_next_update():
    server_tool = PythonTool("search_knowledge", lambda: "server", "the server's")

    def client_tool(name: str) -> PythonTool:
        tool = PythonTool(name, lambda: "client", "a client's")
        tool.client = True
        return tool

    box = ToolBox.of([server_tool])
    assert box.set_client_tools([client_tool("search_knowledge"), client_tool("weather")]) == ["search_knowledge"]
    assert box.tools["search_knowledge"] is server_tool and "weather" in box.tools
    assert box.set_client_tools([]) == []
    assert list(box.tools) == ["search_knowledge"] and box.tools["search_knowledge"] is server_tool


def test_closing_the_box_cancels_the_calls_of_earlier_turns_too():
    started = []

    async def slow() -> str:
        started.append(1)
        await asyncio.sleep(30)
        return "late"

    async def scenario():
        box = ToolBox.of([PythonTool("slow", slow, "slow", limits=ToolLimits(timeout_s=60))], orphan_grace_s=60)
        first = asyncio.ensure_future(box.run(ToolCall("1", "slow", "{}"), turn=0))
        await asyncio.sleep(0.05)
        first.cancel()  # its attempt went; the call waits out its grace, still running ...
        second = asyncio.ensure_future(box.run(ToolCall("2", "slow", "{}"), turn=1))  # ... into a new turn
        await asyncio.sleep(0.05)
        second.cancel()
        running = [t for t in box._running if not t.done()]
        await asyncio.wait_for(box.aclose(), 2)
        return running

    running = run(scenario())
    assert len(started) == 2 and len(running) == 2
    assert all(task.cancelled() for task in running)
