"""A real HTTP server on loopback that speaks the OpenAI chat-completions streaming protocol
(SSE `chat.completion.chunk`), scripted per request: delays, HTTP errors, cuts, stalls, garbage,
and tool calls (`delta.tool_calls`, their arguments split across several chunks, finish_reason
"tool_calls"). Every request body is kept (`requests`), so a test can check what came back to it.

Use it as the LLM in tests and in the offline demo, through the real `openai` client.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web


@dataclass(frozen=True)
class ScriptedToolCall:
    """A tool call the scripted model makes: `arguments` is sent as JSON, in pieces of a few characters."""

    name: str
    arguments: dict | str = field(default_factory=dict)  # a str is sent as it is (malformed JSON, say)
    id: str = ""  # "": call_<index>

    def arguments_json(self) -> str:
        return self.arguments if isinstance(self.arguments, str) else json.dumps(self.arguments)


@dataclass(frozen=True)
class ScriptedReply:
    text: str = "The capital of France is Paris."
    first_token_delay_s: float = 0.0  # request received -> first chunk
    token_delay_s: float = 0.0  # between chunks
    status: int = 200  # != 200: answer with this HTTP error instead
    retry_after: str | None = None  # Retry-After header of an error
    cut_after: int | None = None  # drop the connection after this many chunks
    stall_after: int | None = None  # stop sending (connection kept open) after this many chunks
    malformed_after: int | None = None  # send a broken SSE data line after this many chunks
    tool_calls: tuple[ScriptedToolCall, ...] = ()  # after the text: these calls, finish_reason "tool_calls"

    def chunks(self) -> list[str]:
        """The text in small pieces that split words, as real LLM streams do."""
        return re.findall(r"\s*\S{1,4}", self.text)


Script = Callable[[dict], ScriptedReply]


class ScriptedOpenAIServer:
    def __init__(self, replies: list[ScriptedReply] | Script | None = None,
                 default: ScriptedReply = ScriptedReply(), list_models: bool = True) -> None:
        """`list_models`: also serve GET /v1/models (as vLLM, llama.cpp, Ollama and OpenAI do)."""
        self.list_models = list_models
        if callable(replies):
            self._script: Script = replies
        else:
            queue = deque(replies or [])
            self._script = lambda body: queue.popleft() if queue else default
        self.requests: list[dict] = []  # JSON bodies received, in order
        self.received_at: list[float] = []  # time.monotonic() of each request
        self.headers: list[dict] = []
        self._runner: web.AppRunner | None = None
        self.port = 0
        self._thread: threading.Thread | None = None
        self._thread_loop: asyncio.AbstractEventLoop | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._completions)
        if self.list_models:
            app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self.base_url

    async def _models(self, request: web.Request) -> web.Response:
        self.headers.append(dict(request.headers))
        return web.json_response({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> ScriptedOpenAIServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # for code that runs its own loop (a server under test): the fake gets a thread of its own
    def start_in_thread(self) -> str:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)  # gather() of no pending task at the end asks for it
            self._thread_loop = loop
            loop.run_until_complete(self.start())
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self.stop())
            pending = asyncio.all_tasks(loop)  # e.g. a scripted stall still sleeping
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

        self._thread = threading.Thread(target=run, name="scripted-openai", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self.base_url

    def stop_thread(self) -> None:
        if self._thread_loop is not None and self._thread is not None:
            self._thread_loop.call_soon_threadsafe(self._thread_loop.stop)
            self._thread.join(10)
            self._thread = None

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._answer(request)
        except ConnectionResetError:  # the client cancelled its stream (a newer attempt took over)
            return web.Response(status=499)

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received_at.append(time.monotonic())
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        reply = self._script(body)
        if reply.status != 200:
            headers = {"Retry-After": reply.retry_after} if reply.retry_after else {}
            error = {"error": {"message": f"scripted HTTP {reply.status}", "type": "scripted", "code": None}}
            return web.json_response(error, status=reply.status, headers=headers)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await asyncio.sleep(reply.first_token_delay_s)
        model = body.get("model", "scripted")
        for index, piece in enumerate(reply.chunks()):
            if index == reply.cut_after:
                request.transport.close()
                return response
            if index == reply.stall_after:
                await asyncio.sleep(3600)
            if index == reply.malformed_after:
                await response.write(b"data: {this is not json\n\n")
            if index:
                await asyncio.sleep(reply.token_delay_s)
            await response.write(_sse(model, {"role": "assistant", "content": piece} if index == 0 else
                                      {"content": piece}))
        for index, call in enumerate(reply.tool_calls):
            for delta in _tool_call_deltas(index, call):
                await asyncio.sleep(reply.token_delay_s)
                await response.write(_sse(model, {"tool_calls": [delta]}))
        await response.write(_sse(model, {}, finish="tool_calls" if reply.tool_calls else "stop"))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _sse(model: str, delta: dict, finish: str | None = None) -> bytes:
    chunk = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": 0, "model": model,
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(chunk)}\n\n".encode()


def _tool_call_deltas(index: int, call: ScriptedToolCall) -> list[dict]:
    """The chunks of one streamed tool call, as OpenAI sends them: the first names it (id, type,
    function name, empty arguments), the next ones carry the arguments a few characters at a time."""
    deltas = [{"index": index, "id": call.id or f"call_{index}", "type": "function",
               "function": {"name": call.name, "arguments": ""}}]
    text = call.arguments_json()
    deltas += [{"index": index, "function": {"arguments": text[i:i + 5]}} for i in range(0, len(text), 5)]
    return deltas


def last_tool_results(body: dict) -> list[dict]:
    """The `tool` messages at the end of a request (what the tools answered the previous turn), in order."""
    results = []
    for message in reversed(body.get("messages", [])):
        if message.get("role") != "tool":
            break
        results.insert(0, message)
    return results


def faulty_script(seed: int = 0) -> Script:
    """A flaky upstream for soak tests: random 500, 429 with Retry-After, cuts, stalls, garbage,
    and now and then a good answer."""
    rng = random.Random(seed)
    faults = [ScriptedReply(status=500), ScriptedReply(status=429, retry_after="1"), ScriptedReply(cut_after=2),
              ScriptedReply(stall_after=1), ScriptedReply(malformed_after=1), ScriptedReply(text="Fine, thanks.")]
    return lambda body: rng.choice(faults)
