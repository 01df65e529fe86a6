"""The batched engine: slots are independent, paused slots resume exactly, reused slots start clean."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kame.errors import EngineError
from kame.frontend.engine import BatchedEngine, GenerationConfig
from kame.frontend.oracle import OracleUpdate

from .conftest import noise_frames

GREEDY = GenerationConfig(use_sampling=False)


def run_alone(frontend, frames, oracle_at: dict[int, OracleUpdate], kv_cache: str = "model") -> list:
    engine = BatchedEngine(frontend, batch_size=1, gen=GREEDY, kv_cache=kv_cache)
    try:
        slot = engine.acquire()
        outs = []
        for index, frame in enumerate(frames):
            if index in oracle_at:
                engine.push_oracle(slot, oracle_at[index])
            outs.extend(engine.step({slot: frame}))
        return outs
    finally:
        engine.close()


def assert_same(got, want):
    assert [o.text_token for o in got] == [o.text_token for o in want]
    assert [o.audio_ready for o in got] == [o.audio_ready for o in want]
    np.testing.assert_allclose(np.stack([o.pcm for o in got]), np.stack([o.pcm for o in want]), atol=1e-5)


def test_two_slots_equal_running_alone(tiny, rng):
    frames_a, frames_b = noise_frames(rng, 12), noise_frames(rng, 12, scale=0.3)
    oracle_a = {0: OracleUpdate.reset(0, (10, 11, 12, 13))}
    oracle_b = {3: OracleUpdate.reset(0, (40, 41)), 6: OracleUpdate.append(0, (42, 43))}
    alone_a = run_alone(tiny, frames_a, oracle_a)
    alone_b = run_alone(tiny, frames_b, oracle_b)

    engine = BatchedEngine(tiny, batch_size=4, gen=GREEDY)
    try:
        a, b = engine.acquire(), engine.acquire()
        got_a, got_b = [], []
        for index in range(12):
            for slot, schedule in ((a, oracle_a), (b, oracle_b)):
                if index in schedule:
                    engine.push_oracle(slot, schedule[index])
            outs = {o.slot: o for o in engine.step({a: frames_a[index], b: frames_b[index]})}
            got_a.append(outs[a])
            got_b.append(outs[b])
    finally:
        engine.close()
    assert_same(got_a, alone_a)
    assert_same(got_b, alone_b)
    assert [o.text_token for o in alone_a] != [o.text_token for o in alone_b]  # the slots really differ


def test_paused_slot_resumes_as_if_alone(tiny, rng):
    frames_a, frames_b = noise_frames(rng, 10), noise_frames(rng, 10)
    alone_a = run_alone(tiny, frames_a, {1: OracleUpdate.reset(0, (7, 8, 9))})
    engine = BatchedEngine(tiny, batch_size=2, gen=GREEDY)
    try:
        a, b = engine.acquire(), engine.acquire()
        got_a, next_a = [], 0
        for index in range(10):
            feed = {b: frames_b[index]}
            if index % 3 != 2:  # slot a misses every third tick: it is paused, not stepped
                if next_a == 1:
                    engine.push_oracle(a, OracleUpdate.reset(0, (7, 8, 9)))
                feed[a] = frames_a[next_a]
                next_a += 1
            got_a.extend(o for o in engine.step(feed) if o.slot == a)
        assert engine.frame_index(a) == next_a
        assert engine._state.offsets.tolist() == [engine.frame_index(a), engine.frame_index(b)]
    finally:
        engine.close()
    assert_same(got_a, alone_a[:next_a])


def test_released_slot_starts_clean(tiny, rng):
    frames = noise_frames(rng, 8)
    fresh = run_alone(tiny, frames, {})
    engine = BatchedEngine(tiny, batch_size=1, gen=GREEDY)
    try:
        slot = engine.acquire()
        engine.push_oracle(slot, OracleUpdate.reset(0, (10, 11, 12)))
        for frame in noise_frames(rng, 5, scale=0.5):
            engine.step({slot: frame})
        engine.push_oracle(slot, OracleUpdate.reset(1, (50, 51)))  # pending at release: must not leak
        engine.release(slot)
        again = engine.acquire()
        assert again == slot
        got = [engine.step({again: f})[0] for f in frames]
    finally:
        engine.close()
    assert all(o.oracle_token == 3 for o in got)
    assert_same(got, fresh)


def test_first_frame_has_no_audio_yet(tiny, rng):
    outs = run_alone(tiny, noise_frames(rng, 3), {})
    assert [o.audio_ready for o in outs] == [False, True, True]
    assert not outs[0].pcm.any() and outs[1].pcm.any()
    assert [o.frame for o in outs] == [0, 1, 2]


def test_slot_errors_are_clear(tiny):
    engine = BatchedEngine(tiny, batch_size=1, gen=GREEDY)
    try:
        slot = engine.acquire()
        with pytest.raises(EngineError, match="all 1 slots"):
            engine.acquire()
        with pytest.raises(EngineError, match="1920 samples"):
            engine.step({slot: np.zeros(100, dtype=np.float32)})
        engine.release(slot)
        with pytest.raises(EngineError, match="not acquired"):
            engine.step({slot: np.zeros(1920, dtype=np.float32)})
        with pytest.raises(EngineError, match="not acquired"):
            engine.push_oracle(slot, OracleUpdate.reset(0))
    finally:
        engine.close()
    with pytest.raises(EngineError):
        BatchedEngine(tiny, batch_size=0)


def test_timings_cover_each_phase(tiny, rng):
    engine = BatchedEngine(tiny, batch_size=2, gen=GREEDY)
    try:
        slot = engine.acquire()
        timings: dict[str, float] = {}
        for frame in noise_frames(rng, 3):
            engine.step({slot: frame}, timings=timings)
        assert set(timings) == {"encode", "lm", "decode"} and all(v > 0 for v in timings.values())
    finally:
        engine.close()


def test_sampling_defaults_come_from_the_checkpoint(tiny):
    assert GenerationConfig.from_dict({"use_sampling": False, "temp": 0.5, "unknown": 1}) == GenerationConfig(
        use_sampling=False, temp=0.5)
    engine = BatchedEngine(tiny, batch_size=1)
    try:
        assert engine.gen.use_sampling is False  # the tiny preset is greedy
    finally:
        engine.close()
    assert torch.is_grad_enabled()
