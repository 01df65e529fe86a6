"""The engine's oracle injection equals an explicit sum text_emb + oracle_emb + audio embeddings.

The engine adds the oracle through LMGen's per-step `condition_sum`; the reference here builds
the input sum by hand from the tokens the LM was fed and runs the transformer non-streaming.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from moshi.utils.compile import no_compile

from kame.frontend.engine import BatchedEngine, GenerationConfig
from kame.frontend.oracle import OracleUpdate

from .conftest import noise_frames

FRAMES = 16


def reference_text_logits(frontend, sequence: torch.Tensor, oracle_ids: torch.Tensor) -> torch.Tensor:
    """Text logits [B, T, card] of the LM for inputs `sequence` [B, K, T], computed by hand, in eager
    mode as the engine runs on a CPU (torch.compile of moshi's lazily compiled helpers would cost
    ~10 s here and compute the same sums)."""
    lm = frontend.lm
    with no_compile():
        x = lm.text_emb(sequence[:, 0])
        for k in range(lm.num_audio_codebooks):
            x = x + lm.emb[k](sequence[:, k + lm.audio_offset])
        x = x + frontend.oracle_emb(oracle_ids)
        out = lm.transformer(x)
        if lm.out_norm:
            out = lm.out_norm(out)
        return lm.text_linear(out)


def schedule_a(frame: int) -> list[OracleUpdate]:
    return {
        2: [OracleUpdate.reset(0, (10, 11, 12))],
        4: [OracleUpdate.append(0, (13, 14))],
        8: [OracleUpdate.reset(1, (20, 21))],
        9: [OracleUpdate.append(0, (99,))],  # stale: epoch 0 after the epoch-1 reset
        10: [OracleUpdate.append(1, (22,))],
    }.get(frame, [])


def schedule_b(frame: int) -> list[OracleUpdate]:
    return [OracleUpdate.reset(5, (30, 31, 32, 33, 34, 35))] if frame == 0 else []


S, P = 1000, 3  # start token (text_card) and padding of the tiny LM
EXPECTED_A = [P, P, S, 10, 11, 12, 13, 14, S, 20, 21, 22, P, P, P, P]
EXPECTED_B = [S, 30, 31, 32, 33, 34, 35, P, P, P, P, P, P, P, P, P]


@pytest.fixture
def spied(tiny, monkeypatch):
    """Record every input sequence the LM's main transformer receives."""
    seen: list[torch.Tensor] = []
    original = tiny.lm.forward_text

    def spy(sequence, sum_condition=None, cross_attention_src=None):
        seen.append(sequence.clone())
        return original(sequence, sum_condition, cross_attention_src)

    monkeypatch.setattr(tiny.lm, "forward_text", spy)
    return seen


def test_engine_equals_explicit_sum(tiny, spied, rng):
    assert tiny.lm.text_card == S and tiny.lm.text_padding_token_id == P
    engine = BatchedEngine(tiny, batch_size=2, gen=GenerationConfig(use_sampling=False))
    logits: list[torch.Tensor] = []
    engine.lm_gen.on_text_logits_hook = lambda t: logits.append(t[:, 0, 0].clone())
    a, b = engine.acquire(), engine.acquire()
    fed_oracle = []
    try:
        for frame, (pa, pb) in enumerate(zip(noise_frames(rng, FRAMES), noise_frames(rng, FRAMES), strict=True)):
            for update in schedule_a(frame):
                engine.push_oracle(a, update)
            for update in schedule_b(frame):
                engine.push_oracle(b, update)
            outs = engine.step({a: pa, b: pb})
            fed_oracle.append([o.oracle_token for o in sorted(outs, key=lambda o: o.slot)])
    finally:
        engine.close()

    assert [row[0] for row in fed_oracle] == EXPECTED_A
    assert [row[1] for row in fed_oracle] == EXPECTED_B
    sequence = torch.cat(spied, dim=2)  # [2, K, T]
    oracle_ids = torch.tensor([EXPECTED_A, EXPECTED_B])
    with torch.no_grad():
        want = reference_text_logits(tiny, sequence, oracle_ids)
        without_oracle = reference_text_logits(tiny, sequence, torch.full_like(oracle_ids, P))
    got = torch.stack(logits, dim=1)  # [2, T, card]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the check is sensitive: leaving the oracle out changes the logits
    assert (without_oracle - want).abs().max() > 1e-2


def test_cfg_doubles_the_oracle_condition(tiny):
    engine = BatchedEngine(tiny, batch_size=3, gen=GenerationConfig(use_sampling=False, cfg_coef=2.0))
    try:
        condition = engine.oracle_condition([P, 10, S])
        assert condition.shape == (6, 1, tiny.lm.dim)
        torch.testing.assert_close(condition[:3], condition[3:])
        slot = engine.acquire()
        engine.push_oracle(slot, OracleUpdate.reset(0, (10,)))
        outs = engine.step({slot: np.zeros(1920, dtype=np.float32)})
        assert outs[0].oracle_token == S
    finally:
        engine.close()
