"""What every tool is: a spec the LLM sees (name, description, JSON schema of its arguments), and
`call(arguments) -> result`. `run_tool` runs one call within the tool's limits and never raises:
a failure, a timeout or a bad argument becomes an error *result* for the LLM, the session goes on.

A tool's output is data for the LLM, never an instruction to the server: nothing here acts on it.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

from kame.errors import KameError

TRUNCATED = "\n[... truncated: the result was {total} characters, only the first {kept} are shown]"


class ToolError(KameError):
    """A tool that cannot be built (config) or a call that failed (its message goes to the LLM)."""


TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what the Chat Completions API accepts (fullmatch)


@dataclass(frozen=True)
class ToolLimits:
    timeout_s: float = 5.0  # a call running longer is answered with an error (and cancelled; a sync
    # python callable cannot be: it keeps a thread of its pool until it returns, kame/tools/python_tool.py)
    max_result_chars: int = 4000  # a longer result is cut, with a marker that says so


DEFAULT_LIMITS = ToolLimits()


@dataclass(frozen=True)
class ToolSpec:
    name: str  # ^[A-Za-z0-9_-]{1,64}$, what the LLM calls
    description: str
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})  # JSON schema

    def openai(self) -> dict:
        """The Chat Completions `tools` entry."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    """One call the LLM made: `arguments` is the JSON text it streamed."""

    id: str
    name: str
    arguments: str = "{}"

    def parsed(self) -> dict:
        try:
            value = json.loads(self.arguments or "{}")
        except json.JSONDecodeError as exc:
            raise ToolError(f"the arguments are not valid JSON ({exc.msg})") from exc
        if not isinstance(value, dict):
            raise ToolError("the arguments must be a JSON object")
        return value

    @property
    def key(self) -> tuple[str, str]:
        """Name and arguments, normalised: identical calls have equal keys (the per-turn cache)."""
        try:
            return self.name, json.dumps(self.parsed(), sort_keys=True, separators=(",", ":"))
        except ToolError:
            return self.name, self.arguments


@dataclass(frozen=True)
class ToolResult:
    call: ToolCall
    content: str  # what goes back to the LLM as the `tool` message
    ok: bool
    elapsed_s: float
    error: str | None = None
    truncated: bool = False
    cached: bool = False  # served from the turn's cache, the tool was not called again


class Tool(Protocol):
    spec: ToolSpec
    limits: ToolLimits

    async def call(self, arguments: dict) -> Any:
        """Run the tool; the result is a string or anything JSON can write. Raise to fail."""


@dataclass(frozen=True)
class ToolContext:
    """The call a tool is running for, and the LLM attempt that made it: what a tool whose call leaves
    the server (a client's function) tells the client. Read inside `Tool.call` as `CURRENT.get()`."""

    call: ToolCall
    epoch: int | None = None  # the planner's attempt (None outside one)


CURRENT: ContextVar[ToolContext | None] = ContextVar("kame_tool_call", default=None)
ATTEMPT: ContextVar[int | None] = ContextVar("kame_tool_attempt", default=None)  # set by the planner's round


def as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def truncate(text: str, limit: int) -> tuple[str, bool]:
    if len(text) <= limit:
        return text, False
    return text[:limit] + TRUNCATED.format(total=len(text), kept=limit), True


async def run_tool(tool: Tool | None, call: ToolCall) -> ToolResult:
    """One call within the tool's limits. Only cancellation propagates; every failure is a result."""
    started = time.monotonic()

    def failed(message: str) -> ToolResult:
        return ToolResult(call, f"error: {message}", False, time.monotonic() - started, message)

    if tool is None:
        return failed(f"there is no tool named {call.name!r}")
    try:
        arguments = call.parsed()
        CURRENT.set(ToolContext(call, ATTEMPT.get()))  # this task's own context: the call's alone
        value = await asyncio.wait_for(tool.call(arguments), tool.limits.timeout_s)
    except TimeoutError:
        return failed(f"the tool {call.name} did not answer within {tool.limits.timeout_s:g} s")
    except ToolError as exc:
        return failed(str(exc))
    except Exception as exc:  # the tool's own bug or failure: the LLM is told, the session goes on
        return failed(f"{type(exc).__name__}: {exc}")
    text, cut = truncate(as_text(value), tool.limits.max_result_chars)
    return ToolResult(call, text, True, time.monotonic() - started, truncated=cut)
