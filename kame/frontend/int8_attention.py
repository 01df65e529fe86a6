"""The LM's attention for one streaming step, read straight from the int8 KV cache: a Triton kernel
dequantises the ring in registers instead of writing it out whole in the model's dtype each step.

`Int8RingKVCache.complete` reads the int8 ring, writes it dequantised and moshi's attention reads that again
(~3.9 GB a step per session of Moshi 7B); the kernel reads the int8 ring and its scales once (~0.8 GB).
Off CUDA (or without Triton) the same call dequantises and runs PyTorch's attention, as moshi does.
"""

from __future__ import annotations

import functools
import logging
import math
import types

import torch
import torch.nn.functional as F
from einops import rearrange
from moshi.models.lm import LMModel
from moshi.modules.transformer import StreamingMultiheadAttention, apply_weights_per_step

from kame.frontend.kv_cache import Int8RingKVCache

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the reference path serves
    triton = tl = None

logger = logging.getLogger(__name__)

BLOCK_N = 64  # ring positions per tile of the kernel's loop (a power of two)
TARGET_PROGRAMS = 1024  # split the ring until (rows x heads x splits) reaches this: ~8 programs per H200 SM


def int8_decode_attention(q: torch.Tensor, cache: Int8RingKVCache, positions: torch.Tensor, pos_q: torch.Tensor,
                          context: int | None, softmax_scale: float | None = None) -> torch.Tensor:
    """moshi's attention for one query per row ([B, H, 1, D]) over the int8 ring of `cache`, whose ring
    indexes hold `positions` ([B, capacity], -1: none), the query at `pos_q` ([B]): the Triton kernel on
    CUDA (or under TRITON_INTERPRET=1), dequantisation and PyTorch's attention elsewhere."""
    _check_shapes(q, cache)
    if kernel_available(q.device):
        return triton_decode_attention(q, cache, positions, pos_q, context, softmax_scale)
    return reference_decode_attention(q, cache, positions, pos_q, context, softmax_scale)


def kernel_available(device: torch.device) -> bool:
    return triton is not None and (device.type == "cuda" or triton.knobs.runtime.interpret)


def _check_shapes(q: torch.Tensor, cache: Int8RingKVCache) -> None:
    batch, heads, steps, dim = q.shape
    _, cache_batch, kv_heads, _, cache_dim = cache.cache.shape
    if steps != 1:
        raise ValueError(f"one query per row (a streaming step), not {steps}")
    if kv_heads != heads:
        raise ValueError(f"{heads} query heads over {kv_heads} KV heads: only kv_repeat 1 is supported")
    if (cache_batch, cache_dim) != (batch, dim):
        raise ValueError(f"queries {tuple(q.shape)} do not match a cache of {tuple(cache.cache.shape)}")


def moshi_bias(positions: torch.Tensor, pos_q: torch.Tensor, context: int | None) -> torch.Tensor:
    """moshi's causal attention mask for one query per row: [B, 1, 1, capacity], True where attended."""
    delta = pos_q.view(-1, 1) - positions
    bias = (positions >= 0) & (delta >= 0)
    if context is not None:
        bias = bias & (delta < context)
    return bias[:, None, None, :]


def reference_decode_attention(q: torch.Tensor, cache: Int8RingKVCache, positions: torch.Tensor,
                               pos_q: torch.Tensor, context: int | None,
                               softmax_scale: float | None = None) -> torch.Tensor:
    """What moshi computes on `Int8RingKVCache.complete`'s result: the dequantised ring, moshi's mask."""
    keys = cache.cache[0].to(cache.dtype) * cache.scale[0]
    values = cache.cache[1].to(cache.dtype) * cache.scale[1]
    bias = moshi_bias(positions, pos_q, context)
    return F.scaled_dot_product_attention(q, keys, values, bias, scale=softmax_scale)


# ------------------------------------------------------------------ the kernel


def triton_decode_attention(q: torch.Tensor, cache: Int8RingKVCache, positions: torch.Tensor,
                            pos_q: torch.Tensor, context: int | None, softmax_scale: float | None = None,
                            block_n: int = BLOCK_N, splits: int | None = None) -> torch.Tensor:
    """Split-K decoding: one program per (row, head, split of the ring) writes its partial softmax (max, sum,
    weighted values); `_combine` merges the splits. Shapes only decide the launch (CUDA-graph capturable)."""
    _check_shapes(q, cache)
    batch, heads, _, dim = q.shape
    tiles = triton.cdiv(cache.capacity, block_n)
    splits = splits or min(tiles, triton.cdiv(TARGET_PROGRAMS, batch * heads))
    tiles_per_split = triton.cdiv(tiles, splits)
    splits = triton.cdiv(tiles, tiles_per_split)  # no split left without a tile
    top = torch.empty(batch, heads, splits, device=q.device, dtype=torch.float32)
    total = torch.empty_like(top)
    acc = torch.empty(batch, heads, splits, dim, device=q.device, dtype=torch.float32)
    q = q if q.stride(-1) == 1 else q.contiguous()
    keys, values, scales = cache.cache[0], cache.cache[1], cache.scale[..., 0]  # views: a row view's strides hold
    positions = positions.expand(batch, -1)  # a ring without exec mask has one row of positions for all
    scale = 1 / math.sqrt(dim) if softmax_scale is None else softmax_scale
    _kernel()[(batch * heads, splits)](
        q, keys, values, scales[0], scales[1], positions, pos_q, top, total, acc,
        heads, cache.capacity, dim, 0 if context is None else context, scale, tiles_per_split,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        scales.stride(1), scales.stride(2), scales.stride(3), positions.stride(0), pos_q.stride(0),
        HAS_CONTEXT=context is not None, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(dim),
    )
    return _combine(top, total, acc).to(q.dtype).unsqueeze(2)


def _combine(top: torch.Tensor, total: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """[B, H, D] from the splits' partial softmaxes; 0 for a row with nothing to attend to, as PyTorch's
    attention gives for a row its mask hides whole."""
    best = top.amax(-1, keepdim=True)
    weight = torch.exp(top - best)
    total = (weight * total).sum(-1, keepdim=True)
    out = (weight.unsqueeze(-1) * acc).sum(-2)
    return torch.where(total > 0, out / total, torch.zeros_like(out))


@functools.cache
def _kernel():
    """Jitted on first use, not at import: the module imports without Triton (a CPU-only install)."""
    return triton.jit(_decode_split)


def _decode_split(q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, positions_ptr, pos_q_ptr, top_ptr, total_ptr,
                  acc_ptr, heads, capacity, dim, context, softmax_scale, tiles_per_split,
                  q_row, q_head, kv_row, kv_head, kv_index, scale_row, scale_head, scale_index,
                  positions_row, pos_q_row, HAS_CONTEXT: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """One (row, head) over one split of the ring: an online softmax in float32 over its tiles. An index
    past the ring reads position -1, so the mask that hides empty slots also hides the tail; masked lanes
    load nothing (a young ring's empty slots cost no reads of K or V)."""
    row_head, split = tl.program_id(0), tl.program_id(1)
    row, head = (row_head // heads).to(tl.int64), row_head % heads  # 64-bit: 175 rows of 7B pass 2**31 bytes
    dims = tl.arange(0, BLOCK_D)
    in_dims = dims < dim
    q = tl.load(q_ptr + row * q_row + head * q_head + dims, mask=in_dims, other=0.0).to(tl.float32)
    q = q * softmax_scale
    pos_q = tl.load(pos_q_ptr + row * pos_q_row)
    kv = row * kv_row + head * kv_head
    scales = row * scale_row + head * scale_head
    top = -1e30  # the running max: finite, so that a tile with nothing valid rescales by exp(0), not NaN
    total = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for tile in range(tiles_per_split):
        index = (split * tiles_per_split + tile) * BLOCK_N + tl.arange(0, BLOCK_N)
        pos_k = tl.load(positions_ptr + row * positions_row + index, mask=index < capacity, other=-1)
        delta = pos_q - pos_k
        valid = (pos_k >= 0) & (delta >= 0)
        if HAS_CONTEXT:
            valid = valid & (delta < context)
        lanes = valid[:, None] & in_dims[None, :]
        offsets = kv + index[:, None] * kv_index + dims[None, :]
        k = tl.load(k_ptr + offsets, mask=lanes, other=0).to(tl.float32)
        k_scale = tl.load(k_scale_ptr + scales + index * scale_index, mask=valid, other=0.0).to(tl.float32)
        score = tl.where(valid, tl.sum(k * q[None, :], axis=1) * k_scale, float("-inf"))
        new_top = tl.maximum(top, tl.max(score, axis=0))
        rescale = tl.exp(top - new_top)
        p = tl.exp(score - new_top)
        v = tl.load(v_ptr + offsets, mask=lanes, other=0).to(tl.float32)
        v_scale = tl.load(v_scale_ptr + scales + index * scale_index, mask=valid, other=0.0).to(tl.float32)
        acc = acc * rescale + tl.sum((p * v_scale)[:, None] * v, axis=0)
        total = total * rescale + tl.sum(p, axis=0)
        top = new_top
    out = row_head * tl.num_programs(1) + split
    tl.store(top_ptr + out, top)
    tl.store(total_ptr + out, total)
    tl.store(acc_ptr + out * dim + dims, acc, mask=in_dims)


# ------------------------------------------------------------------ moshi's attention, fused


def fused_attention_forward(attention: StreamingMultiheadAttention):
    """A forward for `attention` (to set as the instance's `forward`) that steps one frame on an int8 cache with
    `int8_decode_attention`, and leaves anything else (T > 1, a model-dtype cache, cross attention,
    kv_repeat > 1, outside streaming) to moshi's own forward."""
    return types.MethodType(_fused_forward, attention)


def _fused_forward(attention: StreamingMultiheadAttention, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor) -> torch.Tensor:
    state = attention._streaming_state
    if not _fusable(attention, state, query):
        return type(attention).forward(attention, query, key, value)
    offset, schedule = state.offset, attention.weights_per_step_schedule
    projected = apply_weights_per_step(attention.in_projs, schedule, query, state.offset_cpu)
    q, k, v = rearrange(projected, "b t (p h d) -> p b h t d", p=3, h=attention.num_heads)
    if attention.rope is not None:
        q, k = attention.rope(q, k, offset, time_before_heads=False)
    positions = state.kv_cache.write(k, v, state.exec_mask)
    x = int8_decode_attention(q, state.kv_cache, positions, offset, attention.context)
    x = apply_weights_per_step(attention.out_projs, schedule, rearrange(x, "b h t d -> b t (h d)"),
                               state.offset_cpu)
    state.offset[:] = torch.where(state.exec_mask, offset + 1, offset)
    state.offset_cpu += 1
    return x


def _fusable(attention: StreamingMultiheadAttention, state, query: torch.Tensor) -> bool:
    return (state is not None and isinstance(state.kv_cache, Int8RingKVCache) and query.shape[1] == 1
            and attention.causal and not attention.cross_attention and attention.kv_repeat == 1)


def install_fused_attention(lm: LMModel) -> int:
    """Give each attention layer of the LM's main transformer the fused forward (before the first step:
    a CUDA graph captured earlier keeps moshi's); the number of layers that have it."""
    layers = [layer.self_attn for layer in lm.transformer.layers]
    for attention in layers:
        if "forward" not in vars(attention):  # a forward of its own already (ours, or another's): kept
            attention.forward = fused_attention_forward(attention)
    count = sum(has_fused_attention(attention) for attention in layers)
    path = "the Triton kernel" if kernel_available(lm.device) else "dequantisation and PyTorch's attention"
    logger.info("fused int8 attention in %d of %d layers (on an int8 KV cache: %s)", count, len(layers), path)
    return count


def has_fused_attention(attention: StreamingMultiheadAttention) -> bool:
    return getattr(vars(attention).get("forward"), "__func__", None) is _fused_forward


def remove_fused_attention(lm: LMModel) -> None:
    """moshi's forward again in every layer of the LM's main transformer."""
    for layer in lm.transformer.layers:
        if has_fused_attention(layer.self_attn):
            del layer.self_attn.forward
