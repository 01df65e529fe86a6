"""LiveKit Agents' GPTLiveModel against a real `kame serve` on loopback (tiny-copy, Whisper tiny.en, the
scripted LLM), without a LiveKit room, as scripts/livekit_live_check.py and examples/livekit_live.py set it
up (client/livekit_live.py drives it): `AgentSession(llm=GPTLiveModel(base_url=...))`, the question pushed
into the plugin's duplex session at real-time pace. Client delegation (our commentary is what KAME says), a
function tool the agent runs under responses delegation, and a question with a 1 s pause in it, which should
stay one user turn."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("livekit.plugins.openai.realtime", reason="needs the dev extra (livekit-plugins-openai)")

from livekit.agents import Agent, function_tool
from livekit.plugins.openai.realtime import GPTLiveModel

from client.livekit_live import RATE, Log, answer_with, converse

from .conftest import words
from .server_harness import wait_until_all_slots_free

pytestmark = pytest.mark.slow
INSTRUCTIONS = "You are the test's assistant. Answer in one short sentence."
ANSWER = "Zebras sing in Oslo."  # words only this test supplies (client delegation's commentary)
WEATHER_QUESTION = "What is the weather in Paris today?"


def http_base(url: str) -> str:
    return url.replace("ws://", "http://") + "/v1"


def test_client_delegation_our_commentary_is_what_kame_says(tandem_server, scripted_llm, voices):
    url, services = tandem_server
    asked_before = len(scripted_llm.requests)
    model = GPTLiveModel(api_key="unused", base_url=http_base(url), delegation="client")
    audio = np.concatenate([np.zeros(12000, np.float32), voices["france"]])
    def done(log: Log) -> bool:  # the answer said and the user's question heard
        return " ".join(words(ANSWER)) in log.said_words() and "france" in words(log.heard)

    try:
        log = asyncio.run(converse(Agent(instructions=INSTRUCTIONS), model, audio, done,
                                   on_delegation=answer_with(ANSWER)))
    finally:
        wait_until_all_slots_free(services, limit_s=30.0)
    print(f"server events: {dict(log.types)}; user turns: {log.user_turns!r}; assistant: {log.said!r}")
    assert not log.errors
    assert log.delegations and " ".join(words(ANSWER)) in log.said_words()
    assert "france" in words(log.heard)
    assert log.closed.is_set()  # session.close answered by session.closed
    assert len(scripted_llm.requests) == asked_before  # KAME's own LLM was never asked


class WeatherAgent(Agent):
    def __init__(self) -> None:
        super().__init__(instructions=INSTRUCTIONS)
        self.calls: list[str] = []

    @function_tool
    async def get_weather(self, city: str) -> str:
        """The weather in a city now."""
        self.calls.append(city)
        return "sunny and 24 degrees"


def test_a_function_tool_runs_in_the_agent_and_the_answer_uses_it(tandem_server, scripted_llm, tmp_path_factory):
    """Responses delegation: KAME's backend LLM (scripted) is offered the agent's `get_weather`, calls it,
    LiveKit runs the tool at once and its output comes back in time for the answer."""
    from kame.testing.speech import speech

    url, services = tandem_server
    before = len(scripted_llm.requests)
    agent = WeatherAgent()
    model = GPTLiveModel(api_key="unused", base_url=http_base(url), delegation="responses",
                         responses_options={"model": "scripted"})
    audio = np.concatenate([np.zeros(12000, np.float32), speech(WEATHER_QUESTION, tmp_path_factory.mktemp("tts"))])
    try:
        log = asyncio.run(converse(agent, model, audio, lambda log: "sunny" in words(log.said), limit_s=20))
    finally:
        wait_until_all_slots_free(services, limit_s=30.0)
    print(f"server events: {dict(log.types)}; tool calls: {agent.calls}; assistant: {log.said!r}")
    assert agent.calls and all(city.lower() == "paris" for city in agent.calls)
    requests = scripted_llm.requests[before:]
    assert any(t["function"]["name"] == "get_weather" for r in requests for t in r.get("tools") or ())
    # LiveKit reports a tool's output only once the assistant's audio "burst" ends, which GPTLiveModel's gate
    # (llm.FixedGate) sees after 0.8 s below ~0.0011 RMS: KAME's GPT-Live silence is zeros once the front-end
    # has said no word for a second (server/live/silence.py); with tiny-copy's noise as it was, the output came
    # only after KAME's 15 s wait (function_call_output_timeout)
    assert not log.errors
    assert any(m["role"] == "tool" and "sunny" in m["content"] for r in requests for m in r["messages"])
    assert "sunny" in words(log.said)


def test_a_question_with_a_one_second_pause_stays_one_user_turn(tandem_server, tmp_path_factory):
    from kame.testing.speech import speech

    url, services = tandem_server
    cache = tmp_path_factory.mktemp("tts")
    # the pause in mid-question, before the words are a whole question (after "What is the capital of
    # France," the server's end-of-turn model rightly ends the turn)
    audio = np.concatenate([np.zeros(12000, np.float32), speech("So what is the", cache),
                            np.zeros(RATE, np.float32), speech("capital of France, and why is it famous?", cache)])
    model = GPTLiveModel(api_key="unused", base_url=http_base(url), delegation="client")
    try:
        log = asyncio.run(converse(Agent(instructions=INSTRUCTIONS), model, audio,
                                   lambda log: "famous" in words(" ".join(log.user_turns)), limit_s=10,
                                   on_delegation=answer_with(ANSWER)))
    finally:
        wait_until_all_slots_free(services, limit_s=30.0)
    print(f"user turns as LiveKit closed them: {log.user_turns!r}")
    assert not log.errors
    assert "famous" in words(" ".join(log.user_turns))
    assert len(log.user_turns) == 1, log.user_turns
