"""Checkpoints in the layouts of the public hub repos, for the loader's tests and the full-size check.

Each layout is written from the reference code's own definitions, never through this project's
export (a fixture from the code under test could not catch a mismatch):

- Kyutai's PyTorch checkpoints (kyutai/moshiko-pytorch-bf16, kyutai/stt-1b-en_fr): bf16, every
  attention's projections fused into `self_attn.in_proj_weight` / `self_attn.out_proj.weight`, the
  inverse of the split in the load hook of moshi's StreamingMultiheadAttention (`weight.view(mult,
  -1, ...)[i]`); config.json keys as moshi's CheckpointInfo reads them (moshi's default file names
  where a key is left out); the STT's `stt_config`, and its end-of-turn `extra_heads` only in the
  checkpoints that have them.
- Sakana's KAME checkpoint: split keys (`in_projs.{i}`, as KAME's LMModel saves them), float32, plus
  `oracle_emb.weight` (text_card + 1 rows, like `text_emb`); Mimi and tokenizer named
  `hf://kyutai/...` (another repo) or `file://` (a local file), as moshi's `hf_get` allows.
- A legacy repo without config.json (moshi assumes Moshi 7B and its default file names).
- The Hugging Face hub cache: `models--owner--repo/blobs/*`, `snapshots/HASH/NAME` symlinks to the
  blobs, `refs/main` holding HASH (huggingface_hub's cache layout).

Weights are random (seeded); `sparse_safetensors` writes a file of the right size without its data
(a sparse file of zeros), for full-size layouts that only have to be read.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from moshi.models import loaders
from moshi.models.lm import LMModel
from moshi.modules.transformer import StreamingMultiheadAttention
from safetensors.torch import save_file

from kame.frontend.presets import TINY_COPY_DIR, TINY_LM_CONFIG, TINY_MIMI_CONFIG

TOKENIZER = TINY_COPY_DIR / "tokenizer.model"  # a real SentencePiece model (1000 pieces)
MOSHIKO_REPO = "kyutai/moshiko-pytorch-bf16"
KAME_REPO = "SakanaAI/kame"
STT_TOKENIZER_NAME = "tokenizer_en_fr_audio_8000.model"
STT_MIMI_NAME = "mimi-pytorch-e351c8d8@125.safetensors"
ORACLE_KEY = "oracle_emb.weight"

# Kyutai STT 1B's architecture, from kyutai-labs/delayed-streams-modeling (configs/config-stt-en_fr-hf.toml):
# d_model 2048, 16 layers of 16 heads, feed-forward 8192, context 750, max_period 100000, 32 audio
# codebooks in, text vocabulary 8000, no depformer; 4 extra heads of dim 6 where present
STT_1B_LM_CONFIG: dict = {
    "dim": 2048, "text_card": 8000, "existing_text_padding_id": 3, "n_q": 32, "dep_q": 0, "card": 2048,
    "num_heads": 16, "num_layers": 16, "hidden_scale": 4.0, "causal": True, "layer_scale": None,
    "context": 750, "max_period": 100000, "gating": "silu", "norm": "rms_norm_f32",
    "positional_embedding": "rope", "delays": [0] * 33,
}
STT_CONFIG = {"audio_silence_prefix_seconds": 1.0, "audio_delay_seconds": 0.5}
EOT_HEADS = {"extra_heads_num_heads": 4, "extra_heads_dim": 6}
TINY_STT_LM_CONFIG: dict = {
    **{k: v for k, v in TINY_LM_CONFIG.items() if not k.startswith("depformer")},
    "n_q": 4, "dep_q": 0, "delays": [0] * 5,
}


@dataclass(frozen=True)
class Weights:
    """A random model in memory: the LM's state (split keys, as moshi's modules hold it) and Mimi's."""

    lm_config: dict
    lm_state: dict[str, torch.Tensor]
    mimi_config: dict
    mimi_state: dict[str, torch.Tensor]
    attention_mult: dict[str, int]  # prefix of each attention module -> its number of weight sets


def random_weights(lm_config: dict, mimi_config: dict = TINY_MIMI_CONFIG, seed: int = 0,
                   dtype: torch.dtype = torch.bfloat16) -> Weights:
    """A seeded random LM and Mimi built by moshi, the LM's weights rounded to `dtype` (what the file holds)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        lm = loaders.get_moshi_lm(None, lm_kwargs=copy.deepcopy(lm_config), device="cpu", dtype=torch.float32)
        mimi = loaders.get_mimi(None, copy.deepcopy(mimi_config), device="cpu")
        with torch.no_grad():  # Mimi's codebooks start all zero: give them values, so codes vary with the sound
            for name, buffer in mimi.named_buffers():
                if name.endswith("embedding_sum"):
                    buffer.normal_()
    state = {k: v.detach().to(dtype).clone() for k, v in lm.state_dict().items()}
    return Weights(copy.deepcopy(lm_config), state, copy.deepcopy(mimi_config),
                   {k: v.detach().clone() for k, v in mimi.state_dict().items()}, attention_mult(lm))


def attention_mult(lm: LMModel) -> dict[str, int]:
    return {f"{name}.": module.mult for name, module in lm.named_modules()
            if isinstance(module, StreamingMultiheadAttention)}


def fused(state: dict[str, torch.Tensor], mult: dict[str, int]) -> dict[str, torch.Tensor]:
    """Kyutai's layout: each attention's `in_projs.{i}.weight` concatenated into `in_proj_weight`,
    `out_projs.{i}.weight` into `out_proj.weight` (moshi's load hook views them back apart)."""
    out = dict(state)
    for prefix, count in mult.items():
        for split, joined in (("in_projs", "in_proj_weight"), ("out_projs", "out_proj.weight")):
            parts = [out.pop(f"{prefix}{split}.{i}.weight") for i in range(count)]
            out[prefix + joined] = torch.cat(parts, dim=0)
    return out


def save(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def write_config(folder: Path, config: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))


# ---------------------------------------------------------------- repos


def kyutai_moshi_repo(folder: Path, weights: Weights) -> Path:
    """A Kyutai Moshi repo: bf16 fused weights under moshi's default names (config.json names none of them)."""
    save(folder / loaders.MOSHI_NAME, fused(weights.lm_state, weights.attention_mult))
    save(folder / loaders.MIMI_NAME, weights.mimi_state)
    shutil.copyfile(TOKENIZER, folder / loaders.TEXT_TOKENIZER_NAME)
    (folder / "mimi_config.json").write_text(json.dumps(weights.mimi_config))
    write_config(folder, {**weights.lm_config, "mimi_config_name": "mimi_config.json",
                          "lm_gen_config": {"use_sampling": False}})
    return folder


def kyutai_stt_repo(folder: Path, weights: Weights) -> Path:
    """A Kyutai STT repo (as kyutai/stt-1b-en_fr): fused bf16 weights, model_type stt, stt_config."""
    save(folder / loaders.MOSHI_NAME, fused(weights.lm_state, weights.attention_mult))
    save(folder / STT_MIMI_NAME, weights.mimi_state)
    shutil.copyfile(TOKENIZER, folder / STT_TOKENIZER_NAME)
    (folder / "mimi_config.json").write_text(json.dumps(weights.mimi_config))
    write_config(folder, {**weights.lm_config, "model_type": "stt", "mimi_name": STT_MIMI_NAME,
                          "tokenizer_name": STT_TOKENIZER_NAME, "mimi_config_name": "mimi_config.json",
                          "stt_config": dict(STT_CONFIG), "lm_gen_config": {"temp": 0.0, "temp_text": 0.0}})
    return folder


def kame_repo(folder: Path, weights: Weights, oracle: torch.Tensor, mimi: str, tokenizer: str,
              mimi_config: str) -> Path:
    """A KAME repo: split float32 weights with `oracle_emb.weight`; Mimi, its config and the
    tokenizer named as given (`hf://kyutai/...` or `file:///...`)."""
    state = {k: v.float() for k, v in weights.lm_state.items()} | {ORACLE_KEY: oracle.float()}
    save(folder / "model.safetensors", state)
    write_config(folder, {**weights.lm_config, "moshi_name": "model.safetensors", "mimi_name": mimi,
                          "tokenizer_name": tokenizer, "mimi_config_name": mimi_config,
                          "model_type": "moshi", "lm_gen_config": {"use_sampling": False},
                          "model_id": {"sig": "fixture", "epoch": 0}})
    return folder


def own_layout(folder: Path, weights: Weights, oracle: torch.Tensor | None, extra: dict | None = None) -> Path:
    """The same weights in this project's layout (split float32 keys, every name explicit, local files)."""
    state = {k: v.float() for k, v in weights.lm_state.items()}
    if oracle is not None:
        state[ORACLE_KEY] = oracle.float()
    save(folder / "model.safetensors", state)
    save(folder / "mimi.safetensors", weights.mimi_state)
    shutil.copyfile(TOKENIZER, folder / "tokenizer.model")
    (folder / "mimi_config.json").write_text(json.dumps(weights.mimi_config))
    write_config(folder, {**weights.lm_config, "moshi_name": "model.safetensors", "mimi_name": "mimi.safetensors",
                          "tokenizer_name": "tokenizer.model", "mimi_config_name": "mimi_config.json",
                          "lm_gen_config": {"use_sampling": False}, **(extra or {})})
    return folder


def hf_cache_repo(cache: Path, repo_id: str, files: Path, commit: str = "0" * 40) -> Path:
    """Put the files of folder `files` into a huggingface_hub cache as a download of `repo_id` would:
    content in blobs/, the snapshot's names symlinked to them, refs/main naming the snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in sorted(p for p in files.rglob("*") if p.is_file()):
        blob = repo / "blobs" / _blob_name(path)
        if not blob.exists():
            try:
                os.link(path, blob)  # a sparse full-size file stays sparse
            except OSError:
                shutil.copyfile(path, blob)
        link = snapshot / path.relative_to(files)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def _blob_name(path: Path) -> str:
    """The content's sha256, as the hub names an LFS blob; for a file over 64 MB (a sparse full-size
    fixture) a hash of its name and size instead: readers never look inside the name."""
    digest = hashlib.sha256()
    if path.stat().st_size > 64 * 2**20:
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
        return digest.hexdigest()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------- full size, without the data


_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}


def sparse_safetensors(path: Path, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> Path:
    """A safetensors file of these tensors whose data is a hole (reads as zeros; takes no disk space)."""
    header, offset = {}, 0
    for key, (shape, dtype) in shapes.items():
        size = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + offset)
    return path


def layout_shapes(lm_config: dict | None, dtype: torch.dtype = torch.bfloat16,
                  fuse: bool = True) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The keys and shapes of an LM checkpoint (Kyutai's fused layout by default), from moshi's
    LMModel built on the meta device (None: Moshi 7B's config, as moshi assumes without config.json)."""
    lm = LMModel(device="meta", dtype=dtype, **copy.deepcopy(lm_config or loaders._lm_kwargs))
    state = lm.state_dict()
    if fuse:
        state = fused(state, attention_mult(lm))
    return {key: (tuple(value.shape), value.dtype) for key, value in state.items()}


def mimi_shapes() -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Mimi's published architecture (moshi's default config), float32 like Kyutai's file."""
    with torch.device("meta"):
        mimi = loaders.get_mimi(None, device="meta")
    return {key: (tuple(value.shape), torch.float32) for key, value in mimi.state_dict().items()}
