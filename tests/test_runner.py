"""The engine thread: asyncio sessions push frames, outputs come back, slots are batched and freed."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time

import numpy as np
import pytest

from kame.clock import ManualClock
from kame.errors import EngineError
from kame.frontend.engine import FRAME_SIZE, BatchedEngine, GenerationConfig
from kame.frontend.oracle import OracleUpdate
from kame.frontend.runner import EngineRunner
from kame.frontend.slots import SlotHandle, SlotInbox, Stamped

from .conftest import noise_frames
from .server_harness import wait_until
from .test_engine import assert_same, run_alone

GREEDY = GenerationConfig(use_sampling=False)


async def open_slot(runner: EngineRunner):
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    handle = await runner.acquire_async(lambda out: loop.call_soon_threadsafe(queue.put_nowait, out))
    return handle, queue


@pytest.mark.realtime
@pytest.mark.parametrize("clock", ["eager", "tick"])
def test_two_async_sessions_are_stepped_together(tiny, rng, clock):
    frames_a, frames_b = noise_frames(rng, 8), noise_frames(rng, 8)
    alone_a = run_alone(tiny, frames_a, {0: OracleUpdate.reset(0, (10, 11, 12))})
    alone_b = run_alone(tiny, frames_b, {})
    engine = BatchedEngine(tiny, batch_size=3, gen=GREEDY)

    async def scenario(runner: EngineRunner):
        (a, qa), (b, qb) = await open_slot(runner), await open_slot(runner)
        assert runner.free_slots == 1
        a.push_oracle(OracleUpdate.reset(0, (10, 11, 12)))
        got_a, got_b, first = [], [], None
        for fa, fb in zip(frames_a, frames_b, strict=True):
            a.push_frame(fa)
            b.push_frame(fb)
            got_a.append(await asyncio.wait_for(qa.get(), 10))
            got_b.append(await asyncio.wait_for(qb.get(), 10))
            first = runner.steps if first is None else first
        a.release()
        b.release()
        await asyncio.wrap_future(runner._call(lambda: None))  # the releases are done
        return got_a, got_b, first

    try:
        with EngineRunner(engine, batch_window_s=1.0, clock=clock) as runner:
            got_a, got_b, first = asyncio.run(scenario(runner))
            # the first pair: a slot that has never sent holds nobody up, so b's first frame is waited
            # for only if it is in before the runner thread wakes for a's (one step or two)
            assert first in (1, 2)
            if clock == "eager":  # then both are sending: one batched step per frame for both sessions
                assert runner.steps - first == len(frames_a) - 1
            else:  # the first frame after idle is stepped at once, alone; the others tick together
                assert runner.steps <= len(frames_a) + 1
            assert runner.stats.frames_stepped == 2 * len(frames_a)
            assert runner.free_slots == 3
    finally:
        engine.close()
    assert_same(got_a, alone_a)
    assert_same(got_b, alone_b)


@pytest.mark.parametrize("clock", ["eager", "tick"])
def test_a_lone_session_does_not_wait_for_idle_slots(tiny, rng, clock):
    engine = BatchedEngine(tiny, batch_size=2, gen=GREEDY)

    async def scenario(runner: EngineRunner):
        (a, qa), (_b, _) = await open_slot(runner), await open_slot(runner)
        a.push_frame(noise_frames(rng, 1)[0])  # b never sends: a is stepped after the window
        return await asyncio.wait_for(qa.get(), 5)

    try:
        with EngineRunner(engine, batch_window_s=0.01, clock=clock) as runner:
            out = asyncio.run(scenario(runner))
    finally:
        engine.close()
    assert out.frame == 0


def test_bad_frames_are_refused_at_the_door_and_failures_are_contained(tiny, rng, monkeypatch):
    engine = BatchedEngine(tiny, batch_size=1, gen=GREEDY)
    errors: list[BaseException] = []
    outputs = []
    try:
        with EngineRunner(engine, batch_window_s=0.0) as runner:
            handle = runner.acquire(outputs.append, errors.append)
            with pytest.raises(EngineError, match="1920 samples"):
                handle.push_frame(np.zeros(10, dtype=np.float32))
            original = engine.step
            calls = {"n": 0}

            def flaky(frames, timings=None):
                calls["n"] += 1
                if calls["n"] == 1:
                    raise RuntimeError("boom")
                return original(frames, timings)

            monkeypatch.setattr(engine, "step", flaky)
            for frame in noise_frames(rng, 2):
                handle.push_frame(frame)
            asyncio.run(wait_until(lambda: len(outputs) >= 1, "the frame after the failed step"))
            handle.release()
    finally:
        engine.close()
    assert [str(e) for e in errors] == ["boom"]
    assert len(outputs) == 1


def test_pending_frames_are_bounded(tiny):
    engine = BatchedEngine(tiny, batch_size=1, gen=GREEDY)
    try:
        runner = EngineRunner(engine, max_pending_frames=3).start()
        handle = runner.acquire(lambda out: None)
        runner.stop()  # nobody consumes frames any more: the inbox must not grow without bound
        for _ in range(5):
            handle.push_frame(np.zeros(1920, dtype=np.float32))
        assert handle.dropped_frames == 2
        assert len(runner._inboxes[handle.slot].frames) == 3
    finally:
        engine.close()


def test_stopped_runner_refuses_work(tiny):
    engine = BatchedEngine(tiny, batch_size=1, gen=GREEDY)
    try:
        runner = EngineRunner(engine)
        with pytest.raises(EngineError, match="not running"):
            runner.acquire(lambda out: None)
    finally:
        engine.close()


def test_the_runner_decides_on_the_time_source_it_is_given(tiny):
    engine = BatchedEngine(tiny, batch_size=1, gen=GREEDY)
    manual = ManualClock(50.0)  # never advanced: the plan must be on its time, not the thread's clock
    outputs = []
    try:
        with EngineRunner(engine, clock="tick", time_source=manual) as runner:
            handle = runner.acquire(outputs.append)
            handle.push_frame(ZERO)
            asyncio.run(wait_until(lambda: len(outputs) == 1, "the frame (idle: stepped at once)"))
            with runner._cond:
                assert runner._inboxes[handle.slot].last_arrival == 50.0
                # planned on that time: just after the arrival's phase (the margin), a frame on
                assert runner.policy.next_tick == pytest.approx(50.0 + runner.frame_s + runner.policy.margin_s)
            handle.release().result(10)
    finally:
        engine.close()


class _Owner:
    """Records what a handle asks of its runner (the `SlotOwner` calls)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.released: concurrent.futures.Future = concurrent.futures.Future()

    def accept_frame(self, slot: int, frame: Stamped) -> None:
        self.calls.append(("frame", slot, frame.generation))

    def accept_oracle(self, slot: int, update: Stamped) -> None:
        self.calls.append(("oracle", slot, update.generation))

    def count_stale(self) -> None:
        self.calls.append(("stale",))

    def release_slot(self, slot: int, generation: int) -> concurrent.futures.Future:
        self.calls.append(("release", slot, generation))
        return self.released


def test_a_handle_reaches_its_runner_only_through_the_slot_owner_calls():
    owner = _Owner()
    handle = SlotHandle(owner, 2, SlotInbox(7, lambda out: None, None))
    with pytest.raises(EngineError, match="1920 samples"):
        handle.push_frame(np.zeros(10, dtype=np.float32))
    with pytest.raises(EngineError, match="NaN"):
        handle.push_frame(np.full(FRAME_SIZE, np.nan, dtype=np.float32))
    handle.push_frame(ZERO)
    handle.push_oracle(OracleUpdate.reset(0, (10,)))
    assert handle.release() is handle.release() is owner.released  # released once
    handle.push_frame(ZERO)  # refused after the release: counted stale by the owner
    handle.push_oracle(OracleUpdate.reset(1, (11,)))
    assert owner.calls == [("frame", 2, 7), ("oracle", 2, 7), ("release", 2, 7), ("stale",), ("stale",)]


# ------------------------------------------------------------------ slot generations

ZERO = np.zeros(FRAME_SIZE, dtype=np.float32)


def _sync(runner: EngineRunner) -> None:
    """Return once the engine thread has run every command queued before this one."""
    runner._call(lambda: None).result(10)


def _no_oracle(outputs, frontend) -> bool:
    padding = frontend.lm.text_padding_token_id
    return all(out.applied == () and out.oracle_token == padding for out in outputs)


def test_a_released_handle_cannot_reach_the_next_occupant(tiny, rng):
    frames = noise_frames(rng, 4)
    alone = run_alone(tiny, frames, {})
    engine = BatchedEngine(tiny, batch_size=1, gen=GREEDY)
    old_outputs, new_outputs = [], []
    try:
        with EngineRunner(engine, clock="eager", jitter_frames=None) as runner:  # all four frames are stepped
            old = runner.acquire(old_outputs.append)
            old.release()
            old.release()  # idempotent
            new = runner.acquire(new_outputs.append)
            assert (new.slot, old.closed) == (old.slot, True)
            assert new.generation > old.generation
            old.push_oracle(OracleUpdate.reset(0, (10, 11, 12)))  # a late LLM answer: refused, no exception
            old.push_frame(ZERO)
            assert runner.stats.stale_dropped == 2
            runner.release_slot(old.slot, old.generation)  # a release of the old generation frees nothing
            _sync(runner)
            assert runner.free_slots == 0
            for frame in frames:
                new.push_frame(frame)
            asyncio.run(wait_until(lambda: len(new_outputs) == len(frames), "the new occupant's frames"))
            new.release()
    finally:
        engine.close()
    assert old_outputs == []
    assert _no_oracle(new_outputs, tiny)
    assert_same(new_outputs, alone)


def test_an_update_racing_a_release_is_never_applied_to_the_next_occupant(tiny, rng):
    engine = BatchedEngine(tiny, batch_size=1, gen=GREEDY)
    old_outputs, new_outputs = [], []
    gate = concurrent.futures.Future()
    try:
        with EngineRunner(engine) as runner, concurrent.futures.ThreadPoolExecutor(1) as pool:
            old = runner.acquire(old_outputs.append)
            runner._call(lambda: gate.result(10))  # the engine thread is busy while the session leaves
            old.push_frame(ZERO)  # valid when pushed, right before the release
            old.push_oracle(OracleUpdate.reset(0, (10, 11, 12)))
            old.release()
            pending = pool.submit(runner.acquire, new_outputs.append)
            gate.set_result(None)
            new = pending.result(10)
            assert runner.stats.stale_dropped == 2  # left behind at the release, never stepped
            with runner._cond:  # items of the old generation that got into the new inbox anyway
                inbox = runner._inboxes[new.slot]
                inbox.updates.append(Stamped(old.generation, OracleUpdate.reset(1, (20, 21))))
                inbox.frames.append(Stamped(old.generation, ZERO))
                for frame in noise_frames(rng, 3):
                    new.push_frame(frame)
            asyncio.run(wait_until(lambda: len(new_outputs) == 3, "the new occupant's 3 frames"))
            assert runner.stats.stale_dropped == 4  # dropped on the engine thread when the batch was taken
            assert runner.stats.frames_stepped == 3
    finally:
        engine.close()
    assert old_outputs == []
    assert _no_oracle(new_outputs, tiny)


def test_an_acquisition_given_up_by_its_caller_gives_the_slot_back(tiny):
    engine = BatchedEngine(tiny, batch_size=1, gen=GREEDY)
    gate = concurrent.futures.Future()

    async def give_up(runner: EngineRunner) -> None:
        waiting = asyncio.ensure_future(runner.acquire_async(lambda out: None))
        await asyncio.sleep(0)  # one turn of the loop: the acquisition is queued for the busy engine thread
        waiting.cancel()  # the client went away while the engine thread was busy
        with contextlib.suppress(asyncio.CancelledError):
            await waiting

    try:
        with EngineRunner(engine) as runner:
            runner._call(lambda: gate.result(10))
            asyncio.run(give_up(runner))
            with pytest.raises(concurrent.futures.TimeoutError):
                runner.acquire(lambda out: None, timeout=0.05)
            gate.set_result(None)
            for _ in range(2):  # the given-up acquisitions, then the release they queued, have run
                runner._call(lambda: None).result(10)
            assert runner.free_slots == 1
            runner.acquire(lambda out: None).release()  # the slot is usable again
    finally:
        engine.close()


# ------------------------------------------------------------------ the frame clock


async def _realtime_sessions(runner: EngineRunner, count: int, spread_s: float, seconds: float,
                             frame_s: float = 0.08) -> tuple[int, int, list[int]]:
    """`count` sessions pushing a zero frame every `frame_s` on an absolute schedule, `spread_s` apart.

    Returns the steps and stepped frames the runner made for them, and each session's output count,
    once every session has all its frames back but the last.
    """
    loop = asyncio.get_running_loop()
    received = [0] * count

    def receiver(index: int):
        def bump() -> None:
            received[index] += 1
        return lambda out: loop.call_soon_threadsafe(bump)

    handles = [await runner.acquire_async(receiver(i)) for i in range(count)]
    frames = round(seconds / frame_s)
    steps, stepped = runner.stats.steps, runner.stats.frames_stepped
    start = loop.time() + 0.05

    async def session(index: int) -> None:
        for k in range(frames):
            await asyncio.sleep(max(0.0, start + index * spread_s + k * frame_s - loop.time()))  # real time
            handles[index].push_frame(ZERO)

    async with asyncio.TaskGroup() as group:
        for index in range(count):
            group.create_task(session(index), name=f"session-{index}")
    await wait_until(lambda: all(n >= frames - 1 for n in received), "every frame back (the last may be late)")
    for handle in handles:
        assert handle.dropped_frames == 0
        handle.release()
    await asyncio.wrap_future(runner._call(lambda: None))  # the releases are done
    return runner.stats.steps - steps, runner.stats.frames_stepped - stepped, received


@pytest.mark.realtime
@pytest.mark.slow
def test_the_tick_clock_steps_out_of_phase_sessions_together(tiny):
    sessions, seconds, frame_s = 8, 3.0, 0.08
    frames = round(seconds / frame_s)
    engine = BatchedEngine(tiny, batch_size=sessions, gen=GREEDY)
    results = {}
    try:
        for clock in ("tick", "eager"):
            with EngineRunner(engine, clock=clock, torch_threads=1) as runner:
                results[clock] = asyncio.run(_realtime_sessions(runner, sessions, 0.01, seconds, frame_s))
    finally:
        engine.close()
    steps, stepped, _ = results["tick"]  # every frame came back, but maybe the last (_realtime_sessions)
    assert steps / (frames * frame_s) < 14  # ~12.5 per second of audio: one step per frame for all eight
    assert stepped / steps >= 7
    eager_steps, _, _ = results["eager"]
    assert eager_steps > 1.3 * steps  # arrival-driven: out-of-phase sessions get separate steps


@pytest.mark.realtime
def test_the_tick_clock_sleeps_while_idle_and_steps_at_once_when_work_arrives(tiny):
    engine = BatchedEngine(tiny, batch_size=2, gen=GREEDY)
    arrivals: list[float] = []
    waits: list[float | None] = []
    step_starts: list[float] = []  # when each step began: a step after idle can itself take 50 ms on this VM
    step = engine.step
    engine.step = lambda *args, **kwargs: (step_starts.append(time.monotonic()), step(*args, **kwargs))[1]
    try:
        runner = EngineRunner(engine, clock="tick")
        original_wait = runner._cond.wait

        def counting_wait(timeout=None):
            waits.append(timeout)
            return original_wait(timeout)

        runner._cond.wait = counting_wait
        with runner:
            handle = runner.acquire(lambda out: arrivals.append(time.monotonic()))
            handle.push_frame(ZERO)
            asyncio.run(wait_until(lambda: len(arrivals) == 1, "the first frame"))
            # the sleeps are the test: the engine idles while no frame comes, and must not wake up
            time.sleep(0.15)  # past the next tick: the engine thread is in its idle wait
            waits.clear()
            time.sleep(0.5)  # idle for over 6 ticks (ending ~15 ms past a point of the old grid)
            idle_waits = len(waits)
            pushed = time.monotonic()
            handle.push_frame(ZERO)
            asyncio.run(wait_until(lambda: len(arrivals) == 2, "the frame after the idle time"))
            handle.release()
    finally:
        engine.close()
    assert idle_waits == 0  # no periodic wake-ups while no slot has a frame
    assert step_starts[-1] - pushed < 0.04  # the first frame after idle is stepped at once, not at the next tick


@pytest.mark.realtime
@pytest.mark.parametrize(("clock", "jitter"), [("tick", 3), ("eager", 3), ("eager", None)])
def test_a_backlog_skips_to_live_and_is_caught_up_at_once(tiny, monkeypatch, clock, jitter):
    engine = BatchedEngine(tiny, batch_size=1, gen=GREEDY)
    original = engine.step
    stepped: list[float] = []  # the marker sample of every frame stepped
    step_starts: list[float] = []  # when each step began: a step after idle can itself take 50 ms on this VM

    def recording(frames, timings=None):
        step_starts.append(time.monotonic())
        stepped.extend(float(frame[0]) for frame in frames.values())
        return original(frames, timings)

    monkeypatch.setattr(engine, "step", recording)
    arrivals: list[float] = []
    try:
        with EngineRunner(engine, clock=clock, jitter_frames=jitter) as runner:
            handle = runner.acquire(lambda out: arrivals.append(time.monotonic()))
            with runner._cond:  # 20 frames at once, as after a stall of the network or of the engine
                for index in range(20):
                    handle.push_frame(np.full(FRAME_SIZE, index / 100, dtype=np.float32))
            expected = 3 if jitter else 20
            asyncio.run(wait_until(lambda: len(arrivals) == expected, f"{expected} frames of the backlog"))
            time.sleep(0.2)  # the test: the backlog is over and the engine idles; then a frame comes live
            skipped = runner.stats.skipped_frames
            late = time.monotonic()
            handle.push_frame(np.full(FRAME_SIZE, 0.5, dtype=np.float32))  # live again: stepped at once
            asyncio.run(wait_until(lambda: len(arrivals) == expected + 1, "the live frame"))
            handle.release()
    finally:
        engine.close()
    if jitter:
        assert stepped[:3] == pytest.approx([0.17, 0.18, 0.19])  # cut to the 3 newest ...
        assert skipped == handle.dropped_frames == 17  # (then stepped back to back: tests/test_tick_schedule.py)
    else:  # nothing may be lost (kyutai-stt's runner): every frame, in order
        assert stepped[:20] == pytest.approx([index / 100 for index in range(20)])
        assert skipped == handle.dropped_frames == 0
    assert step_starts[-1] - late < 0.04  # the live frame is stepped at once


def overrun_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "overruns so far" in r.getMessage()]


def stalling_engine(frontend, monkeypatch, seconds: float) -> tuple[BatchedEngine, dict]:
    """A one-slot engine whose next `stall["steps"]` steps each sleep `seconds` first."""
    engine = BatchedEngine(frontend, batch_size=1, gen=GREEDY)
    original = engine.step
    stall = {"steps": 0}

    def stalling(frames, timings=None):
        if stall["steps"] > 0:
            stall["steps"] -= 1
            time.sleep(seconds)
        return original(frames, timings)

    monkeypatch.setattr(engine, "step", stalling)
    return engine, stall


@pytest.mark.realtime
def test_an_overloaded_engine_skips_missed_ticks_instead_of_catching_up(tiny, monkeypatch, caplog):
    engine, stall = stalling_engine(tiny, monkeypatch, 0.2)  # 2.5 frames
    steps: list[tuple[float, float]] = []  # (end time, duration) of every step

    async def feed(handle, frames: int = 20, frame_s: float = 0.08) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        for k in range(frames):
            await asyncio.sleep(max(0.0, start + k * frame_s - loop.time()))  # real time
            if k == 5:
                stall["steps"] = 3
            handle.push_frame(ZERO)
        await wait_until(lambda: runner.stats.frames_stepped + handle.dropped_frames >= frames,
                         "every frame stepped or skipped")

    caplog.set_level(logging.WARNING, logger="kame.frontend.runner")
    try:
        with EngineRunner(engine, on_step=lambda s, n: steps.append((time.monotonic(), s))) as runner:
            handle = runner.acquire(lambda out: None)
            asyncio.run(feed(handle))
            handle.release()
            stats = runner.stats
    finally:
        engine.close()
    slow_ends = [end for end, seconds in steps if seconds >= 0.2]
    assert len(slow_ends) == 3
    assert stats.overruns >= 3
    after = [end for end, _ in steps if slow_ends[-1] < end <= slow_ends[-1] + 0.06]
    # the backlog left after skipping to live (at most jitter_frames) is stepped at once, no more ...
    assert len(after) <= runner.jitter_frames + 1
    # (0.2 s on: on a loaded machine the backlog's steps, back to back, once ran past 0.1 s)
    later = [end for end, _ in steps if slow_ends[-1] + 0.2 < end <= slow_ends[-1] + 0.6]
    assert len(later) <= 6, [round(end - slow_ends[-1], 3) for end, _ in steps if end > slow_ends[-1]]
    # ... then one step per frame: the missed ticks are not caught up
    assert stats.skipped_frames == handle.dropped_frames
    assert len(overrun_warnings(caplog)) == 1  # once, then at most once a minute


def test_warm_up_steps_are_not_overruns_and_later_slow_steps_are(tiny, monkeypatch, caplog):
    """The first steps pay CUDA graph capture and compilation (about 20 s on the 7B, GPU run of
    2026-12-04): warm-up neither counts them nor warns of an overloaded engine; a slow step after it does."""
    engine, slow = stalling_engine(tiny, monkeypatch, 0.1)  # longer than the 80 ms frame, whatever the load
    slow["steps"] = 2
    caplog.set_level(logging.WARNING, logger="kame.frontend.runner")
    try:
        with EngineRunner(engine) as runner:
            assert runner.warm_up(frames=2) == 2
            assert runner.stats.overruns == 0
            assert not overrun_warnings(caplog)
            slow["steps"] = 1
            done = threading.Event()
            handle = runner.acquire(lambda out: done.set())
            handle.push_frame(ZERO)
            assert done.wait(30)
            handle.release().result(30)
            assert runner.stats.overruns == 1
    finally:
        engine.close()
    assert len(overrun_warnings(caplog)) == 1
