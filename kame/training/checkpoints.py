"""The trainer's checkpoints in RUN/train: the trained weights, optimizer and sampler state by step.

A checkpoint holds only what training changes (all LM weights in a full fine-tune, the LoRA
adapters under LoRA) plus the oracle embedding, so that a LoRA checkpoint of a 7B model stays
small; the base front-end named in RUN/train/config.json supplies the rest.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from kame.errors import KameError
from kame.training.runfiles import write_json

KEEP = 2  # checkpoints kept on disk: the newest ones
_NAME = re.compile(r"step-(\d+)\.pt$")


@dataclass(frozen=True)
class RunConfig:
    """What a training run was started with; a resumed run must agree."""

    frontend: str
    lora_rank: int | None
    steps: int
    chunk: int
    batch: int
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    warmup: int
    seed: int
    augment: bool = True  # jitter and drop oracle events (kame.training.augment)
    audio_weight: float = 1.0  # the audio loss's share of the total
    fsdp: bool = False  # sharded over torchrun's processes (kame.training.sharding)


def train_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "train"


def write_config(run_dir: Path, config: RunConfig) -> None:
    """RUN/train/config.json, replaced atomically (another rank may be reading it)."""
    write_json(train_dir(run_dir) / "config.json", asdict(config))


def read_config(run_dir: Path) -> RunConfig:
    path = train_dir(run_dir) / "config.json"
    if not path.is_file():
        raise KameError(f"{path} is missing: this run has not been trained yet (run `kame train` first)")
    raw = json.loads(path.read_text())
    raw["betas"] = tuple(raw["betas"])
    return RunConfig(**raw)


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint, oldest first."""
    folder = train_dir(run_dir)
    found = [(int(m.group(1)), p) for p in folder.glob("step-*.pt") if (m := _NAME.search(p.name))]
    return sorted(found)


def latest(run_dir: Path) -> tuple[int, Path] | None:
    found = checkpoints(run_dir)
    return found[-1] if found else None


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters() if p.requires_grad}


def save(run_dir: Path, step: int, weights: dict[str, torch.Tensor], extra: dict) -> Path:
    """Write step-N.pt (the trained `weights`, see `trainable_state`, and `extra`) atomically (a
    crash never leaves a half file) and drop the older ones."""
    path = train_dir(run_dir) / f"step-{step:06d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, "weights": weights, **extra}, tmp)
    tmp.replace(path)
    for _, old in checkpoints(run_dir)[:-KEEP]:
        old.unlink()
    return path


def load(path: Path) -> dict:
    """A checkpoint, memory-mapped: the ranks of a resumed run (and eval, export) share the page
    cache instead of each holding a copy (a sharded 7B checkpoint is 94 GB)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except (OSError, RuntimeError) as exc:
        raise KameError(f"cannot read checkpoint {path}: {exc}") from exc


def restore_weights(model: nn.Module, weights: dict[str, torch.Tensor], path: Path) -> None:
    params = dict(model.named_parameters())
    unknown = sorted(set(weights) - set(params))
    if unknown:
        raise KameError(f"{path} holds weights this model lacks ({unknown[0]}, ...): was it made with another "
                        "--lora-rank or front-end?")
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value.to(params[name]))
