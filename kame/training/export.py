"""RUN/checkpoint: the trained front-end in the loader's layout, loadable with `--frontend RUN/checkpoint`.

config.json (the base's LM kwargs, file names and lm_gen_config), model.safetensors (the LM
state with any LoRA merged into plain weights, plus `oracle_emb.weight`), and the base's Mimi
weights, Mimi config and tokenizer, copied.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from kame.errors import KameError
from kame.frontend import loader
from kame.frontend.loader import ORACLE_KEY, Frontend
from kame.frontend.presets import RandomPreset
from kame.training import checkpoints
from kame.training.evaluate import load_trained
from kame.training.train import SMALL_MODEL_PARAMS

logger = logging.getLogger(__name__)

MODEL_NAME = "model.safetensors"
MIMI_NAME = "mimi.safetensors"
MIMI_CONFIG_NAME = "mimi_config.json"
TOKENIZER_NAME = "tokenizer.model"


@dataclass(frozen=True)
class BaseFiles:
    """What the checkpoint takes over from its base front-end."""

    lm_config: dict
    lm_gen_config: dict
    mimi_weights: Path | None  # None: a random preset, whose drawn Mimi is saved from memory
    mimi_config: dict | None  # None: Mimi's published config
    tokenizer: Path | None


def base_files(source: str) -> BaseFiles:
    """The base's files, resolved the way the loader resolves them (presets, directories, hub cache)."""
    resolved = loader.resolve_source(source, local_files_only=True)  # training loaded it: it is on disk
    if isinstance(resolved, RandomPreset):
        return BaseFiles(resolved.lm_kwargs(), dict(resolved.lm_gen_config), None, resolved.mimi_config,
                         resolved.tokenizer)
    lm_config, _ = loader.split_lora(resolved)  # a LoRA base is exported merged: plain weights
    return BaseFiles(lm_config, dict(resolved.lm_gen_config), Path(resolved.mimi_weights), resolved.mimi_config,
                     Path(resolved.tokenizer))


def export(run_dir: Path, device: str | torch.device = "auto") -> Path:
    """Write RUN/checkpoint from the newest training checkpoint and return its folder."""
    run_dir = Path(run_dir)
    config = checkpoints.read_config(run_dir)
    files = base_files(config.frontend)
    if files.tokenizer is None:
        raise KameError(f"base front-end {config.frontend!r} has no text tokenizer: its checkpoint could not take "
                        "an oracle; train from a base with one")
    model, frontend, step = load_trained(run_dir, device)
    out = run_dir / "checkpoint"
    out.mkdir(parents=True, exist_ok=True)
    _write_weights(out / MODEL_NAME, model.lm.state_dict(), model.oracle_emb.weight)
    _write_mimi(out, files, frontend)
    shutil.copyfile(files.tokenizer, out / TOKENIZER_NAME)
    names = {"moshi_name": MODEL_NAME, "mimi_name": MIMI_NAME, "tokenizer_name": TOKENIZER_NAME,
             "lm_gen_config": files.lm_gen_config}
    if files.mimi_config is not None:
        names["mimi_config_name"] = MIMI_CONFIG_NAME
    (out / "config.json").write_text(json.dumps(files.lm_config | names, indent=2) + "\n")
    provenance = {"base": config.frontend, "step": step, "lora_rank": config.lora_rank,
                  "lora_merged": bool(config.lora_rank)}
    (out / "training.json").write_text(json.dumps(provenance, indent=2) + "\n")
    logger.info("exported step %d to %s", step, out)
    return out


def _write_weights(path: Path, state: dict[str, torch.Tensor], oracle: torch.Tensor) -> None:
    """The LM state + oracle embedding; a large model in bf16 (what it serves in), a small one in fp32."""
    params = sum(v.numel() for v in state.values())
    dtype = torch.bfloat16 if params >= SMALL_MODEL_PARAMS else torch.float32
    tensors = {key: _cpu(value, dtype) for key, value in state.items()}
    tensors[ORACLE_KEY] = _cpu(oracle, dtype)
    save_file(tensors, str(path))


def _cpu(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    value = value.detach()
    return value.to("cpu", dtype if value.dtype.is_floating_point else value.dtype).clone().contiguous()


def save_mimi(mimi: torch.nn.Module, path: Path) -> None:
    """A Mimi in memory (a random preset's, say) as the loader reads it: its state dict, on the CPU."""
    save_file({k: v.detach().cpu().clone().contiguous() for k, v in mimi.state_dict().items()}, str(path))


def _write_mimi(out: Path, files: BaseFiles, frontend: Frontend) -> None:
    if files.mimi_weights is not None:
        shutil.copyfile(files.mimi_weights, out / MIMI_NAME)
    else:
        save_mimi(frontend.mimi, out / MIMI_NAME)
    if files.mimi_config is not None:
        (out / MIMI_CONFIG_NAME).write_text(json.dumps(files.mimi_config, indent=2) + "\n")
