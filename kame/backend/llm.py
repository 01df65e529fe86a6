"""LLM clients: anything that streams a chat completion as text deltas (`LLMClient`), and the
OpenAI-compatible implementation on the `openai` package (OpenAI, Anthropic, Gemini, vLLM, ...).

A client that can call tools (`supports_tools`) takes `tools=[ToolSpec, ...]` and then yields,
besides text deltas, one `ToolCalls` item at the end of a round: the calls assembled from the
streamed `delta.tool_calls` fragments (arguments arrive split across many chunks)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import httpx2
import openai

from kame.backend.profiles import BackendProfile
from kame.errors import KameError
from kame.tools.base import ToolCall, ToolSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatMessage:
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant message that called tools
    tool_call_id: str | None = None  # a tool message: the call it answers

    def openai(self) -> dict:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in self.tool_calls]
            message["content"] = self.content or None
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


@dataclass(frozen=True)
class ToolCalls:
    """The tool calls one round of a stream ended with (finish_reason "tool_calls")."""

    calls: tuple[ToolCall, ...]


class ToolCallAssembler:
    """Joins streamed `delta.tool_calls` fragments (by `index`: the first names the call, the next
    ones add pieces of its JSON arguments) into whole calls. Fragments without an index (Gemini's
    OpenAI-compatible endpoint) belong to the last call, or start a new one when they bring a new id."""

    def __init__(self) -> None:
        self._parts: dict[int, dict] = {}

    def push(self, fragments: list | None) -> None:
        for fragment in fragments or ():
            get = fragment.get if isinstance(fragment, dict) else lambda key, f=fragment: getattr(f, key, None)
            index = get("index")
            if index is None:  # some endpoints (Gemini's) send each call whole, without an index:
                last = max(self._parts, default=None)  # a new id is a new call, else the last one goes on
                new_id = get("id") and last is not None and self._parts[last]["id"] not in ("", get("id"))
                index = 0 if last is None else last + 1 if new_id else last
            part = self._parts.setdefault(index, {"id": "", "name": "", "arguments": []})
            if get("id"):
                part["id"] = get("id")
            function = get("function")
            if function is not None:
                fget = function.get if isinstance(function, dict) else lambda k, f=function: getattr(f, k, None)
                if fget("name"):
                    part["name"] += fget("name")
                if fget("arguments"):
                    part["arguments"].append(fget("arguments"))

    def __bool__(self) -> bool:
        return bool(self._parts)

    def calls(self) -> tuple[ToolCall, ...]:
        """The assembled calls, in index order (a call without an id gets one)."""
        calls = []
        for index in sorted(self._parts):
            part = self._parts[index]
            if not part["name"]:
                raise ValueError(f"tool call {index} has no function name")
            calls.append(ToolCall(part["id"] or f"call_{index}", part["name"], "".join(part["arguments"]) or "{}"))
        return tuple(calls)


ErrorKind = Literal["connection", "timeout", "auth", "rate_limit", "server", "bad_request", "protocol", "config",
                    "unavailable"]


class LLMError(KameError):
    """One LLM attempt failed; `kind` says how, `retry_after_s` is the server's hint if any."""

    def __init__(self, kind: ErrorKind, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.kind, self.retry_after_s = kind, retry_after_s


class LLMClient(Protocol):
    name: str  # the profile name, for events and metrics

    def stream_chat(self, messages: list[ChatMessage]) -> AsyncIterator[str]:
        """Stream the answer as text deltas; raise LLMError on failure. A client with
        `supports_tools = True` also takes `tools=` (and `tool_choice=`) and may yield `ToolCalls` last."""


def api_key_for(profile: BackendProfile) -> str:
    if not profile.api_key_env:  # None or "": the endpoint takes no key
        return "not-needed"
    key = os.environ.get(profile.api_key_env, "")
    if not key:
        raise LLMError("config", f"backend {profile.name!r} needs an API key in the env var {profile.api_key_env}")
    return key


class OpenAICompatibleLLM:
    """Streams chat completions from an OpenAI-compatible endpoint, with per-phase timeouts."""

    def __init__(self, profile: BackendProfile) -> None:
        self.profile = profile
        self.name = profile.name
        self.supports_tools = profile.tools
        self.structured_output = True  # takes `response_format` (a JSON schema the answer follows)
        self._client: openai.AsyncOpenAI | None = None

    def _get_client(self) -> openai.AsyncOpenAI:
        if self._client is None:
            timeout = openai.Timeout(self.profile.first_token_timeout_s, connect=self.profile.connect_timeout_s,
                                    read=max(self.profile.token_timeout_s, self.profile.first_token_timeout_s))
            self._client = openai.AsyncOpenAI(api_key=api_key_for(self.profile), base_url=self.profile.base_url,
                                              timeout=timeout, max_retries=0)
        return self._client

    async def stream_chat(self, messages: list[ChatMessage], tools: list[ToolSpec] | None = None,
                          tool_choice: str | dict | None = None,
                          response_format: dict | None = None) -> AsyncIterator[str | ToolCalls]:
        client = self._get_client()
        extra = {"tools": [tool.openai() for tool in tools]} if tools else {}
        if response_format is not None:
            extra["response_format"] = response_format
        if tools and tool_choice is not None:  # "none": the tools are listed (the history has calls), not offered
            extra["tool_choice"] = tool_choice
        assembler = ToolCallAssembler()
        try:
            stream = await asyncio.wait_for(client.chat.completions.create(
                model=self.profile.model, messages=[m.openai() for m in messages],
                stream=True, max_tokens=self.profile.max_tokens, temperature=self.profile.temperature, **extra,
            ), self.profile.first_token_timeout_s)
            chunks = aiter(stream)
            limit = self.profile.first_token_timeout_s
            while True:
                try:
                    chunk = await asyncio.wait_for(anext(chunks), limit)
                except StopAsyncIteration:
                    break
                limit = self.profile.token_timeout_s
                if not chunk.choices:
                    continue
                delta = chunk.choices[0].delta
                if delta.content:
                    yield delta.content
                if delta.tool_calls:
                    assembler.push(delta.tool_calls)
            if assembler:
                yield ToolCalls(assembler.calls())
        except TimeoutError as exc:
            raise LLMError("timeout", f"{self.name}: no token within the time allowed") from exc
        except openai.APIError as exc:
            raise _classify(self.name, exc) from exc
        except (httpx2.HTTPError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise LLMError("protocol", f"{self.name}: malformed stream ({type(exc).__name__}: {exc})") from exc

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()


def _retry_after(exc: openai.APIStatusError) -> float | None:
    value = exc.response.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _classify(name: str, exc: openai.APIError) -> LLMError:
    if isinstance(exc, openai.APITimeoutError):
        return LLMError("timeout", f"{name}: request timed out")
    if isinstance(exc, openai.APIConnectionError):
        return LLMError("connection", f"{name}: cannot connect ({exc.__cause__ or exc})")
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        if status in (401, 403):
            return LLMError("auth", f"{name}: the API key was refused (HTTP {status})")
        if status == 429:
            return LLMError("rate_limit", f"{name}: rate limited (HTTP 429)", _retry_after(exc))
        if status >= 500:
            return LLMError("server", f"{name}: server error (HTTP {status})", _retry_after(exc))
        return LLMError("bad_request", f"{name}: request refused (HTTP {status}): {exc.message}")
    return LLMError("protocol", f"{name}: {exc}")
