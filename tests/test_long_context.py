"""Sessions longer than the attention context: the ring KV caches wrap and every slot keeps working.

The tiny presets' LM attends to its last 40 frames (Moshi 7B: 3000, 4 minutes) and their Mimi
transformers to their last 50 steps at 25 Hz (2 s). One batched scenario, run once per preset:
slot A runs 260 ticks (6.5 LM contexts) and misses a few ticks past its context; slot B's first
occupant runs past its context and leaves, and a new occupant joins at tick 100 (a reset while A
is past its context). Each slot equals stepping it alone, and with tiny-copy an oracle reset long
past the context is copied into the text exactly as the same oracle at frame 5.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from moshi.modules.rope import apply_rope
from moshi.utils.compile import no_compile

from kame.frontend.engine import BatchedEngine, FrameOutput
from kame.frontend.loader import Frontend
from kame.frontend.oracle import OracleUpdate, tokenize_words

from .conftest import noise_frames
from .test_engine import GREEDY, assert_same, run_alone

LM_CONTEXT, MIMI_CONTEXT = 40, 50  # the tiny presets', checked below against the loaded modules
TICKS = 260
A_SKIPS = frozenset({150, 151, 175})  # ticks slot A has no frame: paused with a wrapped ring
B_FIRST_LEAVES, B_JOINS = 70, 100  # B's first occupant: ticks [0, 70); the next from tick 100
EARLY, LATE_A, LATE_B = 5, 200, 130  # slot frames at which an oracle reset is pushed


@dataclass
class LongRun:
    tokens: dict[int, tuple[int, ...]]  # slot -> the oracle's tokens (after the start token)
    got: dict[int, list[FrameOutput]] = field(default_factory=dict)  # of B: its second occupant
    alone: dict[int, list[FrameOutput]] = field(default_factory=dict)
    frames_seen: list[tuple[dict[int, int], dict[int, int]]] = field(default_factory=list)
    ring_offsets: dict[str, list[int]] = field(default_factory=dict)  # after the last tick


def oracle_schedule(tokens: tuple[int, ...], *frames: int) -> dict[int, OracleUpdate]:
    """The same oracle reset at each of `frames` (slot frames), one epoch each."""
    return {frame: OracleUpdate.reset(epoch, tokens) for epoch, frame in enumerate(frames)}


@contextlib.contextmanager
def _one_thread():
    """The tiny models gain nothing from intra-op threads, and 2-thread OpenMP runs ~20x slower
    when another process shares the 2 cores (measured: 100 batched steps 0.8 s vs 15-20 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def copy_run(tiny_copy) -> LongRun:
    return _long_run(tiny_copy)


@pytest.fixture(scope="module")
def random_run(tiny) -> LongRun:
    """The same scenario with random weights: their text and audio follow every bit of the LM's
    state (tiny-copy's follow mostly its oracle), so a state that drifts from running alone shows."""
    return _long_run(tiny)


@pytest.fixture(scope="module", params=["random_run", "copy_run"])
def long_run(request) -> LongRun:
    return request.getfixturevalue(request.param)


def _long_run(frontend: Frontend) -> LongRun:
    with _one_thread():
        return _run_scenario(frontend)


def _run_scenario(frontend: Frontend) -> LongRun:
    rng = np.random.default_rng(2026)
    frames = {0: noise_frames(rng, TICKS), 1: noise_frames(rng, TICKS - B_JOINS, scale=0.3)}
    first_b = noise_frames(rng, B_FIRST_LEAVES, scale=0.2)
    words = {0: "Paris is the capital of France", 1: "Spiders have eight legs"}
    run = LongRun({slot: tuple(tokenize_words(frontend.tokenizer, text)) for slot, text in words.items()})
    schedules = {0: oracle_schedule(run.tokens[0], EARLY, LATE_A),
                 1: oracle_schedule(run.tokens[1], EARLY, LATE_B)}
    first_schedule = oracle_schedule(tuple(tokenize_words(frontend.tokenizer, "How many legs")), 3)
    engine = BatchedEngine(frontend, batch_size=2, gen=GREEDY)
    try:
        a, b = engine.acquire(), engine.acquire()
        assert (a, b) == (0, 1)
        run.got = {a: [], b: []}
        for tick in range(TICKS):
            if tick == B_FIRST_LEAVES:
                engine.release(b)
            if tick == B_JOINS:
                assert engine.acquire() == b  # reset_streaming(mask) while A is past its context
            feed = {}
            if tick not in A_SKIPS:
                feed[a] = _next_frame(engine, a, frames[a], schedules[a])
            if tick < B_FIRST_LEAVES:
                feed[b] = _next_frame(engine, b, first_b, first_schedule)
            elif tick >= B_JOINS:
                feed[b] = _next_frame(engine, b, frames[b], schedules[b])
            expected = {slot: engine.frame_index(slot) for slot in feed}
            outs = engine.step(feed)
            run.frames_seen.append((expected, {o.slot: o.frame for o in outs}))
            for out in outs:
                if out.slot == a or tick >= B_JOINS:
                    run.got[out.slot].append(out)
        run.ring_offsets = {
            "frames": [engine.frame_index(a), engine.frame_index(b)],
            "lm_gen": engine._state.offsets.tolist(),
            "lm_kv": _kv_end_offset(frontend.lm.transformer),
            "mimi_kv": _kv_end_offset(frontend.mimi.encoder_transformer.transformer),
        }
    finally:
        engine.close()
    for slot in (a, b):
        run.alone[slot] = run_alone(frontend, frames[slot][: len(run.got[slot])], schedules[slot])
    return run


def _next_frame(engine: BatchedEngine, slot: int, frames: list[np.ndarray], schedule: dict) -> np.ndarray:
    frame = engine.frame_index(slot)
    if frame in schedule:
        engine.push_oracle(slot, schedule[frame])
    return frames[frame]


def _kv_end_offset(transformer) -> list[int]:
    return transformer.layers[0].self_attn._streaming_state.kv_cache.end_offset.tolist()


def _contexts(transformer) -> set:
    return {layer.self_attn.context for layer in transformer.layers}


@pytest.mark.parametrize("name", ["tiny", "tiny_copy"])
def test_the_presets_have_short_contexts(request, name):
    frontend = request.getfixturevalue(name)
    assert _contexts(frontend.lm.transformer) == {LM_CONTEXT}
    assert _contexts(frontend.mimi.encoder_transformer.transformer) == {MIMI_CONTEXT}
    assert _contexts(frontend.mimi.decoder_transformer.transformer) == {MIMI_CONTEXT}


@pytest.mark.slow
def test_the_run_goes_far_past_every_context(long_run):
    frames = long_run.ring_offsets["frames"]
    assert frames == [TICKS - len(A_SKIPS), TICKS - B_JOINS]
    assert frames[0] >= 6 * LM_CONTEXT and frames[1] >= 4 * LM_CONTEXT
    # per-slot offsets keep growing past the ring's capacity; the ring index is offset % capacity
    assert long_run.ring_offsets["lm_gen"] == frames
    assert long_run.ring_offsets["lm_kv"] == frames
    assert long_run.ring_offsets["mimi_kv"] == [2 * f for f in frames]  # Mimi's transformer: 25 Hz


@pytest.mark.slow
def test_every_stepped_slot_gets_its_next_frame_each_tick(long_run):
    assert len(long_run.frames_seen) == TICKS
    for tick, (expected, got) in enumerate(long_run.frames_seen):
        assert got == expected, f"tick {tick}"


@pytest.mark.slow
def test_audio_stays_finite_and_alive(long_run):
    for outs in long_run.got.values():
        assert [o.audio_ready for o in outs] == [False] + [True] * (len(outs) - 1)
        pcm = np.stack([o.pcm for o in outs[1:]])
        assert np.isfinite(pcm).all()
        assert (np.abs(pcm[2 * LM_CONTEXT:]).max(axis=1) > 0).all()  # not silenced past the context


@pytest.mark.slow
def test_batched_equals_alone_past_the_context(long_run):
    for slot, outs in long_run.got.items():
        assert_same(outs, long_run.alone[slot])


@pytest.mark.slow
@pytest.mark.parametrize(("slot", "late"), [(0, LATE_A), (1, LATE_B)])
def test_oracle_reset_past_the_context_is_copied_as_at_the_start(tiny_copy, copy_run, slot, late):
    tokens, outs = copy_run.tokens[slot], copy_run.got[slot]
    start, padding = tiny_copy.lm.text_initial_token_id, tiny_copy.lm.text_padding_token_id
    span = len(tokens) + 3

    def window(frame: int) -> tuple[list[int], list[int | None]]:
        outs_after = outs[frame: frame + span]
        return [o.oracle_token for o in outs_after], [o.text_token for o in outs_after]

    assert late > 3 * LM_CONTEXT
    assert window(EARLY)[0] == window(late)[0] == [start, *tokens, padding, padding]
    # tiny-copy answers the start token with padding, and LMGen returns each text token one
    # frame later (its max delay): the copy starts two frames after the reset
    assert window(EARLY)[1] == window(late)[1] == [None, None, *tokens, None]


def test_rope_scores_stay_relative_an_hour_in():
    """Attention scores depend on positions only through q - k: an hour in (Mimi's transformer at
    25 Hz: 90,000 steps; the LM: 45,000), float32 rope drifts by less than bf16 rounds them."""
    torch.manual_seed(0)
    heads, dim, context = 4, 128, 3000  # Moshi 7B: head dim 128, context 3000
    q, k = torch.randn(1, heads, 1, dim), torch.randn(1, heads, context, dim)

    def scores(start: int) -> torch.Tensor:  # the query at the newest position of the window
        q_rot, _ = apply_rope(q, q, torch.tensor([start + context - 1]))
        _, k_rot = apply_rope(k, k, torch.tensor([start]))
        return (q_rot @ k_rot.transpose(-1, -2)) / math.sqrt(dim)

    with no_compile():
        near, hour = scores(0), scores(90_000)
    drift = (hour - near).abs().max().item()
    bf16_step = near.abs().max().item() * 2**-8  # bf16 keeps 8 bits of mantissa
    assert drift < bf16_step
