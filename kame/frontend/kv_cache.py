"""An 8-bit KV cache for the front-end's LM: half the memory of a bf16 cache per session slot.

Moshi 7B keeps 3000 frames of keys and values per slot (1.46 GiB in bf16): 80 slots fill an H200 beside
the weights. `Int8RingKVCache` stands in for moshi's `RingKVCache` in the LM's attention layers: a write
quantizes each head's key and value vector to int8 with a scale of its own (absmax / 127), a read
dequantizes the ring into the model's dtype for the attention. Same ring, same positions, same exec-mask
rules as moshi's: only the values' precision changes (docs/benchmarks.md measures what that costs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import torch
from moshi.models.lm import LMModel
from moshi.modules.transformer import KVCacheResult, RingKVCache

KvCacheKind = Literal["model", "int8"]  # the model's own dtype (moshi's cache), or int8 with scales
INT8_MAX = 127


class Int8RingKVCache(RingKVCache):
    """moshi's ring of `capacity` positions per row, holding int8 values and one scale per (row, head,
    position) in the model's dtype."""

    def __init__(self, batch_size: int, num_heads: int, dim_per_head: int, capacity: int,
                 respect_exec_mask: bool, device: torch.device, dtype: torch.dtype) -> None:
        self.capacity, self.respect_exec_mask, self.dtype = capacity, respect_exec_mask, dtype
        self.cache = torch.zeros((2, batch_size, num_heads, capacity, dim_per_head), device=device,
                                 dtype=torch.int8)
        self.scale = torch.zeros((2, batch_size, num_heads, capacity, 1), device=device, dtype=dtype)
        self.end_offset = torch.zeros(batch_size if respect_exec_mask else 1, device=device, dtype=torch.long)

    @classmethod
    def like(cls, cache: RingKVCache) -> Int8RingKVCache:
        """An empty int8 cache of the same shape, ring and rules as moshi's `cache`."""
        _, batch, heads, capacity, dim = cache.cache.shape
        return cls(batch, heads, dim, capacity, cache.respect_exec_mask, cache.cache.device, cache.cache.dtype)

    def complete(self, k: torch.Tensor, v: torch.Tensor, exec_mask: torch.Tensor) -> KVCacheResult:
        positions = self.write(k, v, exec_mask)
        keys = self.cache[0].to(self.dtype) * self.scale[0]
        values = self.cache[1].to(self.dtype) * self.scale[1]
        return KVCacheResult(keys, values, positions)

    def write(self, k: torch.Tensor, v: torch.Tensor, exec_mask: torch.Tensor) -> torch.Tensor:
        """Quantize k and v [B, H, T, D] into the ring and advance it as moshi's does; the positions the ring
        holds then ([B, capacity], -1: none). `complete` dequantizes after it; a fused attention reads the
        int8 ring as it is (kame/frontend/int8_attention.py)."""
        batch, heads, steps, dim = k.shape
        slots = (self.end_offset.view(-1, 1) + torch.arange(steps, device=k.device)) % self.capacity  # [B, T]
        for which, values in enumerate((k, v)):
            quantized, scale = quantize(values)
            scale = scale.to(self.scale.dtype)
            if self.respect_exec_mask:
                index = slots.view(batch, 1, steps, 1)
                self.cache[which].scatter_(2, index.expand(-1, heads, -1, dim), quantized)
                self.scale[which].scatter_(2, index.expand(-1, heads, -1, 1), scale)
            else:
                self.cache[which].index_copy_(2, slots[0], quantized)
                self.scale[which].index_copy_(2, slots[0], scale)
        advanced = self.end_offset + steps
        if self.respect_exec_mask:
            self.end_offset[:] = torch.where(exec_mask, advanced, self.end_offset)
        else:
            self.end_offset.add_(steps)
        return ring_positions(advanced, self.end_offset, self.capacity)


def quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and the float32 scale of each vector along the last axis (absmax / 127; a zero vector
    keeps the scale 1 and stays zero)."""
    scale = values.abs().amax(dim=-1, keepdim=True).float() / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    quantized = (values.float() / scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return quantized, scale


def ring_positions(written: torch.Tensor, end_offset: torch.Tensor, capacity: int) -> torch.Tensor:
    """[B, capacity]: the stream position each ring index holds, -1 where it holds none (moshi's rule).

    `written`: each row's count of positions written, this step's included: index i holds the newest
    position p <= written - 1 with p = i mod capacity. Until a row's ring has wrapped, the indexes at or
    past its `end_offset` hold nothing yet (a row the exec mask held back wrote, but did not advance:
    its output is discarded, as moshi's is)."""
    index = torch.arange(capacity, device=written.device)
    last = written.view(-1, 1) - 1
    positions = last - (last - index) % capacity
    return torch.where(index >= end_offset.view(-1, 1), torch.full_like(positions, -1), positions)


@contextlib.contextmanager
def int8_kv_caches(lm: LMModel) -> Iterator[None]:
    """While the LM enters streaming, each attention layer's new KV cache is replaced by an int8 one at
    once (one layer's model-dtype cache at a time: 128 slots of the 7B never hold the bf16 ring whole)."""
    layers = [layer.self_attn for layer in lm.transformer.layers]
    for attention in layers:
        attention._init_streaming_state = _int8_state(attention)
    try:
        yield
    finally:
        for attention in layers:
            del attention._init_streaming_state  # the class's method again


def _int8_state(attention):
    make = type(attention)._init_streaming_state

    def init(batch_size: int):
        state = make(attention, batch_size)
        if state.kv_cache is not None:
            state.kv_cache = Int8RingKVCache.like(state.kv_cache)
        return state
    return init


def kv_bytes_per_slot(lm: LMModel, kind: KvCacheKind) -> int:
    """One slot's KV cache of the LM's main transformer, as `kind` stores it."""
    attention = lm.transformer.layers[0].self_attn
    heads = attention.num_heads // attention.kv_repeat
    dim = attention.embed_dim // attention.num_heads
    entries = 2 * len(lm.transformer.layers) * heads * attention.context
    element = next(attention.parameters()).element_size()
    return entries * (dim * element if kind == "model" else dim + element)


KV_MEMORY_SHARE = 0.85  # of the device's free memory, the most "auto" gives the KV caches (the rest: activations, ASR)


def choose_kv_cache(kind: str, lm: LMModel, slots: int) -> tuple[KvCacheKind, str]:
    """The cache to build for `slots` sessions and why: as set, or ("auto") the model's dtype where its
    caches fit in KV_MEMORY_SHARE of the free device memory, int8 where only that fits (a CPU: the model's)."""
    if kind in ("model", "int8"):
        return kind, "chosen in the settings"  # type: ignore[return-value]
    if kind != "auto":
        raise ValueError(f"kv_cache must be auto, model or int8, not {kind!r}")
    if lm.device.type != "cuda":
        return "model", "auto: the model's dtype off a GPU"
    free, _ = torch.cuda.mem_get_info(lm.device)
    budget, model = KV_MEMORY_SHARE * free, slots * kv_bytes_per_slot(lm, "model")
    if model <= budget:
        return "model", f"auto: {slots} slots of {lm.dtype} KV cache ({_gib(model)}) fit in {_gib(free)} free"
    int8 = slots * kv_bytes_per_slot(lm, "int8")
    return "int8", (f"auto: {slots} slots of {lm.dtype} KV cache need {_gib(model)}, more than "
                    f"{KV_MEMORY_SHARE:.0%} of {_gib(free)} free; int8 needs {_gib(int8)}")


def _gib(count: float) -> str:
    return f"{count / 2**30:.1f} GiB"
