"""What only a CUDA GPU can check: moshi's CUDA graphs with per-session sampling, and int8 weights.

Skipped without CUDA (conftest.py); `scripts/gpu_bench.sh` runs them (`pytest -m gpu`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kame.frontend.engine import BatchedEngine, GenerationConfig
from kame.frontend.loader import load_frontend
from kame.frontend.sampling import Sampling

from .conftest import noise_frames
from .test_sampling import GREEDY, SAMPLED, run, tokens

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_cuda():
    # float32: random weights put many logits near a tie, where bf16 rounding alone can flip an argmax
    return load_frontend("tiny", "cuda", dtype=torch.float32)


def test_per_session_sampling_holds_inside_cuda_graphs(tiny_cuda, rng):
    """A greedy slot beside a hot one gives what a greedy engine gives, token for token: the per-slot
    temperatures live in the captured graphs' inputs. The reference has the same batch shape (two
    greedy slots): kernels chosen for another batch size may round differently, which is not sampling."""
    frames = noise_frames(rng, 16)
    audio, reference_audio = [], []
    cold, warm = run(tiny_cuda, SAMPLED, [Sampling(text_temperature=0.0, audio_temperature=0.0),
                                          Sampling(text_temperature=5.0, text_topk=0, audio_temperature=5.0,
                                                   audio_topk=0)], frames, audio_tokens=audio)
    reference, twin = run(tiny_cuda, GREEDY, [None, None], frames, audio_tokens=reference_audio)
    assert tokens(reference) == tokens(twin)  # the same input in both rows of a batch: the same tokens
    assert tokens(cold) == tokens(reference)
    assert torch.equal(torch.stack(audio)[:, 0].cpu(), torch.stack(reference_audio)[:, 0].cpu())
    assert tokens(warm) != tokens(reference)


def test_an_int8_frontend_steps_on_cuda(rng):
    pytest.importorskip("bitsandbytes", reason="moshi installs bitsandbytes on Linux only")
    frontend = load_frontend("tiny", "cuda", quantize="int8")
    assert frontend.quantize == "int8"
    engine = BatchedEngine(frontend, batch_size=2, gen=GenerationConfig(use_sampling=False))
    try:
        slots = [engine.acquire(), engine.acquire()]
        outputs = [engine.step({s: f for s in slots}) for f in noise_frames(rng, 12)]
    finally:
        engine.close()
    pcm = np.stack([o.pcm for step in outputs for o in step])
    assert np.isfinite(pcm).all() and np.abs(pcm).max() > 0


def test_a_kyutai_layout_checkpoint_loads_onto_the_gpu_tensor_by_tensor(tmp_path):
    """Fused bf16 keys read straight onto CUDA: the same weights as on the CPU, the peak about the model."""
    from kame.testing.hub_layouts import TINY_LM_CONFIG, kyutai_moshi_repo, random_weights

    # wide enough (~135 MB in bf16) that a second copy of the LM would stand out of the fixed costs: CUDA's
    # workspaces and the first steps' buffers came to ~70 MB on an H200 (2026-12-04), 100 times the tiny LM
    wide = {**TINY_LM_CONFIG, "dim": 1024, "num_heads": 8, "num_layers": 8}
    folder = kyutai_moshi_repo(tmp_path / "kyutai", random_weights(wide, seed=3))
    cpu = load_frontend(str(folder), "cpu", dtype=torch.bfloat16)
    torch.cuda.reset_peak_memory_stats()
    gpu = load_frontend(str(folder), "cuda")
    assert gpu.lm.dtype == torch.bfloat16 and gpu.oracle_emb.weight.is_cuda
    for key, value in cpu.lm.state_dict().items():
        assert torch.equal(gpu.lm.state_dict()[key].cpu(), value), key
    def size(module) -> int:
        return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])

    lm_bytes, resident = size(gpu.lm), size(gpu.mimi) + size(gpu.oracle_emb)  # Mimi and the oracle table stay
    peak = torch.cuda.max_memory_allocated()
    assert lm_bytes > 100 * 2**20
    assert peak < 1.5 * lm_bytes + resident + 96 * 2**20, (peak, lm_bytes, resident)


@pytest.fixture(scope="module")
def tiny_copy_cuda():
    return load_frontend("tiny-copy", "cuda", dtype=torch.float32)


@pytest.mark.parametrize("kv_cache", ["model", "int8"])
def test_sessions_keep_their_oracle_through_moves_inside_cuda_graphs(tiny_copy_cuda, kv_cache):
    """tiny-copy under CUDA graphs, one graph set per view size: a session whose row moves while it copies
    its oracle, and one that joins after, copy theirs exactly (with either KV cache)."""
    from .test_rows import copy_through_moves

    for name, (said, oracle) in copy_through_moves(tiny_copy_cuda, kv_cache).items():
        assert said[: len(oracle)] == oracle, name


def test_every_view_size_is_captured_before_any_session(tiny_cuda, rng):
    engine = BatchedEngine(tiny_cuda, batch_size=8, gen=GenerationConfig(use_sampling=False))
    try:
        assert engine.warm_views() == [1, 2, 4, 8]
        graphs = {n: states[1][""].graphed_main for n, (states, _) in engine._rows.views._views.items()}
        assert sorted(graphs) == [1, 2, 4, 8] and all(g._graph is not None for g in graphs.values())
        slots = [engine.acquire() for _ in range(3)]
        for frame in noise_frames(rng, 3):
            engine.step({slot: frame for slot in slots})
        assert engine._state.batch_size == 4 and engine._state.graphed_main is graphs[4]  # replayed, not recaptured
    finally:
        engine.close()
