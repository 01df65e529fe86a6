"""Planner policy on a manual clock: thresholds, rate limit, cancellation, words, epochs, faults."""

from __future__ import annotations

import asyncio

import pytest

from kame.asr.events import FinalTranscript, PartialTranscript
from kame.backend.llm import LLMError, OpenAICompatibleLLM
from kame.backend.planner import (
    AttemptFinished,
    AttemptStarted,
    BackendSwitched,
    OracleEmitted,
    Planner,
    PlannerConfig,
)
from kame.backend.profiles import BackendProfile
from kame.clock import ManualClock, settle
from kame.frontend.oracle import OracleOp, tokenize_words
from kame.testing.fakes import FakeLLM, FakeReply
from kame.testing.openai_server import ScriptedOpenAIServer, ScriptedReply


class Rig:
    """A planner wired to a fake LLM and a manual clock, recording everything it emits."""

    def __init__(self, tokenizer, replies=None, config: PlannerConfig | None = None):
        self.clock = ManualClock()
        self.llm = FakeLLM(replies, self.clock)
        self.updates, self.events = [], []
        self.tokenizer = tokenizer
        self.planner = Planner(self.llm, tokenizer, self.updates.append, self.events.append,
                               config or PlannerConfig(), self.clock)

    def partial(self, text: str, at: float = 1.0):
        self.planner.on_transcript(PartialTranscript(text, 0.0, at))

    def final(self, text: str, at: float = 2.0):
        self.planner.on_transcript(FinalTranscript(text, 0.0, at))

    def of(self, kind):
        return [e for e in self.events if isinstance(e, kind)]


@pytest.fixture
def tok(tiny_copy):
    return tiny_copy.tokenizer


def run(coro):
    return asyncio.run(coro)


def test_starts_when_two_new_words_arrive(tok):
    async def scenario():
        rig = Rig(tok, [FakeReply(delay_s=1.0)])
        rig.partial("what")
        rig.partial("what is")  # +2 words since nothing: start
        rig.partial("what is the")  # +1: no start
        await settle()
        assert len(rig.llm.calls) == 1
        rig.partial("what is the capital")  # +2 since the start: restart
        await settle()
        assert [e.record.epoch for e in rig.of(AttemptStarted)] == [1, 2]
        assert rig.llm.calls[-1][-1].content.endswith("user: what is the capital")
        await rig.planner.aclose()
        return rig

    rig = run(scenario())
    assert [e.record.status for e in rig.of(AttemptFinished)][:1] == ["cancelled"]


def test_final_always_starts_and_closes_the_turn(tok):
    async def scenario():
        rig = Rig(tok)
        rig.partial("what is")
        await settle()
        rig.final("what is up")  # +1 word only, but a final
        await settle()
        await rig.planner.aclose()
        return rig

    rig = run(scenario())
    starts = rig.of(AttemptStarted)
    assert [s.record.trigger for s in starts] == ["partial", "final"]
    assert rig.llm.calls[-1][-1].content == "user: what is up"
    assert rig.planner.conversation[-1] == "user: what is up"


def test_restarts_are_rate_limited_then_deferred(tok):
    async def scenario():
        rig = Rig(tok, [FakeReply(delay_s=10.0)])
        words = []
        for _ in range(7):
            words += ["word", "more"]
            rig.partial(" ".join(words))
            await rig.clock.advance(0.1)
        assert len(rig.of(AttemptStarted)) == 5  # 5 per 2 s
        await rig.clock.advance(1.5)  # the first start leaves the window at t0 + 2 s
        assert len(rig.of(AttemptStarted)) == 6
        last = rig.of(AttemptStarted)[-1].record
        assert last.trigger == "deferred" and last.user_text.count("word") == 7  # the newest transcript
        await rig.planner.aclose()

    run(scenario())


def test_answer_becomes_whole_word_oracle_updates(tok):
    async def scenario():
        rig = Rig(tok, [FakeReply(deltas=("The cap", "ital of", " Fr", "ance is Par", "is."))])
        rig.final("capital of France?")
        await settle()
        await rig.planner.aclose()
        return rig

    rig = run(scenario())
    texts = [e.text for e in rig.of(OracleEmitted)]
    assert " ".join(texts) == "The capital of France is Paris."
    assert texts[0] == "The"  # the reset carries the first whole word
    first, *rest = rig.updates
    assert first.op is OracleOp.RESET and all(u.op is OracleOp.APPEND for u in rest)
    assert {u.epoch for u in rig.updates} == {1}
    assert [t for u in rig.updates for t in u.tokens] == tokenize_words(tok, "The capital of France is Paris.")
    record = rig.of(AttemptFinished)[0].record
    assert record.status == "done" and record.text == "The capital of France is Paris."
    assert record.first_token_latency_s == 0.0


def test_a_cancelled_stream_emits_nothing_more(tok):
    async def scenario():
        slow = FakeReply(deltas=("one", " two", " three", " four"), delay_s=1.0)
        rig = Rig(tok, [slow, FakeReply(deltas=("fresh answer",))])
        rig.partial("tell me")
        await rig.clock.advance(1.0)  # 'one' is streaming
        await rig.clock.advance(1.0)  # 'one' complete once 'two' starts
        rig.final("tell me a story")
        await settle()
        await rig.clock.advance(5.0)
        await rig.planner.aclose()
        return rig

    rig = run(scenario())
    epochs = [u.epoch for u in rig.updates]
    assert epochs == sorted(epochs) and epochs[-1] == 2
    assert [e.text for e in rig.of(OracleEmitted) if e.update.epoch == 2] == ["fresh", "answer"]
    assert "three" not in " ".join(e.text for e in rig.of(OracleEmitted))
    assert rig.of(AttemptFinished)[0].record.status == "cancelled"


def test_failures_back_off_and_honour_retry_after(tok):
    async def scenario():
        failing = FakeReply(error=LLMError("server", "boom"))
        limited = FakeReply(error=LLMError("rate_limit", "slow down", retry_after_s=3.0))
        rig = Rig(tok, [failing, limited, FakeReply(deltas=("ok",))])
        rig.partial("hello there")
        await settle()
        finished = rig.of(AttemptFinished)[-1]
        assert finished.record.status == "failed" and finished.retry_in_s == 0.5
        rig.partial("hello there my friend")  # within the back-off: deferred, not started
        await settle()
        assert len(rig.llm.calls) == 1
        await rig.clock.advance(0.5)
        assert len(rig.llm.calls) == 2
        assert rig.of(AttemptFinished)[-1].retry_in_s == 3.0  # Retry-After beats the doubled 1 s
        rig.final("hello there my friend")
        await rig.clock.advance(2.9)
        assert len(rig.llm.calls) == 2
        await rig.clock.advance(0.2)
        assert len(rig.llm.calls) == 3 and rig.of(AttemptFinished)[-1].record.status == "done"
        await rig.planner.aclose()

    run(scenario())


def test_conversation_uses_what_the_front_end_said(tok):
    async def scenario():
        rig = Rig(tok)
        rig.final("what is the capital of France")
        await settle()
        rig.planner.on_assistant_text(" Paris, of")
        rig.planner.on_assistant_text(" course.")
        rig.partial("and of Spain")
        await settle()
        await rig.planner.aclose()
        return rig

    rig = run(scenario())
    assert rig.llm.calls[-1][-1].content.split("\n") == [
        "user: what is the capital of France", "assistant: Paris, of course.", "user: and of Spain"]
    assert rig.llm.calls[-1][0].role == "system" and "30 words" in rig.llm.calls[-1][0].content


def test_backend_hot_swap(tok):
    async def scenario():
        rig = Rig(tok)
        other = FakeLLM([FakeReply(deltas=("from", " other"))], rig.clock, name="other")
        rig.final("first question")
        await settle()
        rig.planner.set_llm(other)
        rig.planner.set_system_prompt("answer in French")
        rig.final("second question")
        await settle()
        await rig.planner.aclose()
        return rig, other

    rig, other = run(scenario())
    assert rig.of(BackendSwitched) == [BackendSwitched("fake", "other")]
    assert len(rig.llm.calls) == 1 and len(other.calls) == 1
    assert other.calls[0][0].content == "answer in French"
    assert rig.of(AttemptStarted)[-1].record.backend == "other"


def test_through_a_real_openai_streaming_server(tok):
    async def scenario():
        async with ScriptedOpenAIServer([ScriptedReply(text="Paris, the city of light.")]) as server:
            llm = OpenAICompatibleLLM(BackendProfile("local", server.base_url, "m", None))
            updates, events = [], []
            planner = Planner(llm, tok, updates.append, events.append)
            planner.on_transcript(PartialTranscript("what is the capital", 0.0, 1.2))
            for _ in range(200):
                if any(isinstance(e, AttemptFinished) for e in events):
                    break
                await asyncio.sleep(0.01)
            await planner.aclose()
            await llm.aclose()
            return server, updates, events

    server, updates, events = run(scenario())
    assert server.requests[0]["messages"][-1]["content"] == "user: what is the capital"
    assert " ".join(e.text for e in events if isinstance(e, OracleEmitted)) == "Paris, the city of light."
    assert updates[0].op is OracleOp.RESET
