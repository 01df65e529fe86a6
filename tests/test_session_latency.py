"""The session's latency tracker on a ManualClock: frame latency, frames skipped to stay live, the
ASR's lag, the stats, and the oracle lead, fed events the way the session feeds them."""

from __future__ import annotations

import asyncio

import pytest

from kame.clock import ManualClock
from kame.latency import RECENT_RESETS, LatencyTracker
from kame.session_events import FramesSkipped, LLMAttempt, OracleApplied, OracleLead, SessionStats, Transcript


def tracker() -> tuple[LatencyTracker, ManualClock]:
    clock = ManualClock(start=100.0)
    return LatencyTracker(clock), clock


def tick(clock: ManualClock, seconds: float) -> None:
    asyncio.run(clock.advance(seconds))


def started(epoch: int) -> LLMAttempt:
    return LLMAttempt("started", epoch, "fake", "partial")


def done(epoch: int, oracle_epoch: int) -> LLMAttempt:
    return LLMAttempt("done", epoch, "fake", "final", took_oracle=True, oracle_epoch=oracle_epoch)


def reset(epoch: int) -> OracleApplied:
    return OracleApplied("reset", epoch, "Paris", 1, 0, True, 0)


def final(lag_s: float) -> Transcript:
    return Transcript(True, "what is the capital", 0.0, 1.0, lag_s)


def test_frame_latency_counts_from_the_push_and_skipped_frames_never_come_out():
    timing, clock = tracker()
    timing.audio_in(1920 * 3, 3)  # three frames at 100.0
    tick(clock, 0.25)
    timing.audio_in(1920, 1)  # a fourth at 100.25
    tick(clock, 0.05)
    assert timing.frame_out(0) == (pytest.approx(0.3), None)
    assert timing.frame_out(1) == (pytest.approx(0.3), FramesSkipped(1))  # the second was skipped: the third
    assert timing.frame_out(1) == (pytest.approx(0.05), None)  # the fourth
    assert timing.frame_out(1) == (None, None)  # nothing pushed is left to come out
    assert timing.stats(4, 3, 2) == SessionStats(4, 3, 1 + 2, 300.0)  # the median of 300, 300 and 50 ms


def test_lag_is_the_clock_time_since_that_audio_came_in():
    timing, clock = tracker()
    assert timing.lag(1.0) == 0.0  # no audio yet
    timing.audio_in(24000, 12)  # 1 s of audio at 100.0
    tick(clock, 0.5)
    timing.audio_in(24000, 13)  # 2 s at 100.5
    tick(clock, 0.2)
    assert timing.audio_s == 2.0
    assert timing.lag(0.5) == pytest.approx(0.7) and timing.lag(1.0) == pytest.approx(0.7)
    assert timing.lag(1.5) == pytest.approx(0.2) and timing.lag(9.0) == pytest.approx(0.2)


def test_the_lead_when_the_answers_oracle_was_applied_before_the_user_stopped():
    timing, clock = tracker()
    assert timing.on_event(started(1)) is None
    assert timing.on_event(reset(1)) is None  # applied at 100.0
    tick(clock, 2.0)
    timing.on_event(final(lag_s=0.5))  # the user stopped at 101.5
    timing.on_event(done(1, 1))  # an attempt older than the final answers nothing
    timing.on_event(started(2))
    assert timing.on_event(done(2, 1)) == OracleLead(1.5, 1)  # it kept the oracle of epoch 1
    assert timing.on_event(done(3, 1)) is None  # once per utterance


def test_the_lead_waits_for_a_reset_still_on_its_way_and_may_be_negative():
    timing, clock = tracker()
    timing.on_event(started(1))
    timing.user_stopped()  # a typed message: the user's input ended now, at 100.0
    timing.on_event(started(2))
    assert timing.on_event(done(2, 2)) is None  # its reset is not applied yet
    tick(clock, 0.75)
    assert timing.on_event(reset(2)) == OracleLead(-0.75, 2)
    assert timing.on_event(reset(2)) is None


def test_no_lead_without_an_oracle_and_only_recent_resets_are_kept():
    timing, _ = tracker()
    timing.on_event(final(0.0))
    timing.on_event(started(1))
    assert timing.on_event(done(1, 0)) is None  # it produced no words: no oracle in place
    for epoch in range(1, RECENT_RESETS + 2):
        timing.on_event(reset(epoch))
    timing.on_event(final(0.0))
    timing.on_event(started(RECENT_RESETS + 2))
    assert timing.on_event(done(RECENT_RESETS + 2, 1)) is None  # epoch 1's reset is forgotten: pending
    assert timing.on_event(reset(1)) is not None
