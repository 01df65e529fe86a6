"""Per-session sampling: each slot's temperature, top-k, repetition penalty and padding bias, in one batch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kame.frontend.engine import BatchedEngine, GenerationConfig
from kame.frontend.oracle import OracleUpdate
from kame.frontend.sampling import Sampling, _shape

from .conftest import noise_frames

SAMPLED = GenerationConfig(use_sampling=True)
GREEDY = GenerationConfig(use_sampling=False)
FRAMES = 16


def test_shaping_keeps_each_rows_top_k_and_greedy_rows_their_best():
    rows = torch.tensor([[0.1, 3.0, 2.0, -1.0, 0.5]] * 4)
    temperature = torch.tensor([1.0, 0.5, 0.0, 2.0])
    topk = torch.tensor([2, 3, 40, 0])
    shaped = _shape(rows, temperature, topk, deepest=40)
    kept = torch.isfinite(shaped)
    assert kept.sum(dim=1).tolist() == [2, 3, 1, 5]  # top-2, top-3, greedy keeps one, 0 keeps all
    assert kept[0].tolist() == [False, True, True, False, False]
    assert kept[2].tolist() == [False, True, False, False, False]
    assert shaped[1, 1].item() == pytest.approx(6.0)  # divided by its temperature
    assert shaped[3, 1].item() == pytest.approx(1.5)


def test_settings_come_from_query_strings_with_clear_errors():
    base = Sampling.of(GenerationConfig(temp=0.6, temp_text=0.5, top_k=100, top_k_text=10))
    assert (base.audio_temperature, base.text_temperature, base.audio_topk, base.text_topk) == (0.6, 0.5, 100, 10)
    got = base.updated({"text_temperature": "0.9", "audio_topk": "20", "pad_mult": "-1.5"})
    assert (got.text_temperature, got.audio_topk, got.pad_mult, got.text_topk) == (0.9, 20, -1.5, 10)
    for bad, message in (({"text_topk": "2.5"}, "text_topk must be an integer"),
                         ({"audio_temperature": "hot"}, "audio_temperature must be a number"),
                         ({"text_temperature": "nan"}, "text_temperature must be between"),
                         ({"repetition_penalty": "0.5"}, "repetition_penalty must be between 1.0"),
                         ({"audio_topk": "5000"}, "audio_topk must be between 0 and 1000"),
                         ({"top_p": "0.9"}, "unknown sampling setting 'top_p'")):
        with pytest.raises(ValueError, match=message):
            base.updated(bad)


def run(frontend, gen, settings: list[Sampling | None], frames, oracle=None, audio_tokens=None):
    """Step one engine with a slot per entry of `settings`; each slot's outputs, in order.

    `audio_tokens`, a list: each step's audio tokens [slots, codebooks] are appended to it."""
    engine = BatchedEngine(frontend, batch_size=len(settings), gen=gen)
    if audio_tokens is not None:
        engine.lm_gen.on_audio_hook = lambda tokens: audio_tokens.append(tokens.clone())
    try:
        slots = [engine.acquire(sampling) for sampling in settings]
        outputs: dict[int, list] = {slot: [] for slot in slots}
        for index, frame in enumerate(frames):
            if index == 0 and oracle:
                for slot in slots:
                    engine.push_oracle(slot, oracle)
            for out in engine.step({slot: frame for slot in slots}):
                outputs[out.slot].append(out)
        return [outputs[slot] for slot in slots]
    finally:
        engine.close()


def tokens(outputs) -> list[int | None]:
    return [o.text_token for o in outputs]


def test_a_greedy_session_beside_a_hot_one_equals_a_greedy_engine(tiny, rng):
    frames = noise_frames(rng, FRAMES)
    greedy = Sampling(text_temperature=0.0, audio_temperature=0.0)
    hot = Sampling(text_temperature=5.0, text_topk=0, audio_temperature=5.0, audio_topk=0)
    torch.manual_seed(0)
    audio, reference_audio = [], []
    cold, warm = run(tiny, SAMPLED, [greedy, hot], frames, audio_tokens=audio)
    (reference,) = run(tiny, GREEDY, [None], frames, audio_tokens=reference_audio)
    assert tokens(cold) == tokens(reference)
    assert torch.equal(torch.stack(audio)[:, 0], torch.stack(reference_audio)[:, 0])  # the depformer's too
    np.testing.assert_allclose(np.stack([o.pcm for o in cold]), np.stack([o.pcm for o in reference]), atol=1e-5)
    assert tokens(warm) != tokens(reference)  # the hot neighbour really sampled, text ...
    assert not torch.equal(torch.stack(audio)[:, 1], torch.stack(reference_audio)[:, 0])  # ... and audio


def test_the_padding_bias_silences_or_forces_the_text_of_its_own_slot(tiny_copy, rng):
    frames = noise_frames(rng, FRAMES, scale=0.01)
    oracle = OracleUpdate.reset(0, tuple(range(40, 60)))
    plain, quiet, chatty = run(tiny_copy, GREEDY, [None, Sampling(pad_mult=50.0), Sampling(pad_mult=-50.0)],
                               frames, oracle)
    (alone,) = run(tiny_copy, GREEDY, [None], frames, oracle)
    assert tokens(plain) == tokens(alone)  # a neighbour's settings change nothing in this slot
    assert any(t is not None for t in tokens(plain))
    assert all(t is None for t in tokens(quiet))
    first = next(i for i, o in enumerate(chatty) if o.frame >= 1)  # the model's first own text position
    assert all(t is not None for t in tokens(chatty)[first:]), tokens(chatty)


def test_the_repetition_penalty_changes_only_its_slot(tiny_copy, rng):
    frames = noise_frames(rng, FRAMES, scale=0.01)
    oracle = OracleUpdate.reset(0, (41, 42, 41, 42, 41, 42, 41, 42, 41, 42))
    penalised, plain = run(tiny_copy, GREEDY, [Sampling(repetition_penalty=10.0, repetition_penalty_context=8),
                                               None], frames, oracle)
    (alone,) = run(tiny_copy, GREEDY, [None], frames, oracle)
    assert tokens(plain) == tokens(alone)
    repeated = [t for t in tokens(alone) if t is not None]
    assert len(repeated) > len(set(repeated))  # without the penalty it repeats its oracle's tokens
    assert tokens(penalised) != tokens(alone)


def test_defaults_are_the_checkpoints_own_settings(tiny):
    engine = BatchedEngine(tiny, batch_size=2, gen=GenerationConfig(temp=0.6, top_k_text=7))
    try:
        slot = engine.acquire()
        assert engine.sampling(slot) == Sampling(text_temperature=0.7, text_topk=7, audio_temperature=0.6)
        other = engine.acquire(Sampling(text_topk=3))
        assert engine.sampler.text_topk.tolist() == [7, 3]
        engine.release(other)
        assert engine.acquire() == other and engine.sampler.text_topk.tolist() == [7, 7]  # reset with the slot
        assert math.isclose(engine.sampler.audio_temp[slot].item(), 0.6, rel_tol=1e-6)
    finally:
        engine.close()


def test_sessions_that_agree_are_sampled_by_moshi_with_their_common_settings(tiny, rng):
    frames = noise_frames(rng, FRAMES)
    top1 = Sampling(text_topk=1, audio_topk=1)  # the same in every slot: moshi's own top-k path
    audio, reference_audio = [], []
    first, second = run(tiny, SAMPLED, [top1, top1], frames, audio_tokens=audio)
    (reference,) = run(tiny, GREEDY, [None], frames, audio_tokens=reference_audio)
    assert tokens(first) == tokens(second) == tokens(reference)
    assert torch.equal(torch.stack(audio)[:, 0], torch.stack(reference_audio)[:, 0])
