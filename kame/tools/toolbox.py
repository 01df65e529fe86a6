"""A session's tools: the server's, plus its own (a Realtime client's functions, `search_knowledge`),
and the per-turn cache of calls.

Within one user turn, an identical call (same name, same normalised arguments) is served from the
cache, so that the planner's restarts on a growing partial transcript do not call a tool again and
again; a call still running is shared, not repeated. A call is cancelled once no attempt has
waited for it for `orphan_grace_s` (every attempt that asked for it was cancelled by a newer
one, and no newer one asked for it again meanwhile); a cancelled call leaves nothing in the
cache. The grace matters: a newer attempt that takes the oracle cancels the older ones at its
first words ("let me check"), before its own round has reached the same call; without it, each
restart would cancel the call and start it again (measured: docs/benchmarks.md, "Tool calls").
A new user turn starts an empty cache. A tool marked `shared = False` (a GPT-Live client's function, whose
client is shown and answers every call) is never cached: each call runs, and ends with its attempt.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kame.tools.base import Tool, ToolCall, ToolResult, ToolSpec, run_tool


@dataclass
class _Shared:
    task: asyncio.Task
    waiters: int = 0


@dataclass
class ToolBox:
    tools: dict[str, Tool] = field(default_factory=dict)
    spawn: Callable[..., asyncio.Task] | None = None  # how call tasks start (the session's TaskGroup)
    calls_made: int = 0  # tool calls really run (not served from the cache)
    orphan_grace_s: float = 1.5  # a call no attempt waits for is cancelled after this long (0: at once)
    _turn: int = -1
    _cache: dict[tuple[str, str], _Shared] = field(default_factory=dict)
    _running: set[asyncio.Task] = field(default_factory=set)  # every call not yet done, of any turn

    @classmethod
    def of(cls, *sources: Mapping[str, Tool] | Iterable[Tool], spawn=None, orphan_grace_s: float = 1.5) -> ToolBox:
        box = cls(spawn=spawn, orphan_grace_s=orphan_grace_s)
        for source in sources:
            for tool in source.values() if isinstance(source, Mapping) else source:
                box.tools[tool.spec.name] = tool
        return box

    def add(self, tool: Tool) -> None:
        self.tools[tool.spec.name] = tool

    def set_client_tools(self, tools: Iterable[Tool]) -> list[str]:
        """Replace the client's tools (those marked `client`) with `tools`. The server's own tools
        stay and win: a client tool named like one is left out. Returns the names left out."""
        for name in [name for name, tool in self.tools.items() if getattr(tool, "client", False)]:
            del self.tools[name]
        clashes = []
        for tool in tools:
            if tool.spec.name in self.tools:
                clashes.append(tool.spec.name)
            else:
                self.tools[tool.spec.name] = tool
        return clashes

    def remove(self, name: str) -> None:
        self.tools.pop(name, None)

    @property
    def specs(self) -> list[ToolSpec]:
        return [tool.spec for tool in self.tools.values()]

    def __bool__(self) -> bool:
        return bool(self.tools)

    def _start(self, call: ToolCall) -> asyncio.Task:
        self.calls_made += 1
        coro = run_tool(self.tools.get(call.name), call)
        name = f"tool-{call.name}-{call.id}"
        task = self.spawn(coro, name) if self.spawn else asyncio.get_running_loop().create_task(coro, name=name)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return task

    async def run(self, call: ToolCall, turn: int) -> ToolResult:
        """The result of `call` in user turn `turn`: from the cache, or by running the tool."""
        if turn != self._turn:
            self._turn, self._cache = turn, {}
        if not getattr(self.tools.get(call.name), "shared", True):  # its own run, cancelled with its attempt
            return await self._start(call)
        key = call.key
        shared = self._cache.get(key)
        cached = shared is not None
        if shared is None or (shared.task.done() and shared.task.cancelled()):
            shared = self._cache[key] = _Shared(self._start(call))
            cached = False
        shared.waiters += 1
        try:
            result = await asyncio.shield(shared.task)
        except asyncio.CancelledError:
            shared.waiters -= 1
            if shared.waiters == 0 and not shared.task.done():
                if self.orphan_grace_s <= 0:
                    self._drop_orphan(key, shared)
                else:
                    asyncio.get_running_loop().call_later(self.orphan_grace_s, self._drop_orphan, key, shared)
            raise
        shared.waiters -= 1
        return dataclasses.replace(result, call=call, cached=cached) if cached else result

    async def aclose(self) -> None:
        """Cancel every call still running (the session ends)."""
        tasks = [task for task in self._running if not task.done()]  # earlier turns' calls too
        self._cache = {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _drop_orphan(self, key: tuple[str, str], shared: _Shared) -> None:
        """Cancel a call nobody waits for (unless an attempt asked for it again meanwhile)."""
        if shared.waiters == 0 and not shared.task.done():
            shared.task.cancel()
            if self._cache.get(key) is shared:
                del self._cache[key]
