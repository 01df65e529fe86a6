"""Planner policy on a manual clock: thresholds, rate limit, overlapping streams and who owns the
oracle, agreeing answers, the stream cap, words, epochs, faults."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from kame.asr.events import FinalTranscript, PartialTranscript
from kame.backend.llm import LLMError, OpenAICompatibleLLM
from kame.backend.planner import Planner, PlannerConfig
from kame.backend.profiles import BackendProfile
from kame.clock import ManualClock, settle
from kame.frontend.oracle import OracleOp, OracleTimeline, tokenize_words
from kame.session_events import LLMAttempt
from kame.testing.fakes import FakeLLM, FakeReply
from kame.testing.openai_server import ScriptedOpenAIServer, ScriptedReply


class Rig:
    """A planner wired to a fake LLM and a manual clock, recording everything it emits."""

    def __init__(self, tokenizer, replies=None, config: PlannerConfig | None = None):
        self.clock = ManualClock()
        self.t0 = self.clock.now()
        self.llm = FakeLLM(replies, self.clock)
        self.updates, self.sent_at, self.events = [], [], []
        self.max_running = 0  # the most streams seen running at once, by `speak`
        self.final_at: float | None = None  # when `speak` sent the final (seconds since t0)
        self.tokenizer = tokenizer
        self.planner = Planner(self.llm, tokenizer, self._send, self.events.append,
                               config or PlannerConfig(), self.clock)

    def _send(self, update):
        self.updates.append(update)
        self.sent_at.append(self.clock.now() - self.t0)

    async def advance_to(self, t: float):
        """Advance to t0 + t on a clock that runs a millionth fast: a deadline summed in floats
        (start + delay) then falls due on the step it belongs to, never one step late."""
        await self.clock.advance(self.t0 + t * (1 + 1e-6) - self.clock.now())

    def partial(self, text: str, at: float = 1.0):
        self.planner.on_transcript(PartialTranscript(text, 0.0, at))

    def final(self, text: str, at: float = 2.0):
        self.planner.on_transcript(FinalTranscript(text, 0.0, at))

    def of(self, *phases: str) -> list[LLMAttempt]:
        """The LLM attempt events of these phases, in order (no phase: the last ones)."""
        phases = phases or ("done", "cancelled", "failed")
        return [e for e in self.events if isinstance(e, LLMAttempt) and e.phase in phases]

    def said(self) -> list[str]:
        """The words of every oracle update sent, in order."""
        return [u.text for u in self.updates]

    def resets(self):
        """(time since t0, update) of every reset sent."""
        return [(t, u) for t, u in zip(self.sent_at, self.updates, strict=True) if u.op is OracleOp.RESET]

    def oracle_in_place(self) -> list[int]:
        """The oracle the engine holds after every update so far, through the real OracleTimeline."""
        timeline = OracleTimeline(start_token=-1, padding_token=-2)
        applied = [timeline.apply(update, 0) for update in self.updates]
        assert all(a.accepted for a in applied)  # no append the engine would drop as stale
        return timeline.tokens[1:]

    def records(self):
        """Every attempt's record (the planner's own, with its timings)."""
        return list(self.planner.attempts)

    def record(self, epoch: int):
        return next(r for r in self.records() if r.epoch == epoch)


@pytest.fixture
def tok(tiny_copy):
    return tiny_copy.tokenizer


def run(coro):
    return asyncio.run(coro)


QUESTION = ["what", "is", "the", "capital", "of", "France", "and", "why", "do", "so", "many", "people", "say", "it",
            "is", "lovely"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


async def speak(rig: Rig, words: list[str], until: float, every_s: float = 0.5, step_s: float = 0.1) -> None:
    """The user speaks: a partial growing by 2 words every `every_s` from t=0, then the final.

    Steps the clock by `step_s` up to `until`, noting the final's time and the most streams
    running at once in `rig.final_at` and `rig.max_running`.
    """
    script = [(every_s * i, " ".join(words[:n])) for i, n in enumerate(range(2, len(words) + 1, 2))]
    final_at = every_s * len(script)
    rig.final_at, done, tick = final_at, 0, 0
    while tick * step_s <= until + 1e-9:
        await rig.advance_to(tick * step_s)
        while done < len(script) and script[done][0] <= tick * step_s + 1e-9:
            rig.partial(script[done][1], at=script[done][0])
            done += 1
        if abs(tick * step_s - final_at) < 1e-9:
            rig.final(" ".join(words), at=final_at)
        await settle()
        rig.max_running = max(rig.max_running, len(rig.planner.running_streams))
        tick += 1


def test_starts_when_two_new_words_arrive(tok):
    async def scenario():
        rig = Rig(tok, [FakeReply(delay_s=1.0)])
        rig.partial("what")
        rig.partial("what is")  # +2 words since nothing: start
        rig.partial("what is the")  # +1: no start
        await settle()
        assert len(rig.llm.calls) == 1
        rig.partial("what is the capital")  # +2 since the start: a new stream beside the first
        await settle()
        assert [e.epoch for e in rig.of("started")] == [1, 2]
        assert rig.llm.calls[-1][-1].content.endswith("user: what is the capital")
        assert rig.planner.running_streams == [1, 2] and not rig.of()
        await rig.planner.aclose()
        return rig

    rig = run(scenario())
    assert [e.phase for e in rig.of()] == ["cancelled", "cancelled"]
    assert rig.planner.running_streams == []


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
    starts = rig.of("started")
    assert [s.trigger for s in starts] == ["partial", "final"]
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
        assert len(rig.of("started")) == 5  # 5 per 2 s
        await rig.clock.advance(1.5)  # the first start leaves the window at t0 + 2 s
        assert len(rig.of("started")) == 6
        last = rig.of("started")[-1]
        assert last.trigger == "deferred" and last.user_text.count("word") == 7  # the newest transcript
        await rig.planner.aclose()

    run(scenario())


def test_an_attempt_names_the_users_words_as_data(tok):
    """`user_text` is the words the attempt answers, never a conversation line with its role: a partial's,
    a final's (though the final closed the turn before the attempt started), and for an attempt the client
    asks for after the turn closed, that last user turn's."""
    async def scenario():
        rig = Rig(tok, [FakeReply(delay_s=10.0)] * 4)
        rig.partial("what is the capital")
        rig.final("what is the capital of France", at=2.0)
        rig.planner.add_context("context", "the user: likes maps")
        rig.planner.request_attempt()
        assert [(e.trigger, e.user_text) for e in rig.of("started")] == [
            ("partial", "what is the capital"), ("final", "what is the capital of France"),
            ("client", "what is the capital of France")]
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
    texts = rig.said()
    assert " ".join(texts) == "The capital of France is Paris."
    assert texts[0] == "The"  # the reset carries the first whole word
    first, *rest = rig.updates
    assert first.op is OracleOp.RESET and all(u.op is OracleOp.APPEND for u in rest)
    assert {u.epoch for u in rig.updates} == {1}
    assert [t for u in rig.updates for t in u.tokens] == tokenize_words(tok, "The capital of France is Paris.")
    done = rig.of()[0]
    assert done.phase == "done" and done.answer == "The capital of France is Paris."
    assert done.oracle_tokens == len(tokenize_words(tok, "The capital of France is Paris.")) and done.took_oracle
    assert [e.latency_s for e in rig.of("first_token")] == [0.0]


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
    assert [u.text for u in rig.updates if u.epoch == 2] == ["fresh", "answer"]
    assert "three" not in " ".join(rig.said())
    assert rig.of()[0].phase == "cancelled"


def test_failures_back_off_and_honour_retry_after(tok):
    async def scenario():
        failing = FakeReply(error=LLMError("server", "boom"))
        limited = FakeReply(error=LLMError("rate_limit", "slow down", retry_after_s=3.0))
        rig = Rig(tok, [failing, limited, FakeReply(deltas=("ok",))])
        rig.partial("hello there")
        await settle()
        finished = rig.of()[-1]
        assert finished.phase == "failed" and finished.retry_in_s == 0.5
        rig.partial("hello there my friend")  # within the back-off: deferred, not started
        await settle()
        assert len(rig.llm.calls) == 1
        await rig.clock.advance(0.5)
        assert len(rig.llm.calls) == 2
        assert rig.of()[-1].retry_in_s == 3.0  # Retry-After beats the doubled 1 s
        rig.final("hello there my friend")
        await rig.clock.advance(2.9)
        assert len(rig.llm.calls) == 2
        await rig.clock.advance(0.2)
        assert len(rig.llm.calls) == 3 and rig.of()[-1].phase == "done"
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
    assert len(rig.llm.calls) == 1 and len(other.calls) == 1
    assert other.calls[0][0].content == "answer in French"
    assert [e.backend for e in rig.of("started")] == ["fake", "other"]


def test_through_a_real_openai_streaming_server(tok):
    async def scenario():
        async with ScriptedOpenAIServer([ScriptedReply(text="Paris, the city of light.")]) as server:
            llm = OpenAICompatibleLLM(BackendProfile("local", server.base_url, "m", None))
            updates, events = [], []
            planner = Planner(llm, tok, updates.append, events.append)
            planner.on_transcript(PartialTranscript("what is the capital", 0.0, 1.2))
            for _ in range(200):
                if any(isinstance(e, LLMAttempt) and e.phase == "done" for e in events):
                    break
                await asyncio.sleep(0.01)
            await planner.aclose()
            await llm.aclose()
            return server, updates, events

    server, updates, events = run(scenario())
    assert server.requests[0]["messages"][-1]["content"] == "user: what is the capital"
    assert " ".join(u.text for u in updates) == "Paris, the city of light."
    assert updates[0].op is OracleOp.RESET


def test_streams_overlap_so_a_slow_llm_still_answers_before_the_user_stops(tok):
    # 1.2 s to the first word, then one every 0.15 s: 2.1 s an answer, off the 0.5 s beat of the partials
    replies = [FakeReply.of_words(f"{NUMBERS[k]} says Paris is the capital of France", 1.2, 0.15) for k in range(1, 10)]

    async def scenario():
        rig = Rig(tok, replies)
        await speak(rig, QUESTION[:16], until=8.0, step_s=0.05)
        await rig.planner.aclose()
        return rig

    rig = run(scenario())
    starts = rig.records()
    assert len(starts) == 9 and starts[-1].trigger == "final" and rig.final_at == 4.0
    resets = rig.resets()
    assert resets[0][0] == pytest.approx(1.2, abs=1e-4) and resets[0][1].epoch == 1  # 1.2 s after the first trigger
    assert resets[0][0] < rig.final_at - 2.5  # ... long before the user stopped
    assert [u.epoch for _, u in resets] == list(range(1, 10))  # each newer stream took over in turn
    assert 3 <= rig.max_running <= PlannerConfig().max_concurrent_streams
    for older, newer in zip(starts, starts[1:], strict=False):  # cancelled when the next one spoke
        assert older.status == "cancelled" and older.took_oracle
        assert older.finished_at == newer.first_token_at < older.requested_at + 2.1  # mid-answer
        assert len(older.text.split()) == 4  # 1.2 s + 3 x 0.15 s of it, then the newer one spoke
    last = starts[-1]
    assert last.status == "done" and rig.planner.oracle_epoch == last.epoch == rig.planner.epoch
    assert rig.oracle_in_place() == tokenize_words(tok, "nine says Paris is the capital of France")


def test_one_stream_at_a_time_starves_the_oracle_until_the_final(tok):
    """The old cancel-on-restart policy, for contrast: max_concurrent_streams=1."""
    replies = [FakeReply.of_words(f"{NUMBERS[k]} says Paris", 1.2, 0.1) for k in range(1, 10)]

    async def scenario():
        rig = Rig(tok, replies, PlannerConfig(max_concurrent_streams=1))
        await speak(rig, QUESTION[:16], until=8.0)
        await rig.planner.aclose()
        return rig

    rig = run(scenario())
    assert rig.max_running == 1
    assert [(round(t, 3), u.epoch) for t, u in rig.resets()] == [(round(rig.final_at + 1.2, 3), 9)]
    assert all(r.status == "cancelled" and r.first_token_at is None for r in rig.records()[:-1])


def test_an_older_stream_never_takes_the_oracle_back(tok):
    slow = FakeReply.of_words("old and slow answer", first_delay_s=3.0)
    fast = FakeReply.of_words("new fast answer", first_delay_s=0.2)

    async def scenario():
        rig = Rig(tok, [slow, fast])
        rig.partial("what is")
        await settle()
        await rig.advance_to(0.5)
        rig.partial("what is the capital")
        await settle()
        await rig.advance_to(0.7)  # the newer stream speaks first: it owns the oracle
        assert rig.planner.running_streams == []
        await rig.advance_to(5.0)
        await rig.planner.aclose()
        return rig

    rig = run(scenario())
    old, new = rig.record(1), rig.record(2)
    assert new.took_oracle and not old.took_oracle
    assert old.status == "cancelled" and old.finished_at == new.first_token_at and old.text == ""
    assert {u.epoch for u in rig.updates} == {2} and rig.planner.oracle_epoch == 2
    assert rig.oracle_in_place() == tokenize_words(tok, "new fast answer")


class DeafToCancelLLM:
    """Streams its answers even when cancelled, as a badly behaved client could: the planner must drop them."""

    name = "deaf"

    def __init__(self, clock, answers):
        self.clock, self.answers, self.yielded = clock, list(answers), []

    async def stream_chat(self, messages):
        first_delay, text = self.answers.pop(0)
        with contextlib.suppress(asyncio.CancelledError):
            await self.clock.sleep(first_delay)
        for word in text.split():
            self.yielded.append(word)
            yield word + " "


def test_words_of_a_cancelled_older_stream_are_dropped(tok):
    async def scenario():
        rig = Rig(tok)
        rig.planner.llm = DeafToCancelLLM(rig.clock, [(3.0, "stale words"), (0.2, "fresh words")])
        rig.partial("what is")
        await settle()
        await rig.advance_to(0.5)
        rig.partial("what is the capital")
        await settle()
        await rig.advance_to(1.0)  # the newer stream speaks and cancels the older one, which goes on
        await rig.advance_to(4.0)
        await rig.planner.aclose()
        return rig

    rig = run(scenario())
    assert rig.planner.llm.yielded == ["fresh", "words", "stale", "words"]  # the old one spoke after all ...
    assert [e.epoch for e in rig.of("first_token")] == [2]  # ... and went unheard
    assert rig.record(1).status == "cancelled" and rig.record(1).tokens == 0 and rig.record(1).text == ""
    assert {u.epoch for u in rig.updates} == {2} and rig.oracle_in_place() == tokenize_words(tok, "fresh words")


def agreeing_rig(tok, second: str, keep: bool) -> Rig:
    """Stream 1 answers at 0.5 s, a word every 0.1 s; stream 2 (started at 0.3 s) at 0.8 s."""
    first = FakeReply.of_words("Paris is the capital of France.", 0.5, 0.1)
    return Rig(tok, [first, FakeReply.of_words(second, 0.5, 0.1)], PlannerConfig(keep_agreeing_oracle=keep))


async def two_streams(rig: Rig) -> Rig:
    rig.partial("what is")
    await settle()
    await rig.advance_to(0.3)
    rig.partial("what is the capital")
    await settle()
    for tick in range(4, 31):
        await rig.advance_to(tick * 0.1)
    await rig.planner.aclose()
    return rig


def test_an_agreeing_newer_stream_extends_the_oracle_without_a_reset(tok):
    rig = run(two_streams(agreeing_rig(tok, "paris is the capital of france, indeed!", keep=True)))
    assert [u.epoch for _, u in rig.resets()] == [1]
    assert {u.epoch for u in rig.updates} == {1}  # appends carry the kept oracle's epoch
    first, second = rig.record(1), rig.record(2)
    assert first.status == "cancelled" and first.text == "Paris is the"  # cut off when stream 2 spoke
    assert second.took_oracle and second.kept_oracle and second.first_token_at is not None
    # stream 1 said its three words before stream 2 spoke and cut it off: the rest is stream 2's
    assert rig.said() == ["Paris", "is", "the", "capital", "of", "france,", "indeed!"]
    assert rig.planner.oracle_epoch == 1 and rig.planner.epoch == 2
    assert rig.oracle_in_place() == tokenize_words(tok, "Paris is the capital of france, indeed!")


def test_without_keep_agreeing_every_takeover_resets(tok):
    rig = run(two_streams(agreeing_rig(tok, "paris is the capital of france, indeed!", keep=False)))
    assert [(round(t, 3), u.epoch) for t, u in rig.resets()] == [(0.5, 1), (0.8, 2)]
    assert not rig.record(2).kept_oracle and rig.planner.oracle_epoch == 2
    assert rig.oracle_in_place() == tokenize_words(tok, "paris is the capital of france, indeed!")


def test_a_diverging_newer_stream_resets_with_its_words_so_far(tok):
    rig = run(two_streams(agreeing_rig(tok, "Paris is a city in France.", keep=True)))
    resets = rig.resets()
    assert [(round(t, 3), u.epoch) for t, u in resets] == [(0.5, 1), (1.0, 2)]  # kept for 'Paris is', then 'a'
    assert resets[1][1].tokens == tuple(tokenize_words(tok, "Paris is a"))
    assert not rig.record(2).kept_oracle and rig.planner.oracle_epoch == 2
    assert rig.oracle_in_place() == tokenize_words(tok, "Paris is a city in France.")


def test_a_new_user_turn_resets_even_an_agreeing_answer(tok):
    async def scenario():
        rig = Rig(tok, [FakeReply.of_words("Paris, of course.")])
        rig.final("what is the capital of France")
        await settle()
        rig.partial("sorry what")  # the user speaks again: the same words are a new answer
        await settle()
        await rig.planner.aclose()
        return rig

    rig = run(scenario())
    assert [u.epoch for _, u in rig.resets()] == [1, 2]


def test_at_most_max_concurrent_streams_run(tok):
    async def scenario():
        rig = Rig(tok, [FakeReply(delay_s=1e6)], PlannerConfig(max_concurrent_streams=2))
        await speak(rig, QUESTION[:12], until=2.9)
        assert rig.max_running == 2 and len(rig.of("started")) == 6
        assert rig.planner.running_streams == [5, 6]  # the oldest went first
        await rig.planner.aclose()
        return rig

    rig = run(scenario())
    assert [e.epoch for e in rig.of()][:4] == [1, 2, 3, 4]
    assert all(r.status == "cancelled" and r.first_token_at is None for r in rig.records())


def test_the_cap_spares_the_stream_that_owns_the_oracle(tok):
    owner = FakeReply.of_words("a long and slow answer that goes on", 0.1, 1.0)
    async def scenario():
        rig = Rig(tok, [owner, FakeReply(delay_s=1e6)], PlannerConfig(max_concurrent_streams=2))
        rig.partial("what is")
        await settle()
        await rig.advance_to(0.5)  # stream 1 owns the oracle and goes on talking
        rig.partial("what is the capital")
        await settle()
        await rig.advance_to(1.0)
        rig.partial("what is the capital of France")  # over the cap: stream 2 goes, not the owner
        await settle()
        assert rig.planner.running_streams == [1, 3]
        await rig.planner.aclose()
        return rig

    rig = run(scenario())
    assert rig.record(2).status == "cancelled" and rig.record(2).finished_at == pytest.approx(rig.t0 + 1.0)


def test_a_failing_stream_leaves_the_others_running(tok):
    async def scenario():
        answering = FakeReply.of_words("still here", first_delay_s=1.0)
        rig = Rig(tok, [answering, FakeReply(error=LLMError("server", "boom"))])
        rig.partial("hello there")
        await settle()
        await rig.advance_to(0.2)
        rig.partial("hello there my friend")  # this one fails at once
        await settle()
        assert rig.record(2).status == "failed" and rig.planner.running_streams == [1]
        await rig.advance_to(1.5)
        await rig.planner.aclose()
        return rig

    rig = run(scenario())
    assert rig.record(1).status == "done" and rig.oracle_in_place() == tokenize_words(tok, "still here")


def test_the_prompt_keeps_max_history_turns(tok):
    async def scenario():
        rig = Rig(tok, [FakeReply(("Yes.",))], PlannerConfig(max_history_turns=3))
        for turn in ("one two", "three four", "five six"):
            rig.final(turn)
            await settle()
            rig.planner.on_assistant_text("ok")
        await rig.planner.aclose()
        return rig

    rig = run(scenario())
    # the three newest closed turns, then what the assistant is saying now; "one two" is forgotten
    assert rig.planner.conversation == ["user: three four", "assistant: ok", "user: five six", "assistant: ok"]
    assert len(rig.planner._conv.turns) == 3  # and not kept either


# ------------------------------------------------------------------ backchannels


def test_a_backchannel_while_the_assistant_speaks_is_no_turn(tok):
    """"Mm-hmm." while the front-end says its answer: no attempt, no user turn, the oracle kept, even
    when its final comes late; a word begun once the assistant has been quiet for the window, or after
    it asked something, is a turn."""
    async def scenario():
        rig = Rig(tok, [FakeReply.of_words("Paris is the capital.", delay_s=0.1)] * 4)
        rig.final("what is the capital of France")
        await rig.advance_to(1.0)
        await settle()
        resets = len(rig.resets())
        rig.planner.on_assistant_text(" Paris is")
        await rig.advance_to(1.5)
        for text in ("Mm-hmm.", "Right, right."):
            for event in (PartialTranscript(text, 3.0, 3.4), FinalTranscript(text, 3.0, 3.6)):
                assert rig.planner.is_backchannel(event), text
        assert not rig.planner.is_backchannel(FinalTranscript("Really?", 3.0, 3.6))
        assert not rig.planner.is_backchannel(FinalTranscript("and what about Spain", 3.0, 3.6))
        starts = len(rig.of("started"))
        conversation = rig.planner.conversation
        await rig.advance_to(1.5 + PlannerConfig.backchannel_window_s + 0.1)  # the assistant fell quiet
        late = rig.planner.is_backchannel(FinalTranscript("Mm-hmm.", 3.0, 6.0))  # the same one's late final
        quiet = rig.planner.is_backchannel(FinalTranscript("Okay.", 6.5, 7.0))  # a new one, begun in the quiet
        rig.planner.on_assistant_text(" the capital. Anything else?")
        asked = rig.planner.is_backchannel(FinalTranscript("Yeah.", 5.0, 5.4))
        off = Rig(tok, config=PlannerConfig(backchannel_window_s=0))
        off.planner.on_assistant_text(" Paris is")
        await rig.planner.aclose()
        return (rig, resets, starts, conversation, late, quiet, asked,
                off.planner.is_backchannel(FinalTranscript("Mm.", 0, 1)))

    rig, resets, starts, conversation, late, quiet, asked, off = run(scenario())
    assert resets == 1 and starts == 1  # nothing happened on the backchannels (only asked, never passed on)
    assert conversation == ["user: what is the capital of France", "assistant: Paris is"]
    assert late  # judged when it began: an end-of-turn model may hold a lone "mm-hm" open for seconds
    assert not quiet and not asked and not off
