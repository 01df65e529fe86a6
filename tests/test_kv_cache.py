"""The int8 KV cache: moshi's ring and positions exactly, values within their quantisation step, and an
engine on it that batches, compacts and follows its oracle as the model-dtype cache does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from moshi.modules.transformer import RingKVCache

from kame.frontend.engine import BatchedEngine
from kame.frontend.kv_cache import Int8RingKVCache, kv_bytes_per_slot, quantize
from kame.frontend.oracle import OracleUpdate, tokenize_words

from .conftest import noise_frames
from .test_engine import GREEDY, assert_same, run_alone


@pytest.mark.parametrize("respect_exec_mask", [True, False])
def test_the_ring_and_its_positions_are_moshis(respect_exec_mask):
    """Step both caches through the same writes, masked rows and wraps included (capacity 7, 30 steps of
    1-3 positions): positions equal exactly, values within half a quantisation step."""
    generator = torch.Generator().manual_seed(0)
    batch, heads, dim, capacity = 3, 2, 8, 7
    moshi = RingKVCache(batch, heads, dim, capacity, respect_exec_mask, torch.device("cpu"), torch.float32)
    ours = Int8RingKVCache.like(moshi)
    for step in range(30):
        steps = 1 + step % 3
        k = torch.randn(batch, heads, steps, dim, generator=generator)
        v = torch.randn(batch, heads, steps, dim, generator=generator) * 5
        mask = torch.rand(batch, generator=generator) > 0.3
        want, got = moshi.complete(k, v, mask), ours.complete(k, v, mask)
        assert torch.equal(got.positions, want.positions), f"step {step}"
        assert torch.equal(ours.end_offset, moshi.end_offset)
        valid = (want.positions >= 0)[:, None, :, None]
        for mine, theirs in ((got.keys, want.keys), (got.values, want.values)):
            step_size = theirs.abs().amax(-1, keepdim=True) / 127
            error = torch.where(valid, (mine - theirs).abs(), torch.zeros_like(mine))
            assert (error <= step_size / 2 + 1e-6).all(), f"step {step}"


def test_quantize_keeps_zero_and_the_extremes():
    values = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5], [-3.0, 3.0, 0.0]])
    quantized, scale = quantize(values)
    assert quantized.dtype == torch.int8
    assert quantized[0].tolist() == [0, 0, 0] and scale[0].item() == 1.0
    assert quantized[1].tolist() == [64, -127, 32] and quantized[2].tolist() == [-127, 127, 0]
    torch.testing.assert_close(quantized.float() * scale, values, atol=2 / 254, rtol=0)


def test_an_int8_slot_holds_about_half_the_bytes(tiny):
    model, int8 = kv_bytes_per_slot(tiny.lm, "model"), kv_bytes_per_slot(tiny.lm, "int8")
    attention = tiny.lm.transformer.layers[0].self_attn
    assert model == 2 * len(tiny.lm.transformer.layers) * attention.embed_dim * attention.context * 4  # float32
    assert int8 / model == pytest.approx((1 + 4 / 16) / 4)  # 1 byte a value, a float32 scale per 16-dim head
    engine = BatchedEngine(tiny, batch_size=2, gen=GREEDY, kv_cache="int8")
    try:
        caches = [layer.self_attn._streaming_state.kv_cache for layer in tiny.lm.transformer.layers]
        assert all(isinstance(cache, Int8RingKVCache) for cache in caches)
        held = sum(cache.cache.nbytes + cache.scale.nbytes for cache in caches)
        assert held == 2 * int8
    finally:
        engine.close()
    assert not isinstance(tiny.lm.transformer.layers[0].self_attn._init_streaming_state(1).kv_cache,
                          Int8RingKVCache)  # the model's own method again once the engine has its caches


def _run(frontend, frames, schedule, kv_cache, leave_at=None):
    """Slots a and b on a 3-slot engine; a leaves at `leave_at` (b's row then moves into its hole)."""
    engine = BatchedEngine(frontend, batch_size=3, gen=GREEDY, kv_cache=kv_cache)
    got = {"a": [], "b": []}
    try:
        slots = {"a": engine.acquire(), "b": engine.acquire()}
        for tick in range(len(frames["b"])):
            if tick == leave_at:
                engine.release(slots.pop("a"))
            for name, slot in slots.items():
                if engine.frame_index(slot) in schedule.get(name, {}):
                    engine.push_oracle(slot, schedule[name][engine.frame_index(slot)])
            for out in engine.step({slot: frames[name][tick] for name, slot in slots.items()}):
                got[next(n for n, s in slots.items() if s == out.slot)].append(out)
    finally:
        engine.close()
    return got


def test_an_int8_session_batches_and_moves_as_if_alone(tiny, rng):
    """Quantisation is per row: b beside a, then moved into a's row, equals b alone on int8."""
    frames = {"a": noise_frames(rng, 20), "b": noise_frames(rng, 20, scale=0.4)}
    schedule = {"b": {2: OracleUpdate.reset(0, (30, 31, 32))}}
    together = _run(tiny, frames, schedule, "int8", leave_at=8)
    assert_same(together["b"], run_alone(tiny, frames["b"], schedule["b"], "int8"))


def test_tiny_copy_speaks_its_oracle_past_the_context_on_int8(tiny_copy, rng):
    """tiny-copy copies its oracle into its text; with the int8 cache it still does, 4 contexts in."""
    tokens = tuple(tokenize_words(tiny_copy.tokenizer, "Paris is the capital of France"))
    late = 4 * tiny_copy.lm.transformer.layers[0].self_attn.context
    frames = {"a": noise_frames(rng, late + 20), "b": noise_frames(rng, late + 20)}
    schedule = {"b": {5: OracleUpdate.reset(0, tokens), late: OracleUpdate.reset(1, tokens)}}
    model = _run(tiny_copy, frames, schedule, "model")["b"]
    int8 = _run(tiny_copy, frames, schedule, "int8")["b"]

    def spoken(outs, frame):
        return [o.text_token for o in outs[frame: frame + len(tokens) + 3] if o.text_token is not None]

    assert spoken(model, late) == spoken(model, 5) == list(tokens)
    assert spoken(int8, 5) == spoken(int8, late) == list(tokens)
    agreement = np.mean([a.text_token == b.text_token for a, b in zip(model, int8, strict=True)])
    assert agreement > 0.9
