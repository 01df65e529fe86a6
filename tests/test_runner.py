"""The engine thread: asyncio sessions push frames, outputs come back, slots are batched and freed."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kame.errors import EngineError
from kame.frontend.engine import BatchedEngine, GenerationConfig
from kame.frontend.oracle import OracleUpdate
from kame.frontend.runner import EngineRunner

from .conftest import noise_frames
from .test_engine import assert_same, run_alone

GREEDY = GenerationConfig(use_sampling=False)


async def open_slot(runner: EngineRunner):
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    handle = await runner.acquire_async(lambda out: loop.call_soon_threadsafe(queue.put_nowait, out))
    return handle, queue


def test_two_async_sessions_are_stepped_together(tiny, rng):
    frames_a, frames_b = noise_frames(rng, 8), noise_frames(rng, 8)
    alone_a = run_alone(tiny, frames_a, {0: OracleUpdate.reset(0, (10, 11, 12))})
    alone_b = run_alone(tiny, frames_b, {})
    engine = BatchedEngine(tiny, batch_size=3, gen=GREEDY)

    async def scenario(runner: EngineRunner):
        (a, qa), (b, qb) = await open_slot(runner), await open_slot(runner)
        assert runner.free_slots == 1
        a.push_oracle(OracleUpdate.reset(0, (10, 11, 12)))
        got_a, got_b = [], []
        for fa, fb in zip(frames_a, frames_b, strict=True):
            a.push_frame(fa)
            b.push_frame(fb)
            got_a.append(await asyncio.wait_for(qa.get(), 10))
            got_b.append(await asyncio.wait_for(qb.get(), 10))
        a.release()
        b.release()
        await asyncio.sleep(0.05)
        return got_a, got_b

    try:
        with EngineRunner(engine, batch_window_s=1.0) as runner:
            got_a, got_b = asyncio.run(scenario(runner))
            assert runner.steps == len(frames_a)  # one batched step per frame for both sessions
            assert runner.free_slots == 3
    finally:
        engine.close()
    assert_same(got_a, alone_a)
    assert_same(got_b, alone_b)


def test_a_lone_session_does_not_wait_for_idle_slots(tiny, rng):
    engine = BatchedEngine(tiny, batch_size=2, gen=GREEDY)

    async def scenario(runner: EngineRunner):
        (a, qa), (_b, _) = await open_slot(runner), await open_slot(runner)
        a.push_frame(noise_frames(rng, 1)[0])  # b never sends: a is stepped after the window
        return await asyncio.wait_for(qa.get(), 5)

    try:
        with EngineRunner(engine, batch_window_s=0.01) as runner:
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
            deadline = asyncio.run(_wait_for(lambda: len(outputs) >= 1))
            assert deadline
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


async def _wait_for(predicate, limit_s: float = 10.0) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while loop.time() < end:
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return False


def test_stopped_runner_refuses_work(tiny):
    engine = BatchedEngine(tiny, batch_size=1, gen=GREEDY)
    try:
        runner = EngineRunner(engine)
        with pytest.raises(EngineError, match="not running"):
            runner.acquire(lambda out: None)
    finally:
        engine.close()
