"""The OpenAI-compatible backend through the real `openai` client against a scripted SSE server."""

from __future__ import annotations

import asyncio

import pytest

from kame.backend.llm import ChatMessage, LLMError, OpenAICompatibleLLM, api_key_for
from kame.backend.profiles import DEFAULT_PROFILES, BackendProfile
from kame.testing.openai_server import ScriptedOpenAIServer, ScriptedReply

from .server_harness import free_port

HELLO = [ChatMessage("system", "be brief"), ChatMessage("user", "user: what is the capital of")]


def profile(url: str, **kw) -> BackendProfile:
    return BackendProfile("test", url, "scripted-model", None, **({"first_token_timeout_s": 2.0,
                                                                      "token_timeout_s": 0.5} | kw))


async def collect(llm, messages=HELLO) -> list[str]:
    return [delta async for delta in llm.stream_chat(messages)]


async def run_reply(reply: ScriptedReply, **kw) -> tuple[list[str], LLMError | None, ScriptedOpenAIServer]:
    async with ScriptedOpenAIServer([reply]) as server:
        llm = OpenAICompatibleLLM(profile(server.base_url, **kw))
        out: list[str] = []
        try:
            async for delta in llm.stream_chat(HELLO):
                out.append(delta)
            error = None
        except LLMError as exc:
            error = exc
        await llm.aclose()
        return out, error, server


def test_streams_the_scripted_answer_and_sends_the_request():
    out, error, server = asyncio.run(run_reply(ScriptedReply(text="Paris is the capital.")))
    assert error is None and "".join(out) == "Paris is the capital."
    assert len(out) > 3  # it really streamed in pieces
    body = server.requests[0]
    assert body["model"] == "scripted-model" and body["stream"] is True
    assert body["messages"][-1] == {"role": "user", "content": "user: what is the capital of"}


@pytest.mark.parametrize(
    ("reply", "kind", "retry"),
    [
        (ScriptedReply(status=401), "auth", None),
        (ScriptedReply(status=429, retry_after="3"), "rate_limit", 3.0),
        (ScriptedReply(status=500), "server", None),
        (ScriptedReply(status=400), "bad_request", None),
        (ScriptedReply(cut_after=2), "connection", None),
        (ScriptedReply(malformed_after=2), "protocol", None),
        (ScriptedReply(stall_after=2), "timeout", None),
        (ScriptedReply(first_token_delay_s=5), "timeout", None),
    ],
)
def test_faults_become_typed_errors(reply, kind, retry):
    out, error, _ = asyncio.run(run_reply(reply))
    assert error is not None and error.kind == kind
    assert error.retry_after_s == retry
    if reply.cut_after or reply.malformed_after or reply.stall_after:
        assert out  # what came before the fault was delivered


def test_connection_refused_and_dns_failure():
    port = free_port()
    for url in (f"http://127.0.0.1:{port}/v1", "http://no-such-host.invalid/v1"):
        with pytest.raises(LLMError) as info:
            asyncio.run(collect(OpenAICompatibleLLM(profile(url))))
        assert info.value.kind == "connection"


def test_api_key_comes_from_the_named_env_var_and_is_never_shown(monkeypatch):
    monkeypatch.setenv("KAME_TEST_KEY", "sk-secret-123")
    prof = BackendProfile("keyed", "http://x/v1", "m", "KAME_TEST_KEY")
    assert api_key_for(prof) == "sk-secret-123"
    assert "sk-secret" not in repr(prof) and "sk-secret" not in str(prof.public())
    monkeypatch.delenv("KAME_TEST_KEY")
    with pytest.raises(LLMError, match="KAME_TEST_KEY") as info:
        api_key_for(prof)
    assert info.value.kind == "config"


def test_the_key_is_sent_as_a_bearer_token(monkeypatch):
    monkeypatch.setenv("KAME_TEST_KEY", "sk-secret-456")

    async def scenario():
        async with ScriptedOpenAIServer() as server:
            llm = OpenAICompatibleLLM(BackendProfile("keyed", server.base_url, "m", "KAME_TEST_KEY"))
            await collect(llm)
            await llm.aclose()
            return server.headers[0]

    headers = asyncio.run(scenario())
    assert headers["Authorization"] == "Bearer sk-secret-456"


def test_default_profiles():
    assert DEFAULT_PROFILES["openai"].model == "gpt-4.1"
    assert DEFAULT_PROFILES["anthropic"].model == "claude-opus-4-1"
    assert DEFAULT_PROFILES["gemini"].model == "gemini-2.5-flash"
    assert DEFAULT_PROFILES["local"].api_key_env is None
