"""A function the client runs: the backend LLM calls it, the call goes over the transport to the client
(a Realtime client's functions, a GPT-Live client's function tools), and the client's output is the result."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from kame.tools.base import CURRENT, ToolContext, ToolLimits, ToolSpec

# how a transport sends a call and waits for its output, at most its own timeout (then a ToolError the LLM
# reads): (the call and its attempt, name, arguments) -> the client's output
SendCall = Callable[[ToolContext | None, str, dict], Awaitable[str]]
BACKSTOP_S = 1.0  # run_tool's own limit comes this much after the transport's: the client's silence is its to say


class ClientTool:
    """One of the client's functions as the planner's tool: `call` sends it through `send`."""

    client = True  # ToolBox.set_client_tools replaces these; the server's own tools stay

    def __init__(self, spec: ToolSpec, limits: ToolLimits, send: SendCall, shared: bool = True) -> None:
        """`shared`: an identical call in the same user turn is served from the first (the per-turn cache),
        where the transport announces a call to the client only once it is sent (Realtime); False where
        the client is shown every call of a round as it is made and answers each (GPT-Live's Responses
        delegation), so each call waits for its own output."""
        self.spec, self._send, self.shared = spec, send, shared
        self.limits = ToolLimits(limits.timeout_s + BACKSTOP_S, limits.max_result_chars)

    async def call(self, arguments: dict) -> str:
        return await self._send(CURRENT.get(), self.spec.name, arguments)
