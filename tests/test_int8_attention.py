"""The fused int8 attention: the Triton kernel (run by Triton's CPU interpreter) equals dequantisation and
PyTorch's attention; the fused forward steps moshi's attention layers, and a tiny LM, as moshi's does."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from moshi.modules.rope import RotaryEmbedding
from moshi.modules.transformer import StreamingMultiheadAttention
from moshi.utils.compile import no_compile

from kame.frontend import int8_attention
from kame.frontend.engine import BatchedEngine
from kame.frontend.int8_attention import (
    fused_attention_forward,
    install_fused_attention,
    int8_decode_attention,
    moshi_bias,
    reference_decode_attention,
    remove_fused_attention,
    triton_decode_attention,
)
from kame.frontend.kv_cache import Int8RingKVCache
from kame.frontend.loader import load_frontend

from .conftest import noise_frames
from .test_engine import GREEDY, assert_same

HEADS = 2
# steps each row took before the query's: a young ring (empty slots), a wrapped ring, a row the exec mask
# holds back at the query's step, and one that never stepped (nothing to attend to: 0)
FILLS = (5, "wrapped", 7, 0)
STEPPED = (True, True, False, False)  # the exec mask at the query's step


def filled_ring(dtype: torch.dtype, dim: int, capacity: int, device: str = "cpu"):
    """An int8 ring whose rows stepped FILLS times, then the query's step: (cache, positions, pos_q)."""
    generator = torch.Generator(device).manual_seed(0)
    fills = [capacity + 13 if fill == "wrapped" else fill for fill in FILLS]
    cache = Int8RingKVCache(len(fills), HEADS, dim, capacity, True, torch.device(device), dtype)
    for step in range(max(fills) + 1):
        query_step = step == max(fills)
        mask = torch.tensor(STEPPED if query_step else [step < fill for fill in fills], device=device)
        pos_q = cache.end_offset.clone()
        k, v = (torch.randn(len(fills), HEADS, 1, dim, generator=generator, device=device) for _ in "kv")
        positions = cache.write(k.to(dtype), (3 * v).to(dtype), mask)
    return cache, positions, pos_q


def queries(dtype: torch.dtype, dim: int, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator(device).manual_seed(1)
    return (2 * torch.randn(len(FILLS), HEADS, 1, dim, generator=generator, device=device)).to(dtype)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


ROOT = Path(__file__).resolve().parents[1]  # where `tests` imports as a package


def interpreted(call: str):
    """The JSON result of `call`, an expression over this module (`t`), in a new Python process with
    TRITON_INTERPRET=1: triton decides interpreting as each function is jitted, its own helpers (tl.sum)
    when it is imported, so the setting cannot come later in this process."""
    code = f"import json, tests.test_int8_attention as t; print(json.dumps({call}))"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


KERNEL_CASES = {  # dtype, head dim, capacity, tile (block_n), context, splits (None: the launch chooses)
    "ring-not-a-multiple-of-the-tile-no-context": ("float32", 16, 40, 16, None, None),
    "one-split-context-shorter-than-the-ring": ("float32", 16, 64, 16, 50, 1),
    "a-split-per-tile-context-the-ring": ("float32", 16, 64, 16, 64, 4),
    "a-split-ending-past-the-ring": ("float32", 16, 40, 8, None, 2),  # 5 tiles, 3 a split: one tile past the end
    "bf16-head-dim-not-a-power-of-two": ("bfloat16", 24, 40, 32, 40, None),
}
# Both sides dequantise the same int8 values with the same scales and attend to the same positions: what
# differs is float rounding. float32: the kernel sums by tiles and splits with an online softmax, PyTorch
# in its own order; 2e-7 to 4e-7 of the output's largest value measured (Triton 3.9's interpreter), while
# each wrong scale, index, mask or merge tried in a copy of the kernel moved it by 2e-2 to 1.8 in the cases
# that caught it. bf16: the reference rounds the dequantised ring to bf16 (2**-9 relative) before its
# attention, the kernel keeps float32: 3e-3 measured.
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}


def kernel_results() -> dict[str, dict]:
    """(In the interpreting process) each case's kernel against the reference, and a view of the first
    two rows (the engine steps views: kame/frontend/rows.py) through `int8_decode_attention`."""
    results = {}
    for name, (dtype, dim, capacity, block_n, context, splits) in KERNEL_CASES.items():
        dtype = getattr(torch, dtype)
        cache, positions, pos_q = filled_ring(dtype, dim, capacity)
        q = queries(dtype, dim)
        want = reference_decode_attention(q, cache, positions, pos_q, context)
        got = triton_decode_attention(q, cache, positions, pos_q, context, block_n=block_n, splits=splits)
        results[name] = {"error": relative_error(got, want), "dtype": str(got.dtype).removeprefix("torch."),
                         "empty_row": got[3].abs().max().item(), "others": want[:3].abs().amin().item()}
    cache, positions, pos_q = filled_ring(torch.float32, 16, 40)
    view = copy.copy(cache)
    view.cache, view.scale = cache.cache.narrow(1, 0, 2), cache.scale.narrow(1, 0, 2)
    q = queries(torch.float32, 16)
    want = reference_decode_attention(q, cache, positions, pos_q, 40)[:2]
    with pytest.MonkeyPatch.context() as patch:
        calls = counting(patch, "triton_decode_attention")
        got = int8_decode_attention(q[:2], view, positions[:2], pos_q[:2], 40)
    results["view"] = {"error": relative_error(got, want), "kernel_calls": len(calls)}
    cache, positions, pos_q = shared_ring(16, 40)
    q = queries(torch.float32, 16)[:3]
    want = reference_decode_attention(q, cache, positions, pos_q, 30)
    got = triton_decode_attention(q, cache, positions, pos_q, 30, block_n=16)
    results["shared"] = {"error": relative_error(got, want), "positions": list(positions.shape)}
    return results


def shared_ring(dim: int, capacity: int):
    """moshi's ring without an exec mask (a layer with weights per step): one row of positions for every
    row ([1, capacity]), wrapped; the rows' queries at different positions (their offsets follow the mask)."""
    generator = torch.Generator().manual_seed(2)
    cache = Int8RingKVCache(3, HEADS, dim, capacity, False, torch.device("cpu"), torch.float32)
    for _ in range(capacity + 9):
        k, v = (torch.randn(3, HEADS, 1, dim, generator=generator) for _ in "kv")
        positions = cache.write(k, v, torch.ones(3, dtype=torch.bool))
    return cache, positions, cache.end_offset - 1 - torch.tensor([0, 3, 20])


@pytest.fixture(scope="module")
def kernel():
    pytest.importorskip("triton")
    return interpreted("t.kernel_results()")


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_the_kernel_equals_dequantised_attention(kernel, case):
    """Rows at four fills (FILLS); the first test of the file pays for the interpreting process (~5 s)."""
    result = kernel[case]
    assert result["dtype"] == KERNEL_CASES[case][0]
    assert result["error"] < TOLERANCE[result["dtype"]]
    assert result["empty_row"] == 0  # nothing to attend to: 0, as PyTorch's attention gives
    assert result["others"] > 0  # the other rows attend to something


def test_the_kernel_reads_a_view_of_the_first_rows(kernel):
    assert kernel["view"]["kernel_calls"] == 1  # int8_decode_attention chose the kernel (interpreted)
    assert kernel["view"]["error"] < TOLERANCE["float32"]


def test_the_kernel_reads_a_ring_without_exec_mask(kernel):
    assert kernel["shared"]["positions"] == [1, 40]  # one row of positions, broadcast over the batch's rows
    assert kernel["shared"]["error"] < TOLERANCE["float32"]


def test_moshis_mask_hides_empty_slots_the_future_and_what_is_out_of_context():
    positions = torch.tensor([[4, 1, 2, 3, -1], [0, 1, 2, 3, 4]])
    bias = moshi_bias(positions, torch.tensor([3, 4]), context=3)
    assert bias.shape == (2, 1, 1, 5)
    assert bias[:, 0, 0].tolist() == [[False, True, True, True, False], [False, False, True, True, True]]


def test_only_one_query_per_kv_head_is_supported():
    cache = Int8RingKVCache(1, HEADS, 16, 8, True, torch.device("cpu"), torch.float32)
    positions = torch.full((1, 8), -1)
    with pytest.raises(ValueError, match="kv_repeat 1"):
        int8_decode_attention(torch.randn(1, 2 * HEADS, 1, 16), cache, positions, torch.zeros(1, dtype=torch.long), 8)


def counting(monkeypatch, name: str) -> list[int]:
    """Count the calls of int8_attention's function `name` (still calling it)."""
    calls, function = [], getattr(int8_attention, name)

    def spy(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)
    monkeypatch.setattr(int8_attention, name, spy)
    return calls


@torch.no_grad()
def test_a_fused_layer_steps_as_moshis_does(monkeypatch):
    """A chunk of 3 frames (moshi's forward), then single frames on an int8 ring (fused) past its context,
    a row held back now and then: the outputs and the streaming state equal moshi's."""
    torch.manual_seed(0)
    plain = StreamingMultiheadAttention(32, HEADS, causal=True, context=8, rope=RotaryEmbedding(interleave=True))
    fused = copy.deepcopy(plain)
    fused.forward = fused_attention_forward(fused)
    calls = counting(monkeypatch, "int8_decode_attention")
    with no_compile(), plain.streaming(2), fused.streaming(2):
        for module in (plain, fused):
            module._streaming_state.kv_cache = Int8RingKVCache.like(module._streaming_state.kv_cache)
        chunks = [torch.randn(2, 3, 32)] + [torch.randn(2, 1, 32) for _ in range(20)]
        for step, x in enumerate(chunks):
            mask = torch.tensor([True, step % 4 != 2])
            plain.set_exec_mask(mask)
            fused.set_exec_mask(mask)
            torch.testing.assert_close(fused(x, x, x), plain(x, x, x), atol=1e-6, rtol=0)
        want, got = plain._streaming_state, fused._streaming_state
        assert torch.equal(got.offset, want.offset) and got.offset_cpu == want.offset_cpu == 23
        assert torch.equal(got.kv_cache.cache, want.kv_cache.cache)
    assert len(calls) == 20  # the chunk went to moshi's forward


def run_tiny(frontend, frames, kv_cache: str, fused: bool) -> dict[str, list]:
    """Slot a steps every tick; b joins at tick 3 and misses every fifth (its row held back)."""
    engine = BatchedEngine(frontend, batch_size=2, gen=GREEDY, kv_cache=kv_cache)
    outs = {"a": [], "b": []}
    try:
        if fused:
            assert install_fused_attention(frontend.lm) == len(frontend.lm.transformer.layers)
        slots = {"a": engine.acquire(), "b": engine.acquire()}
        for tick in range(len(frames["a"])):
            feed = {slots["a"]: frames["a"][tick]}
            if tick >= 3 and tick % 5 != 4:
                feed[slots["b"]] = frames["b"][tick]
            for out in engine.step(feed):
                outs["a" if out.slot == slots["a"] else "b"].append(out)
    finally:
        remove_fused_attention(frontend.lm)  # the session's shared tiny model: moshi's forward again
        engine.close()
    return outs


def fused_against_moshi(frontend, frames, path: str, patch) -> tuple[dict, dict, int]:
    """Moshi's forward, then the fused one (with the calls of `path` counted) on the same frames."""
    want = run_tiny(frontend, frames, "int8", fused=False)
    calls = counting(patch, path)
    got = run_tiny(frontend, frames, "int8", fused=True)
    return want, got, len(calls)


def test_the_tiny_lm_speaks_as_moshi_past_its_context(tiny, rng, monkeypatch):
    """Two slots, 60 ticks on the int8 cache (the tiny LM's context: 40), the fused forward on the reference
    path against moshi's own: the same tokens and audio, and moshi's forward back afterwards."""
    frames = {"a": noise_frames(rng, 60), "b": noise_frames(rng, 60, scale=0.4)}
    want, got, calls = fused_against_moshi(tiny, frames, "reference_decode_attention", monkeypatch)
    layers = [layer.self_attn for layer in tiny.lm.transformer.layers]
    assert calls == 60 * len(layers)
    assert not any("forward" in vars(attention) for attention in layers)
    for name in ("a", "b"):
        assert_same(got[name], want[name])


def tiny_lm_with_the_kernel() -> dict:
    """(In the interpreting process) the test above with the kernel in the tiny LM."""
    frontend = load_frontend("tiny", "cpu")
    rng = np.random.default_rng(1234)
    frames = {"a": noise_frames(rng, 60), "b": noise_frames(rng, 60, scale=0.4)}
    with pytest.MonkeyPatch.context() as patch:
        want, got, calls = fused_against_moshi(frontend, frames, "triton_decode_attention", patch)
    pcm = {name: np.abs(np.stack([o.pcm for o in got[name]]) - np.stack([o.pcm for o in want[name]])).max()
           for name in ("a", "b")}
    return {"calls": calls, "layers": len(frontend.lm.transformer.layers), "pcm_error": float(max(pcm.values())),
            "text": {name: [[o.text_token for o in outs[name]] for outs in (want, got)] for name in ("a", "b")}}


@pytest.mark.slow
def test_the_tiny_lm_speaks_as_moshi_with_the_kernel():
    """The same with the kernel (Triton's CPU interpreter, ~15 s): the same tokens, the audio within float32
    sums taken in another order."""
    pytest.importorskip("triton")
    result = interpreted("t.tiny_lm_with_the_kernel()")
    assert result["calls"] == 60 * result["layers"]
    for want, got in result["text"].values():
        assert got == want and any(token is not None for token in want)
    assert result["pcm_error"] < 1e-4


def test_a_model_dtype_cache_keeps_moshis_attention(tiny, rng, monkeypatch):
    frames = {"a": noise_frames(rng, 12), "b": noise_frames(rng, 12)}
    want = run_tiny(tiny, frames, "model", fused=False)
    calls = counting(monkeypatch, "int8_decode_attention")
    got = run_tiny(tiny, frames, "model", fused=True)
    assert not calls
    for name in ("a", "b"):
        assert_same(got[name], want[name])


# ------------------------------------------------------------------ on a GPU (skipped elsewhere)


@pytest.mark.gpu
def test_the_kernel_equals_dequantised_attention_at_moshi_7b_shapes():
    """Moshi 7B's heads (32 x 128) over its 3000-frame ring in bf16, the first launch and a CUDA graph's
    replay on new values: both equal the reference (the empty row apart: CUDA's attention may give NaN)."""
    cache, positions, pos_q = filled_ring(torch.bfloat16, 128, 3000, device="cuda")
    cache.cache = cache.cache.repeat(1, 1, 16, 1, 1)  # 32 heads
    cache.scale = cache.scale.repeat(1, 1, 16, 1, 1)
    q = queries(torch.bfloat16, 128, device="cuda").repeat(1, 16, 1, 1)
    q[:, HEADS:] *= -1  # the copied heads differ
    out = int8_decode_attention(q, cache, positions, pos_q, 3000)
    want = reference_decode_attention(q, cache, positions, pos_q, 3000)
    assert relative_error(out[:3], want[:3]) < 1e-2 and not out[3].any()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int8_decode_attention(q, cache, positions, pos_q, 3000)
    q.mul_(0.5)
    cache.scale.mul_(2)
    graph.replay()
    want = reference_decode_attention(q, cache, positions, pos_q, 3000)
    assert relative_error(out[:3], want[:3]) < 1e-2


@pytest.mark.gpu
def test_the_tiny_lm_speaks_as_moshi_with_the_kernel_in_cuda_graphs(rng, monkeypatch):
    """The engine on CUDA captures its step in CUDA graphs (moshi's LMGen): the kernel inside them."""
    frontend = load_frontend("tiny", "cuda", dtype=torch.float32)  # float32: bf16 ties flip argmaxes
    frames = {"a": noise_frames(rng, 60), "b": noise_frames(rng, 60, scale=0.4)}
    want, got, calls = fused_against_moshi(frontend, frames, "triton_decode_attention", monkeypatch)
    assert calls >= len(frontend.lm.transformer.layers)  # Python runs at warm-up and capture, not at replay
    for name in ("a", "b"):
        assert [o.text_token for o in got[name]] == [o.text_token for o in want[name]]
        np.testing.assert_allclose(np.stack([o.pcm for o in got[name]]), np.stack([o.pcm for o in want[name]]),
                                   atol=1e-3)
