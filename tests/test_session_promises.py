"""The session's promises about time, in-process on a ManualClock: a reused slot starts clean, the
oracle's lead over the end of the user's speech, the ASR stall fallback, the oracle delay, the stats.

The engine runner steps on its own thread as frames arrive (eager); the session's clock (its
timers, the planner's, the fake LLM's and the fake ASR's) moves only when a test advances it, so
no test waits on wall-clock time: it waits for events, with a generous limit that only a hang hits.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kame.asr.events import FinalTranscript, PartialTranscript
from kame.backend.profiles import BackendProfile
from kame.clock import ManualClock, settle
from kame.frontend.engine import BatchedEngine, GenerationConfig
from kame.frontend.runner import EngineRunner
from kame.runtime import Runtime, RuntimeSettings
from kame.session import SessionConfig, TandemSession
from kame.session_events import (
    AsrFailed,
    AssistantAudio,
    AssistantText,
    LLMAttempt,
    OracleApplied,
    OracleLead,
    SessionStats,
    Transcript,
)
from kame.testing.fakes import FakeLLM, FakeReply, ScriptedAsr

from .conftest import words

FRAME = np.zeros(1920, np.float32)
ANSWER = "Paris is the capital of France."
HANG_S = 60.0  # a limit for a hang only: every wait here ends on an event


@pytest.fixture
def engine(tiny_copy):
    """One slot: every session of a test takes the same one."""
    engine = BatchedEngine(tiny_copy, batch_size=1, gen=GenerationConfig(use_sampling=False))
    runner = EngineRunner(engine, clock="eager", batch_window_s=0.0).start()
    yield engine, runner
    runner.stop()
    engine.close()


class _SlowClosingAsr(ScriptedAsr):
    """A scripted ASR whose streams take `close_s` of clock time to close: a session that ends
    holds its slot that long, the window between a user hanging up and the slot going back."""

    close_s = 0.0

    def open_stream(self):
        stream = super().open_stream()
        close = stream.aclose

        async def slow_close() -> None:
            await self.clock.sleep(self.close_s)
            await close()

        stream.aclose = slow_close
        return stream


class Rig:
    """A runtime on a manual clock: scripted ASR and fake LLM on it, one engine slot."""

    def __init__(self, frontend, engine, script=(), replies=None, **asr) -> None:
        self.clock = ManualClock()
        self.t0 = self.clock.now()
        self.llm = FakeLLM(replies or [FakeReply.of_words(ANSWER)], self.clock)
        self.asr = _SlowClosingAsr(list(script), clock=self.clock, **asr)
        profiles = {"fake": BackendProfile("fake", None, "fake-model", None)}
        self.runtime = Runtime(RuntimeSettings(profiles=profiles, default_profile="fake"), frontend, *engine,
                               self.asr)
        self.runtime._llms["fake"] = self.llm

    async def open(self, **config) -> Seen:
        seen = Seen()
        config = SessionConfig(realtime=False, **config)  # frames queue, never skipped: the engine keeps up
        seen.session = await TandemSession.open(self.runtime, config, observers=[seen], clock=self.clock)
        return seen

    async def advance_to(self, t: float) -> None:
        """To t0 + t, a millionth fast: a deadline summed in floats falls due on its own step."""
        await self.clock.advance(self.t0 + t * (1 + 1e-6) - self.clock.now())


class Seen:
    """Every event of a session, as it happened (an observer), and a way to wait for one."""

    session: TandemSession

    def __init__(self) -> None:
        self.events: list = []
        self._changed = asyncio.Event()

    def on_input(self, pcm) -> None:
        pass

    def on_event(self, event) -> None:
        self.events.append(event)
        self._changed.set()

    def of(self, kind) -> list:
        return [e for e in self.events if isinstance(e, kind)]

    def said(self) -> list[str]:
        return words("".join(e.text for e in self.of(AssistantText)))

    async def until(self, done) -> None:
        async with asyncio.timeout(HANG_S):
            while not done():
                self._changed.clear()
                await self._changed.wait()

    async def speak(self, seconds: float) -> None:
        """Push `seconds` of audio, at most 10 frames before waiting for their output (a slot
        queues at most `max_pending_frames`: beyond, it loses the oldest) and wait until each
        frame's output is back."""
        frames = round(seconds / 0.08)
        for start in range(0, frames, 10):
            for _ in range(min(10, frames - start)):
                self.session.push_pcm(FRAME)
            await settle()
            await self.until(lambda: self.session.frames_out == self.session.frames_in)

    async def speak_until(self, done, limit_s: float = 4.0) -> None:
        """Push a frame at a time until `done()` (at most `limit_s` of audio)."""
        for _ in range(round(limit_s / 0.08)):
            if done():
                return
            await self.speak(0.08)
        assert done()


def run(coro):
    return asyncio.run(coro)


def test_a_reused_slot_starts_clean(tiny_copy, engine):
    """A leaves with its oracle in the slot and an answer in flight; B, next on the slot, sees none of it."""
    script = [(0.39, PartialTranscript("what is the capital", 0.0, 0.4)),
              (0.79, FinalTranscript("what is the capital of France", 0.0, 0.8))]
    replies = [FakeReply.of_words(ANSWER, 0.1), FakeReply.of_words("Lyon, the capital of gastronomy.", 2.0)]

    async def scenario():
        rig = Rig(tiny_copy, engine, script, replies)
        a = await rig.open()
        await a.speak(0.48)  # the partial: attempt 1 starts
        await rig.advance_to(0.1)  # ... and answers
        await a.speak(0.4)  # the final: attempt 2 starts, 2 s from its first word
        await a.speak_until(lambda: {"paris", "capital", "france"} <= set(a.said()))  # A's oracle is live in the slot
        assert [e.phase for e in a.of(LLMAttempt) if e.epoch == 2] == ["started"]
        slot, generation = a.session.handle.slot, a.session.handle.generation
        rig.asr.close_s = 3.0  # A's ASR takes 3 s to close: A's answer would come out meanwhile
        closing = asyncio.create_task(a.session.aclose())
        await settle()
        assert not closing.done() and rig.runtime.runner.free_slots == 0  # the slot waits for the close
        async with asyncio.timeout(HANG_S):
            while not closing.done():  # 3 s of clock time and more: A's second answer would be out by now
                await rig.clock.advance(0.1)
                await asyncio.sleep(0.001)
        assert rig.clock.now() - rig.t0 > 3.0
        rig.asr.script, rig.asr.close_s = [], 0.0  # B says nothing
        b = await rig.open()
        assert (b.session.handle.slot, b.session.handle.generation) == (slot, generation + 1)
        await b.speak(4.0)
        await b.session.aclose()
        return rig, a, b

    rig, a, b = run(scenario())
    assert len(rig.llm.calls) == 2  # A's two attempts, nothing since
    assert [e.phase for e in a.of(LLMAttempt) if e.epoch == 2] == ["started", "cancelled"]
    assert len(b.of(AssistantAudio)) == 50 and b.of(AssistantAudio)[0].frame == 0  # B's own frames from 0
    assert not b.of(OracleApplied) and not b.of(LLMAttempt) and not b.of(Transcript) and not b.of(OracleLead)
    assert not set(b.said()) & {"paris", "capital", "france", "lyon", "gastronomy"}, b.said()


def test_an_oracle_in_place_before_the_user_stops_leads_by_that_much(tiny_copy, engine):
    """The partial's answer is applied at 0.3 s, the user stops at 2.0 s, the final's answer agrees
    with it (the oracle is kept): the lead is 1.7 s on the session's clock."""
    script = [(0.39, PartialTranscript("what is the capital", 0.0, 0.4)),
              (1.99, FinalTranscript("what is the capital of France", 0.0, 2.0))]

    async def scenario():
        rig = Rig(tiny_copy, engine, script, [FakeReply.of_words(ANSWER, 0.3)])
        seen = await rig.open()
        await seen.speak(0.48)
        await rig.advance_to(0.3)  # attempt 1 answers: its reset goes to the slot ...
        await seen.speak(0.08)  # ... and is applied before the next frame
        assert [(e.op, e.epoch) for e in seen.of(OracleApplied)][:1] == [("reset", 1)]
        await rig.advance_to(2.0)  # the user goes on talking; their last audio arrives now
        await seen.speak(1.44)
        assert seen.of(Transcript)[-1].final and not seen.of(OracleLead)
        await rig.advance_to(2.3)  # the final's attempt answers the same: the oracle stays
        await seen.until(lambda: seen.of(OracleLead))
        await seen.session.aclose()
        return seen

    seen = run(scenario())
    assert seen.of(Transcript)[-1].lag_s == 0.0  # the final came as its audio did
    assert [(e.op, e.epoch) for e in seen.of(OracleApplied) if e.op == "reset"] == [("reset", 1)]
    done = [e for e in seen.of(LLMAttempt) if e.phase == "done"]
    assert [(e.epoch, e.kept_oracle, e.oracle_epoch) for e in done] == [(1, False, 1), (2, True, 1)]
    assert seen.of(OracleLead) == [OracleLead(1.7, 1)]


def test_an_oracle_applied_after_the_user_stopped_gives_a_negative_lead(tiny_copy, engine):
    """Only the final asks, the LLM takes 1 s: the lead waits for the reset to reach the engine."""
    script = [(0.79, FinalTranscript("capital of France", 0.0, 0.8))]

    async def scenario():
        rig = Rig(tiny_copy, engine, script, [FakeReply.of_words(ANSWER, 1.0)])
        seen = await rig.open()
        await seen.speak(0.8)  # the final at t0
        await rig.advance_to(1.0)  # the answer: done, but its reset waits for a frame to be applied
        assert [e.phase for e in seen.of(LLMAttempt)] == ["started", "first_token", "done"]
        assert not seen.of(OracleLead)
        await rig.advance_to(1.25)
        await seen.speak(0.08)
        await seen.session.aclose()
        return seen

    seen = run(scenario())
    assert seen.of(OracleLead) == [OracleLead(-1.25, 1)]
    assert seen.events.index(seen.of(OracleLead)[0]) == seen.events.index(seen.of(OracleApplied)[0]) + 1


def test_a_stalled_asr_is_given_up_after_asr_stall_s_and_the_session_goes_on(tiny_copy, engine):
    script = [(0.39, FinalTranscript("never heard", 0.0, 0.4))]

    async def scenario():
        rig = Rig(tiny_copy, engine, script, stall=True)
        seen = await rig.open(asr_stall_s=5.0)
        await seen.speak(0.8)  # the ASR takes none of it: stalled from t0
        await rig.advance_to(4.9)
        assert not seen.of(AsrFailed)
        await rig.advance_to(5.0)
        failed = seen.of(AsrFailed)
        await seen.speak(0.8)  # the front-end goes on alone
        await seen.session.aclose()
        return seen, failed

    seen, failed = run(scenario())
    assert len(failed) == 1 and "5 s behind" in failed[0].message
    assert len(seen.of(AssistantAudio)) == 20  # every frame came back, before and after
    assert not seen.of(Transcript) and not seen.of(LLMAttempt)


def test_the_oracle_delay_holds_every_update_back_on_the_clock(tiny_copy, engine):
    script = [(0.39, FinalTranscript("what is the capital of France", 0.0, 0.4))]

    async def scenario():
        rig = Rig(tiny_copy, engine, script)  # the answer comes at once, a word a delta
        seen = await rig.open()
        seen.session.set_oracle_delay(1.0)
        await seen.speak(0.48)  # the final at t0: reset and appends sent
        assert [e.phase for e in seen.of(LLMAttempt)] == ["started", "first_token", "done"]
        await rig.advance_to(0.99)
        await seen.speak(0.4)  # five frames stepped: none had an update yet
        held = list(seen.of(OracleApplied))
        await rig.advance_to(1.0)
        await seen.speak(0.08)  # the next frame has them all
        await seen.session.aclose()
        return seen, held

    seen, held = run(scenario())
    assert not held
    applied = seen.of(OracleApplied)
    assert {e.frame for e in applied} == {11} and all(e.accepted for e in applied)  # in order: none stale
    assert [e.op for e in applied] == ["reset"] + ["append"] * 5
    assert " ".join(e.text for e in applied) == ANSWER


def test_stats_come_on_the_clock(tiny_copy, engine):
    async def scenario():
        rig = Rig(tiny_copy, engine)
        seen = await rig.open(stats_interval_s=2.0)
        await seen.speak(0.4)
        await rig.advance_to(1.9)
        before = list(seen.of(SessionStats))
        await rig.advance_to(2.0)
        after = list(seen.of(SessionStats))
        await seen.session.aclose()
        return before, after

    before, after = run(scenario())
    assert not before
    assert after == [SessionStats(5, 5, 0, 0.0)]  # no clock time passed between a frame in and out


def test_a_backchannel_while_the_assistant_speaks_leaves_its_answer_alone(tiny_copy, engine):
    """The user says "Mm-hmm." while the front-end says the answer: the transcript comes out marked as
    a backchannel, and the planner starts nothing on it (the answer's oracle stays in place)."""
    script = [(0.79, FinalTranscript("what is the capital of France", 0.0, 0.8)),
              (4.0, FinalTranscript("Mm-hmm.", 3.6, 4.0))]

    async def scenario():
        rig = Rig(tiny_copy, engine, script, [FakeReply.of_words(ANSWER)] * 2)
        seen = await rig.open()
        await seen.speak(0.88)  # the final: attempt 1 answers at once
        await seen.speak_until(lambda: "paris" in seen.said())  # the front-end is saying it
        heard = len(seen.of(AssistantAudio)) * 0.08
        assert heard < 4.0, heard  # still before the backchannel
        await seen.speak(4.08 - heard)
        await seen.until(lambda: len(seen.of(Transcript)) == 2)
        await seen.speak(0.8)
        await seen.session.aclose()
        return rig, seen

    rig, seen = run(scenario())
    first, second = seen.of(Transcript)
    assert not first.backchannel and second.backchannel and second.text == "Mm-hmm."
    assert len(rig.llm.calls) == 1 and [e.epoch for e in seen.of(LLMAttempt) if e.phase == "started"] == [1]
    assert [e.epoch for e in seen.of(OracleApplied) if e.op == "reset"] == [1]
