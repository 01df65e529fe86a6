"""A real Pipecat pipeline against /v1/live/sessions on loopback: pipecat-ai's own OpenAI Live service,
set up as examples/pipecat_live.py does, hears the spoken question (tiny-copy, Whisper tiny.en) and the
assistant's words come back as Pipecat frames, in both delegation modes: `responses` (KAME's scripted LLM
answers) and `client` (Pipecat's backend worker answers, from an LLM KAME never calls)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pipecat.services.openai.live.llm",
                    reason="needs the dev extra (pipecat-ai[openai])")

from pipecat.frames.frames import (
    LLMRunFrame,
    SpeechOutputAudioRawFrame,
)
from pipecat.pipeline.worker import PipelineWorker
from pipecat.workers.runner import WorkerRunner

from kame.pcm import pcm16_encode
from kame.testing.openai_server import ScriptedOpenAIServer, ScriptedReply

from .conftest import words
from .server_harness import wait_until_all_slots_free
from .test_pipecat import Heard as RealtimeHeard
from .test_pipecat import load_example as load_pipecat_example

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).parent.parent / "examples" / "pipecat_live.py"
INSTRUCTIONS = "You are the test's assistant. Answer in one short sentence."
QUESTION = "What is the capital of France"  # the first words of voices["france"]
BACKEND_ANSWER = "Zebras sing in Oslo."  # what only Pipecat's backend LLM says, never KAME's scripted one


def load_example():
    return load_pipecat_example(EXAMPLE)


class Heard(RealtimeHeard):
    """What the live service pushed into the pipeline; its audio is a speech stream (silence
    included), not TTS output."""

    audio_type = SpeechOutputAudioRawFrame

    def said_words(self) -> str:
        return " ".join(words("".join(self.said)))


async def converse(url: str, delegation, question: np.ndarray, answer: str, asked: str = QUESTION,
                   functions: dict | None = None):
    """Runs the example's pipeline until `answer` is heard and the user's turn (`asked`: its first words) is
    in, then ends it (session.close, then session.closed). `functions`: name -> (FunctionSchema, handler),
    the application's tools. Returns what was heard, the context, the recorder and the delegations the
    service saw."""
    from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema

    example = load_example()
    llm = example.kame_live_llm(url, None, INSTRUCTIONS, delegation)
    pipeline, context, recorder = example.conversation(llm)
    if functions:
        context.set_tools(ToolsSchema(standard_tools=[schema for schema, _ in functions.values()]))
        for name, (_, handler) in functions.items():
            llm.register_function(name, handler)
    heard = Heard(llm)
    worker = PipelineWorker(pipeline, observers=[heard], enable_rtvi=False, cancel_on_idle_timeout=False)
    started, delegations = asyncio.Event(), []
    runner = WorkerRunner(handle_sigint=False)

    @llm.event_handler("on_session_started")
    async def on_started(llm, session) -> None:
        started.set()

    @llm.event_handler("on_delegation_created")
    async def on_delegation(llm, delegation) -> None:
        delegations.append(delegation)

    async def talk() -> None:
        speaking = None
        try:
            await worker.queue_frame(LLMRunFrame())  # the first context frame: session.start
            await asyncio.wait_for(started.wait(), 15)
            speaking = asyncio.ensure_future(example.send_audio(worker, pcm16_encode(question)))
            await heard.wait(lambda: " ".join(words(answer)) in heard.said_words(), 30, "the spoken answer")
            first = words(asked)
            await heard.wait(lambda: words(" ".join(heard.user))[:len(first)] == first, 10, "the user's transcript")
            await heard.wait(lambda: any(set(words(answer)) & set(words(t)) for t in heard.turns), 10,
                             "the answer's turn in the context")
            speaking.cancel()
            # graceful: session.close, then session.closed. Not an EndFrame queued into the pipeline: that
            # ends the pipeline worker but not its child (client delegation's backend worker), and
            # pipecat 1.12's runner.run() then waits for that child forever. runner.end() ends both.
            await runner.end(reason="the question was answered")
        except BaseException:
            await worker.cancel(reason="the test failed")  # ends runner.run() below
            raise
        finally:
            if speaking is not None:
                speaking.cancel()

    await runner.add_workers(worker)
    results = await asyncio.wait_for(asyncio.gather(runner.run(), talk(), return_exceptions=True), 90)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return heard, context, recorder, delegations


def spoken_question(voices) -> np.ndarray:
    return np.concatenate([np.zeros(12000, np.float32), voices["france"], np.zeros(24000 * 6, np.float32)])


def test_pipecat_live_with_responses_delegation(tandem_server, scripted_llm, voices):
    """KAME's planner and scripted LLM answer; pipecat hears the answer and both sides' turns."""
    url, services = tandem_server
    example = load_example()
    try:
        heard, context, recorder, delegations = asyncio.run(
            converse(url, example.responses_delegation("scripted"), spoken_question(voices),
                     "Paris is the capital of France"))
    finally:
        wait_until_all_slots_free(services, limit_s=30.0)
    assert not heard.errors
    messages = context.get_messages()
    assert any(m["role"] == "user" and "france" in words(m["content"]) for m in messages)
    assert any(m["role"] == "assistant" and "paris" in words(m["content"]) for m in messages)
    assert delegations and all(d.target == "responses" for d in delegations)
    # the assistant's audio: 24 kHz PCM16, through the pipeline to where a transport would play it
    assert len(heard.audio) >= 5 and all(f.sample_rate == 24000 for f in heard.audio)
    assert len(recorder.audio) >= 5 * 3840
    assert any(INSTRUCTIONS in r["messages"][0]["content"] for r in scripted_llm.requests)  # reached the LLM


@pytest.fixture
def backend_llm():
    """The LLM of Pipecat's backend worker: it alone says BACKEND_ANSWER, marked as Pipecat (1.14) tells a
    backend to mark what the user should hear (`SPOKEN_MARK`; unmarked text goes as thinking)."""
    from pipecat.workers.llm.backend_llm_worker import SPOKEN_MARK

    server = ScriptedOpenAIServer(lambda body: ScriptedReply(text=f"{SPOKEN_MARK} {BACKEND_ANSWER}"))
    server.start_in_thread()
    yield server
    server.stop_thread()


def test_pipecat_live_with_client_delegation(tandem_server, scripted_llm, voices, backend_llm):
    """KAME calls no LLM: each delegation goes to Pipecat's BackendLLMWorker, whose answer comes back as
    commentary and is what KAME's front-end says."""
    url, services = tandem_server
    example = load_example()
    asked_before = len(scripted_llm.requests)
    try:
        heard, context, recorder, delegations = asyncio.run(
            converse(url, example.client_delegation(backend_llm.base_url, "scripted"), spoken_question(voices),
                     BACKEND_ANSWER))
    finally:
        wait_until_all_slots_free(services, limit_s=30.0)
    assert not heard.errors
    assert delegations and all(d.target == "client" for d in delegations)
    assert len(scripted_llm.requests) == asked_before  # KAME's own LLM was never asked
    # the backend was given the user's words, as pipecat renders the transcript since the last delegation
    asked = [r["messages"][-1]["content"] for r in backend_llm.requests]
    assert any("USER:" in text and "france" in words(text) for text in asked), asked
    assert len(recorder.audio) >= 5 * 3840


WEATHER_QUESTION = "What is the weather in Paris today?"


def test_pipecat_live_runs_the_applications_function_and_the_answer_uses_it(tandem_server, scripted_llm,
                                                                            tmp_path_factory):
    """The application's `get_weather` is a Pipecat function tool: KAME's backend LLM is offered it, calls it,
    Pipecat's handler runs and answers through response.item.create and response.create, and what the
    front-end then says is the answer built from the handler's result."""
    from pipecat.adapters.llm.schemas.function_schema import FunctionSchema

    from kame.testing.speech import speech

    url, services = tandem_server
    example = load_example()
    calls = []

    async def get_weather(params) -> None:
        calls.append(params.arguments)
        await params.result_callback({"conditions": "sunny and 24 degrees"})

    schema = FunctionSchema(name="get_weather", description="The weather in a city now.",
                            properties={"city": {"type": "string"}}, required=["city"])
    question = np.concatenate([np.zeros(12000, np.float32), speech(WEATHER_QUESTION, tmp_path_factory.mktemp("tts")),
                               np.zeros(24000 * 8, np.float32)])
    before = len(scripted_llm.requests)
    try:
        heard, context, _, delegations = asyncio.run(converse(
            url, example.responses_delegation("scripted"), question, "sunny and 24 degrees", WEATHER_QUESTION,
            {"get_weather": (schema, get_weather)}))
    finally:
        wait_until_all_slots_free(services, limit_s=30.0)
    assert not heard.errors
    assert calls and all(c == {"city": "Paris"} for c in calls)  # the handler ran, with the model's arguments
    requests = scripted_llm.requests[before:]
    assert any(t["function"]["name"] == "get_weather" for r in requests for t in r.get("tools") or ())
    assert any(m["role"] == "tool" and "sunny" in m["content"] for r in requests for m in r["messages"])
    assert delegations and all(d.target == "responses" for d in delegations)


def test_a_question_with_a_pause_stays_one_user_turn(tandem_server, scripted_llm, tmp_path_factory):
    """Pipecat ends a user turn after 0.8 s without an input transcript delta: through a 1 s pause in
    mid-question the words said so far come out settled and a space keeps the turn open (stable_text.py),
    so the question is one TranscriptionFrame."""
    from kame.testing.speech import speech

    url, services = tandem_server
    cache = tmp_path_factory.mktemp("tts")
    question = np.concatenate([np.zeros(12000, np.float32), speech("So what is the", cache),
                               np.zeros(24000, np.float32), speech("capital of France, and why is it famous?", cache),
                               np.zeros(24000 * 6, np.float32)])
    try:
        heard, context, _, _ = asyncio.run(converse(url, load_example().responses_delegation("scripted"), question,
                                                    "Paris is the capital of France", "So what is"))
    finally:
        wait_until_all_slots_free(services, limit_s=30.0)
    print(f"\nuser turns: {heard.user}")
    assert not heard.errors
    assert len(heard.user) == 1 and words(heard.user[0])[-3:] == ["is", "it", "famous"]
