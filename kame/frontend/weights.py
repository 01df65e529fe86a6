"""A safetensors checkpoint read into a model tensor by tensor, after moshi's own load-time renames.

The header is read first: every key, after the renames the model's load hooks make (moshi splits
Kyutai's fused attention projections and maps LoRA weights this way), is checked against the model
with an error that names the file and the problem, before a single weight is read. Then each
tensor is read from the file on its own, cast to the runtime dtype and moved to the device, so the
peak is the model at its runtime dtype plus the largest tensor; a memory-mapped read would instead
count every page of the file in the process's memory (measured: docs/benchmarks.md).
"""

from __future__ import annotations

import json
import logging
import math
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kame.errors import FrontendLoadError

logger = logging.getLogger(__name__)

# safetensors' dtype names (its format document), as torch dtypes
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
KEEP_FLOAT32 = ("condition_provider.", "fuser.")  # moshi's loader keeps these in float32
MAX_HEADER_BYTES = 100 * 2**20
PROGRESS_BYTES = 2**30  # files above this log their progress


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file, as its header describes it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def meta(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of a safetensors file (no data read), every entry checked against the file's size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ValueError("shorter than a header")
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"a header of {length} bytes does not fit")
            raw = json.loads(fh.read(length))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise FrontendLoadError(f"cannot read {path} as safetensors: {exc}") from exc
    if not isinstance(raw, dict):
        raise FrontendLoadError(f"cannot read {path} as safetensors: its header is not a JSON object")
    raw.pop("__metadata__", None)
    return {key: _entry(path, key, value, 8 + length, size) for key, value in raw.items()}


def _entry(path: Path, key: str, value: object, base: int, size: int) -> TensorEntry:
    def bad(why: str) -> FrontendLoadError:
        return FrontendLoadError(f"cannot read {path} as safetensors: {key}: {why} ({str(value)[:200]})")

    name = value.get("dtype") if isinstance(value, dict) else None
    if not isinstance(name, str) or name not in DTYPES:
        raise bad(f"unsupported dtype {name!r}")
    shape, offsets = value.get("shape"), value.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad("the shape is not a list of sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
        raise bad("the data offsets are not two byte positions")
    dtype, shape = DTYPES[name], tuple(shape)
    begin, end = (base + o for o in offsets)
    if not base <= begin <= end <= size or end - begin != math.prod(shape) * dtype.itemsize:
        raise FrontendLoadError(f"cannot read {path} as safetensors: {key}'s bytes do not fit its shape "
                                "or the file (a truncated download?)")
    return TensorEntry(dtype, shape, begin, end)


def apply_load_hooks(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Run the load-state-dict pre-hooks of `module` and its children on `state`, in the order
    `load_state_dict` runs them: the renames a checkpoint gets on its way in (moshi's attention
    splits `in_proj_weight` into `in_projs.{i}.weight`; its LoRALinear maps `weight` to `frozen_W`)."""
    for name, sub in module.named_modules():
        for hook in sub._load_state_dict_pre_hooks.values():
            hook(state, f"{name}." if name else "", {}, True, [], [], [])


def check_against(module: nn.Module, header: dict[str, TensorEntry], path: Path) -> None:
    """The header, renamed as loading renames it, matches `module` key for key and shape for shape."""
    renamed = {key: entry.meta() for key, entry in header.items()}
    apply_load_hooks(module, renamed)
    expected = module.state_dict()
    unknown = sorted(set(renamed) - set(expected))
    missing = sorted(set(expected) - set(renamed))
    if unknown:
        raise FrontendLoadError(
            f"{path} has keys the LM does not know: {_some(unknown)}; is config.json the one made for "
            "these weights?")
    if missing:
        raise FrontendLoadError(
            f"{path} lacks {len(missing)} LM weights, e.g. {_some(missing)}; the file is "
            "incomplete or config.json describes another model")
    for key, value in renamed.items():
        if value.shape != expected[key].shape:
            raise FrontendLoadError(
                f"{path}: {key} has shape {tuple(value.shape)}, the config expects "
                f"{tuple(expected[key].shape)}; config.json does not match these weights")


def _some(keys: list[str]) -> str:
    return ", ".join(keys[:5]) + (" ..." if len(keys) > 5 else "")


def runtime_dtype(key: str, stored: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """moshi's rule: floating tensors in the runtime dtype, but the conditioners' and int8 scales in float32."""
    if not stored.is_floating_point:
        return stored
    if key.startswith(KEEP_FLOAT32) or key.endswith("_scb"):
        return torch.float32
    return dtype


class TensorReader:
    """Reads one tensor of a safetensors file at a time (plain reads, no memory map)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()/the context manager

    def read(self, entry: TensorEntry) -> torch.Tensor:
        tensor = torch.empty(entry.shape, dtype=entry.dtype)
        view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if entry.numel else memoryview(b"")
        self._file.seek(entry.start)
        done = 0
        while done < len(view):
            got = self._file.readinto(view[done:])
            if not got:
                raise FrontendLoadError(f"{self.path} ended inside a tensor (a truncated download?)")
            done += got
        return tensor

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_state(
    path: Path, header: dict[str, TensorEntry], dtype: torch.dtype, device: torch.device,
) -> dict[str, torch.Tensor]:
    """Every tensor of the file, each cast (on the CPU) and moved to `device` before the next is read."""
    total = sum(e.end - e.start for e in header.values())
    started, done, step = time.perf_counter(), 0, 0.25
    state = {}
    with TensorReader(path) as reader:
        for key, entry in header.items():
            tensor = reader.read(entry).to(runtime_dtype(key, entry.dtype, dtype))
            state[key] = tensor.to(device)
            done += entry.end - entry.start
            if total >= PROGRESS_BYTES and done >= step * total:
                logger.info("reading %s: %d %% of %.1f GB (%.0f s)", path.name, 100 * done // total, total / 1e9,
                            time.perf_counter() - started)
                step += 0.25
    return state
