"""`kame doctor`'s sessions line: the memory the weights and each session slot's KV caches take, and how
many slots fit in what the device has free."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from server.doctor.check import Check, gb, size
from server.doctor.models import MOSHI_DEP_Q, Probe

if TYPE_CHECKING:
    from kame.frontend.loader import SourceReport
    from server.doctor.machine import Machine
    from server.settings import ServerSettings

USABLE_FRACTION = 0.9  # of free memory: the rest is left to activations, Mimi, the CUDA context, fragmentation


@dataclass(frozen=True)
class Footprint:
    weights_bytes: int  # loaded once
    slot_bytes: int  # each session slot's KV caches

    def __add__(self, other: Footprint) -> Footprint:
        return Footprint(self.weights_bytes + other.weights_bytes, self.slot_bytes + other.slot_bytes)


def kv_cache_bytes(lm_config: Mapping, dtype_bytes: int, kind: str = "model") -> int:
    """One slot's KV caches (k and v): the main transformer's `context` steps, the depformer's. `kind`
    int8: the main transformer's values in one byte and a scale per head vector (kame/frontend/kv_cache.py)."""
    kv_dim = lm_config["dim"] // lm_config.get("kv_repeat", 1)  # grouped-query attention caches fewer heads
    if kind == "int8":
        heads = lm_config.get("num_heads", 32) // lm_config.get("kv_repeat", 1)
        main = 2 * lm_config["num_layers"] * lm_config["context"] * (kv_dim + heads * dtype_bytes)
    else:
        main = 2 * lm_config["num_layers"] * lm_config["context"] * kv_dim * dtype_bytes
    dep_q = int(lm_config.get("dep_q", MOSHI_DEP_Q))
    if dep_q == 0:
        return main
    # moshi builds the depformer with context None and sizes its cache by its steps (weights_per_step =
    # dep_q; depformer_context, 8 in Moshi's config, is dropped): one entry per generated codebook
    return main + 2 * lm_config["depformer_num_layers"] * dep_q * lm_config.get("depformer_dim", 256) * dtype_bytes


def lm_footprint(params: int, lm_config: Mapping, weight_bytes: float, dtype_bytes: int,
                 oracle: bool, kv: str = "model") -> Footprint:
    """`weight_bytes` per parameter (1 for int8), `dtype_bytes` for the float tensors: the KV caches (`kv`:
    model or int8) and the front-end's oracle embedding ([text_card + 1, dim], kept apart from the LM)."""
    weights = params * weight_bytes
    if oracle:
        weights += (lm_config["text_card"] + 1) * lm_config["dim"] * dtype_bytes
    return Footprint(int(weights), kv_cache_bytes(lm_config, dtype_bytes, kv))


def sessions_that_fit(free_bytes: int, footprint: Footprint) -> int:
    spare = USABLE_FRACTION * free_bytes - footprint.weights_bytes
    return max(0, math.floor(spare / footprint.slot_bytes))


def sessions_check(settings: ServerSettings, machine: Machine, frontend: Probe, stt: Probe | None) -> Check:
    from kame.runtime import default_max_sessions

    requested = default_max_sessions(settings.max_sessions, machine.cuda)
    wanted = f"max_sessions {requested}" + ("" if settings.max_sessions else " (the default)")
    int8 = settings.quantize == "int8"
    unknown, total = _unknown_footprint(machine, frontend, stt), None
    if not unknown:
        try:
            total = _footprint(machine.cuda, int8, frontend.report, stt)
        except (KeyError, TypeError) as exc:  # a config without a context or layer count: moshi fails on it too
            unknown = f"the LM config has no usable {exc}"
    if total is None:
        return Check("warn", "sessions", f"not estimated ({unknown}); {wanted}")
    fit = sessions_that_fit(machine.free_bytes, total)
    kv = settings.kv_cache
    if kv == "auto":  # as kame serve decides: the model's dtype where the slots wanted fit, else int8
        kv = "model" if not machine.cuda or fit >= requested else "int8"
    kv_note = ""
    if kv == "int8":
        model_fit = fit
        total = _footprint(machine.cuda, int8, frontend.report, stt, "int8")
        fit = sessions_that_fit(machine.free_bytes, total)
        kv_note = ", int8 KV cache" + (f" (auto: {model_fit} fit with the model's)" if settings.kv_cache == "auto"
                                       else "")
    memory = "free" if machine.cuda else "of RAM available"
    text = (f"{fit} fit in {gb(machine.free_bytes)} {memory} (weights {'approx. ' if int8 else ''}"
            f"{size(total.weights_bytes)}{', int8 as 1 byte a parameter' if int8 else ''}, "
            f"{size(total.slot_bytes)} per slot{kv_note}{', kyutai-stt included' if stt else ''}); {wanted}")
    if fit == 0:
        return Check("FAIL", "sessions", f"{text}; not one slot fits beside the weights")
    if fit < requested:
        return Check("warn", "sessions", f"{text}; set --max-sessions {fit} or fewer")
    return Check("ok", "sessions", text)


def _footprint(cuda: bool, int8: bool, frontend: SourceReport, stt: Probe | None, kv: str = "model") -> Footprint:
    dtype_bytes = 2 if cuda else 4  # bf16 on CUDA, float32 on a CPU (the loader's default dtype)
    total = lm_footprint(frontend.params, frontend.lm_config, 1 if int8 else dtype_bytes, dtype_bytes, oracle=True,
                         kv=kv)
    if stt is not None:  # the STT engine batches as many sessions, in the same memory
        total += lm_footprint(stt.report.params, stt.report.lm_config, dtype_bytes, dtype_bytes, oracle=False)
    return total


def _unknown_footprint(machine: Machine, frontend: Probe, stt: Probe | None) -> str:
    """Why the memory cannot be estimated, or '' when it can."""
    if machine.device is None:
        return "no device"
    if machine.free_bytes is None:
        return "free memory unknown"
    for probe in (frontend, stt):
        if probe is not None and probe.report is None:
            return f"{probe.source} is not readable yet"
    return ""
