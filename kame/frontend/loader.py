"""Resolve a front-end *source* (preset, local directory or Hugging Face repo) into a ready model.

Where a checkpoint's files are is `checkpoint.py`'s part (moshi's CheckpointInfo, its `hf_get`
names); reading the weights tensor by tensor after moshi's load-time renames is `weights.py`'s.
This module puts the model together: moshi's LMModel (LoRA merged when the config has one; the
hibiki tweak moshi makes), KAME's oracle embedding (the checkpoint's `oracle_emb.weight`, or a copy
of `text_emb` for a plain Moshi), moshi's Mimi and the SentencePiece tokenizer.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import sentencepiece
import torch
from moshi.models import loaders
from moshi.models.compression import MimiModel
from moshi.models.lm import LMModel
from moshi.models.loaders import CheckpointInfo
from safetensors import SafetensorError
from torch import nn

from kame.errors import FrontendLoadError
from kame.frontend import weights
from kame.frontend.checkpoint import (
    HubOptions,
    config_notes,
    lm_kwargs,
    looks_like_repo_id,
    resolve_folder,
    resolve_repo,
)
from kame.frontend.presets import DIRECTORY_PRESETS, PRESET_NAMES, RANDOM_PRESETS, RandomPreset

logger = logging.getLogger(__name__)

DEFAULT_SOURCE = "SakanaAI/kame"
ORACLE_KEY = "oracle_emb.weight"
LORA_KEYS = {"lora": False, "lora_rank": 128, "lora_scaling": 2.0}  # moshi's get_moshi_lm defaults
Role = Literal["frontend", "stt"]


@dataclass
class Frontend:
    """A loaded Moshi-layout model: the LM, its Mimi codec and tokenizer, and its defaults. As the
    front-end it has its oracle embedding; as a speech-to-text model (the kyutai-stt ASR), none."""

    lm: LMModel
    oracle_emb: nn.Embedding | None  # [text_card + 1, dim], added to the LM input each frame
    mimi: MimiModel
    tokenizer: sentencepiece.SentencePieceProcessor | None
    lm_gen_config: dict = field(default_factory=dict)
    source: str = ""
    stt_config: dict = field(default_factory=dict)  # Kyutai STT checkpoints: audio prefix and delay
    quantize: str | None = None  # "int8": the LM's linear layers hold int8 weights (bitsandbytes)
    model_type: str = "moshi"  # config.json's model_type (moshi, stt, hibiki, ...)
    family: str = ""  # which Moshi-family model it is, what KAME runs of it, its weights' licence (`family`)
    language: str = "en"  # the language of its text stream (its tokenizer's: `text_language`): ja for J-Moshi
    folder: Path | None = None  # the checkpoint's folder (its voices/ or voices.tgz, where it has them)

    @property
    def device(self) -> torch.device:
        return self.lm.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm.dtype


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise FrontendLoadError("device 'cuda' was requested but no CUDA GPU is available; use --device cpu")
    return resolved


def resolve_source(
    source: str, *, hf_cache_dir: Path | None = None, local_files_only: bool | None = None,
    hf_endpoint: str | None = None,
) -> CheckpointInfo | RandomPreset:
    """A random preset, or the files of a directory preset, a local folder or a hub repo (downloaded
    unless `local_files_only`, default: the HF_HUB_OFFLINE env var; the cache if the hub is unreachable)."""
    if source in RANDOM_PRESETS:
        return RANDOM_PRESETS[source]
    if source in DIRECTORY_PRESETS:
        return resolve_folder(DIRECTORY_PRESETS[source], HubOptions(local_files_only=True))
    hub = HubOptions(hf_cache_dir, local_files_only, hf_endpoint)
    if Path(source).expanduser().is_dir():
        return resolve_folder(Path(source).expanduser(), hub)
    if looks_like_repo_id(source):
        return resolve_repo(source, hub)
    raise FrontendLoadError(
        f"front-end source {source!r} is neither a preset ({', '.join(PRESET_NAMES)}), "
        "an existing directory, nor a Hugging Face repo id like 'SakanaAI/kame'"
    )


def load_frontend(
    source: str = DEFAULT_SOURCE,
    device: str | torch.device = "auto",
    dtype: torch.dtype | None = None,
    *,
    hf_cache_dir: Path | None = None,
    local_files_only: bool | None = None,
    hf_endpoint: str | None = None,
    quantize: str | None = None,
    role: Role = "frontend",
) -> Frontend:
    """Load the model named by `source`: a preset, a local directory, or a hub repo id.

    `local_files_only` (default: the HF_HUB_OFFLINE env var) reads the hub cache only;
    `hf_cache_dir` and `hf_endpoint` override huggingface_hub's cache folder and hub URL.
    `quantize="int8"` (CUDA only) turns the LM's linear layers into bitsandbytes int8 ones, one
    layer at a time on the GPU, so that the bf16 weights never all sit there at once.
    `role="stt"`: a speech-to-text model for the kyutai-stt ASR (no oracle embedding).
    """
    dev = resolve_device(device)
    dtype = dtype or default_dtype(dev)
    check_quantize(quantize, dev)
    resolved = resolve_source(source, hf_cache_dir=hf_cache_dir, local_files_only=local_files_only,
                              hf_endpoint=hf_endpoint)
    if isinstance(resolved, RandomPreset):
        frontend = _load_random(resolved, dev, dtype, role)  # random weights: made on the device
    else:
        # to be quantized, the weights are read into CPU memory first, then go to the GPU layer by layer
        frontend = _load_checkpoint(resolved, torch.device("cpu") if quantize else dev, dtype, role)
    if quantize:
        _quantize_int8(frontend, dev)
    frontend.source = source
    if frontend.family:  # the name it was loaded by says which published model it is
        frontend.family += rl_note(source)
    if role == "frontend" and frontend.lm.dep_q == 0:
        raise FrontendLoadError(
            f"{source} is a speech-to-text model (model_type {frontend.model_type!r}, no depformer): it generates "
            f"no speech, so it cannot be the front-end; use it as the ASR: --asr kyutai-stt --asr-model {source}")
    logger.info("%s %s ready on %s (%s%s)%s", "front-end" if role == "frontend" else "model", source, dev,
                str(dtype).removeprefix("torch."), ", int8 linear layers" if quantize else "",
                f": {frontend.family}" if frontend.family and role == "frontend" else "")
    return frontend


QUANTIZE_CHOICES = ("int8",)


def check_quantize(quantize: str | None, device: torch.device) -> None:
    """A clear error before anything loads: int8 needs CUDA and bitsandbytes."""
    if quantize is None:
        return
    if quantize not in QUANTIZE_CHOICES:
        raise FrontendLoadError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)} (or none), not {quantize!r}")
    if device.type != "cuda":
        raise FrontendLoadError(
            f"--quantize {quantize} runs on a CUDA GPU only (bitsandbytes' int8 matmul); on {device.type} "
            "leave it off: the weights stay in their float dtype")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise FrontendLoadError(
            f"--quantize {quantize} needs bitsandbytes (moshi installs it on Linux): "
            "pip install 'bitsandbytes>=0.45,<0.50'"
        ) from exc


def _quantize_int8(frontend: Frontend, device: torch.device) -> None:
    """Move the LM (loaded on the CPU) to `device`, turning each nn.Linear into moshi's int8 QLinear there."""
    from moshi.utils.quantize import QLinear

    lm = frontend.lm
    linears = [(parent, name, child) for parent in lm.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    for parent, name, child in linears:  # one layer's bf16 weights on the GPU at a time
        setattr(parent, name, QLinear(child.to(device)))
    lm.to(device)
    if frontend.oracle_emb is not None:
        frontend.oracle_emb.to(device)
    frontend.mimi.to(device)
    frontend.quantize = "int8"


# ---------------------------------------------------------------- checkpoints


def split_lora(info: CheckpointInfo) -> tuple[dict, dict]:
    """(LMModel kwargs, LoRA settings): the LoRA layers are merged after the base weights are in."""
    kwargs = lm_kwargs(info)
    return kwargs, {key: kwargs.pop(key, default) for key, default in LORA_KEYS.items()}


def _new_lm(kwargs: dict, device: torch.device | str, dtype: torch.dtype, where: str) -> LMModel:
    try:
        return loaders.get_moshi_lm(None, lm_kwargs=kwargs, device=device, dtype=dtype)
    except (TypeError, AssertionError, KeyError, ValueError) as exc:
        raise FrontendLoadError(f"{where}: the LM config is not valid for moshi's LMModel: {exc}") from exc


def _weights_path(info: CheckpointInfo) -> Path:
    path = Path(info.moshi_weights)
    if not loaders._is_safetensors(path):
        raise FrontendLoadError(f"{path}: only safetensors checkpoints are read (moshi's torch.load format is not)")
    return path


@dataclass(frozen=True)
class _Checked:
    """A checkpoint whose config, weights' header and tokenizer agree, before any weight is read."""

    path: Path
    kwargs: dict  # LMModel kwargs, LoRA's taken out
    lora: dict
    lm: LMModel  # on the meta device
    header: dict[str, weights.TensorEntry]  # the LM's tensors
    oracle: weights.TensorEntry | None  # KAME's `oracle_emb.weight`, which the LM does not hold
    tokenizer: sentencepiece.SentencePieceProcessor


def _checked(info: CheckpointInfo, dtype: torch.dtype) -> _Checked:
    """What loading checks first, and `inspect_source` alone: every key and shape (after moshi's
    renames), the oracle table, the tokenizer against the LM's text vocabulary."""
    path = _weights_path(info)
    header = weights.read_header(path)
    kwargs, lora = split_lora(info)
    if not info.lm_config:  # no config.json, or an empty one (PersonaPlex's): the 7B's, its depformer counted
        kwargs = preset_from_weights(header, path)
    lm = _new_lm(kwargs, "meta", dtype, str(path))
    oracle = header.pop(ORACLE_KEY, None)
    weights.check_against(lm, header, path)
    if oracle is not None:
        _check_oracle_shape(lm, oracle.shape, path)
    tokenizer = _load_tokenizer(Path(info.tokenizer))
    _check_tokenizer(tokenizer, lm, info.tokenizer)
    return _Checked(path, kwargs, lora, lm, header, oracle, tokenizer)


def preset_from_weights(header: dict[str, weights.TensorEntry], path: Path) -> dict:
    """The LMModel kwargs of a checkpoint whose config.json is missing or empty: Moshi 7B's, as moshi assumes,
    with as many depformer steps as the weights hold (PersonaPlex's 16: the user's 8 codebooks too)."""
    kwargs = dict(loaders._lm_kwargs)
    steps = sum(1 for key in header if re.fullmatch(r"depformer_in\.\d+\.weight", key))
    if steps and steps != kwargs["dep_q"]:
        logger.info("%s: no LM config; the weights hold %d depformer steps: Moshi 7B's hyperparameters with "
                    "dep_q %d (%s)", path, steps, steps, "PersonaPlex's layout" if steps == 16 else "as found")
        kwargs["dep_q"] = steps
    return kwargs


def text_language(tokenizer: sentencepiece.SentencePieceProcessor | None) -> str:
    """"ja" for a Japanese tokenizer (J-Moshi's: a fifth or more of its pieces hold kana), else "en"."""
    if tokenizer is None:
        return "en"
    size = tokenizer.vocab_size()
    kana = sum(1 for i in range(size) if any("\u3040" <= c <= "\u30ff" for c in tokenizer.id_to_piece(i)))
    return "ja" if size and kana >= 0.2 * size else "en"


RL_SEAMLESS = {  # Kyutai's RL post-trained checkpoints: their base's layout, their own licence
    "kyutai/moshika-rl-seamless": "Moshi", "kyutai/personaplex-rl-seamless": "PersonaPlex"}


def family(lm_config: dict, has_oracle: bool, model_type: str = "moshi", preset: bool = False,
           language: str = "en", source: str = "") -> str:
    """The Moshi-family model a checkpoint is, what KAME runs of it, and the licence of its published weights
    (docs/languages.md, README's front-end sources): for `kame doctor` and the server's start-up log; `source`:
    the name it was loaded by (a hub repo's says which published model it is)."""
    return _family(lm_config, has_oracle, model_type, preset, language) + rl_note(source)


def rl_note(source: str) -> str:
    """What a family line adds for one of Kyutai's RL post-trained checkpoints (by its hub name), else ""."""
    repo = source.strip("/").lower()
    if repo not in RL_SEAMLESS:
        return ""
    return (f"; {repo}: {RL_SEAMLESS[repo]} post-trained with RL for pauses, turn-taking, backchannels and "
            "barge-in (Seamless Interaction data), CC BY-NC 4.0, gated (non-commercial)")


def _family(lm_config: dict, has_oracle: bool, model_type: str, preset: bool, language: str) -> str:
    if preset:
        return "a preset (random weights): oracle " + ("trained" if has_oracle else "from text_emb")
    if model_type != "moshi":
        return f"model type {model_type!r}"
    if int(lm_config.get("dep_q", 8)) == int(lm_config.get("n_q", 16)) == 16:
        oracle = "KAME's oracle" if has_oracle else "no oracle (runs as its reference)"
        return (f"PersonaPlex layout (the depformer predicts the user's 8 codebooks too; KAME steps the "
                f"assistant's): {oracle}; nvidia/personaplex-7b-v1: NVIDIA Open Model License, gated; "
                "kyutai/personaplex-rl-seamless: CC BY-NC 4.0, gated (non-commercial)")
    if language == "ja":
        oracle = "KAME's oracle" if has_oracle else "no oracle embedding: initialised from text_emb"
        return (f"J-Moshi (a Moshi speaking Japanese: a Japanese tokenizer; sessions think in Japanese, "
                f"docs/languages.md): {oracle}; nu-dialogue/j-moshi, nu-dialogue/j-moshi-ext: CC BY-NC 4.0 "
                "(non-commercial)")
    if has_oracle:
        return "KAME (a Moshi with an oracle embedding)"
    return "Moshi (no oracle embedding: initialised from text_emb)"


def assistant_layout(lm: LMModel, model_type: str = "moshi") -> None:
    """A depformer that predicts the user's codebooks after the assistant's (PersonaPlex: dep_q 16 of n_q 16) is
    stepped for the assistant's only: the user's stream comes from the user. moshi's LMGen takes as input the
    codebooks past `dep_q`; on dep_q 16 it would take none and drop the user's audio. The depformer's steps are
    sequential, so the assistant's tokens are the same as when all 16 are stepped (greedy)."""
    if model_type == "moshi" and lm.dep_q == lm.n_q and lm.n_q % 2 == 0 and lm.n_q >= 2:
        lm.predicted_q = lm.dep_q  # what the weights predict, for doctor
        lm.dep_q = lm.n_q // 2


def _load_checkpoint(info: CheckpointInfo, device: torch.device, dtype: torch.dtype, role: Role) -> Frontend:
    for note in config_notes(info, {"lm_gen_config"} if role == "frontend" else {"stt_config"}):
        logger.info(note)
    checked = _checked(info, dtype)
    if checked.kwargs.get("quantize") and device.type != "cuda":
        raise FrontendLoadError(f"{checked.path} holds int8 weights (config.json: quantize true): they run on a "
                                "CUDA GPU with bitsandbytes only")
    tensors = checked.header | ({ORACLE_KEY: checked.oracle} if checked.oracle is not None else {})
    state = weights.read_state(checked.path, tensors, dtype, device)
    oracle_weight = state.pop(ORACLE_KEY, None)
    lm = checked.lm
    lm.load_state_dict(state, strict=True, assign=True)
    if checked.lora["lora"]:
        lm = _merge_lora(lm, info, checked.lora, device, dtype)
    if info.model_type == "hibiki":  # as moshi's CheckpointInfo.get_moshi: an early EOS reads as padding
        lm.text_emb.weight.data[2] = lm.text_emb.weight.data[3]
    assistant_layout(lm, info.model_type)
    lm.eval()
    oracle = None
    if role == "frontend" and (oracle_weight is not None or not getattr(lm, "predicted_q", None)):
        oracle = _oracle_embedding(lm, oracle_weight, checked.path, device, dtype)
    elif role == "frontend":
        logger.info("%s has no %s: a PersonaPlex-layout checkpoint runs as its reference does, with no oracle "
                    "added to its input", checked.path, ORACLE_KEY)
    language = text_language(checked.tokenizer)
    kind = family(checked.kwargs, oracle_weight is not None, info.model_type, language=language)
    return Frontend(lm, oracle, _mimi(info, device, lm), checked.tokenizer, dict(info.lm_gen_config),
                    stt_config=dict(info.stt_config), model_type=info.model_type, family=kind, language=language,
                    folder=checked.path.parent)


def _merge_lora(lm: LMModel, info: CheckpointInfo, lora: dict, device: torch.device, dtype: torch.dtype) -> LMModel:
    """moshi's LoRA layers over the loaded base, their weights from lora_name, merged into plain linears."""
    logger.info("merging the LoRA adapters of %s (rank %s, scaling %s)", info.lora_weights, lora["lora_rank"],
                lora["lora_scaling"])
    try:
        return loaders.get_lora_moshi(lm, info.lora_weights, lora["lora_rank"], lora["lora_scaling"], dtype=dtype,
                                      device=device, fuse_lora=True)
    except (RuntimeError, AssertionError, SafetensorError, OSError) as exc:
        raise FrontendLoadError(f"cannot apply the LoRA weights {info.lora_weights}: {exc}") from exc


def _mimi(info: CheckpointInfo, device: torch.device, lm: LMModel | None = None) -> MimiModel:
    try:
        if lm is not None and getattr(lm, "predicted_q", None):  # PersonaPlex: Mimi's codes are one side's 8
            return loaders.get_mimi(info.mimi_weights, info.mimi_config, device=device,
                                    num_codebooks=max(lm.dep_q, lm.n_q - lm.dep_q))
        return info.get_mimi(device=device)  # moshi's: its codebook count from the LM config (and TTS multistream)
    except (RuntimeError, KeyError, TypeError, SafetensorError, OSError) as exc:
        raise FrontendLoadError(
            f"cannot load the Mimi codec from {info.mimi_weights}: {exc}. Check mimi_config_name matches the weights"
        ) from exc


def _oracle_embedding(
    lm: LMModel, weight: torch.Tensor | None, path: Path | str, device: torch.device, dtype: torch.dtype
) -> nn.Embedding:
    if weight is None:
        logger.info("%s has no %s%s: oracle embedding initialised from text_emb", path, ORACLE_KEY,
                    "" if str(path).startswith("preset") else " (a plain Moshi checkpoint)")
        weight = lm.text_emb.weight.detach().clone()
    emb = nn.Embedding(lm.text_card + 1, lm.dim, device=device, dtype=dtype)
    with torch.no_grad():
        emb.weight.copy_(weight.to(device=device, dtype=dtype))
    return emb.eval().requires_grad_(False)


def oracle_from_text_emb(lm: LMModel) -> nn.Embedding:
    """A new oracle table for an LM that has none (a PersonaPlex base KAME is trained on): `text_emb`'s copy."""
    return _oracle_embedding(lm, None, "a base without one", lm.device, lm.dtype)


def _check_oracle_shape(lm: LMModel, shape: tuple[int, ...], path: Path | str) -> None:
    if shape != (lm.text_card + 1, lm.dim):
        raise FrontendLoadError(
            f"{path}: {ORACLE_KEY} has shape {shape}, expected ({lm.text_card + 1}, {lm.dim}) "
            "(text_card + 1 rows, like text_emb)"
        )


def _load_tokenizer(path: Path | None) -> sentencepiece.SentencePieceProcessor | None:
    if path is None:
        return None
    try:
        return sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as exc:
        raise FrontendLoadError(f"cannot load the SentencePiece tokenizer {path}: {exc}") from exc


def _check_tokenizer(tokenizer: sentencepiece.SentencePieceProcessor | None, lm: LMModel, path: Path | None) -> None:
    if tokenizer is not None and tokenizer.vocab_size() > lm.text_card:
        raise FrontendLoadError(
            f"{path} has {tokenizer.vocab_size()} pieces but the LM's text_card is {lm.text_card}"
        )


def _load_random(preset: RandomPreset, device: torch.device, dtype: torch.dtype, role: Role) -> Frontend:
    logger.info("front-end preset %s: %s", preset.name, preset.description)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(preset.seed)
        lm = _new_lm(preset.lm_kwargs(), device, dtype, f"preset {preset.name}")
        mimi = _build_mimi(preset.mimi_config, {**preset.lm_config, "dep_q": min(8, preset.lm_config["dep_q"])},
                           device)
    assistant_layout(lm)  # a PersonaPlex-layout preset steps the assistant's codebooks only
    persona = bool(getattr(lm, "predicted_q", None))  # ... and, as PersonaPlex, takes no oracle
    oracle_emb = (_oracle_embedding(lm, None, f"preset {preset.name}", device, dtype)
                  if role == "frontend" and not persona else None)
    tokenizer = _load_tokenizer(preset.tokenizer)
    _check_tokenizer(tokenizer, lm, preset.tokenizer)
    return Frontend(lm, oracle_emb, mimi, tokenizer, dict(preset.lm_gen_config), stt_config=dict(preset.stt_config))


def _build_mimi(config: dict | None, lm_config: dict, device: torch.device) -> MimiModel:
    """A Mimi with random weights, as moshi's CheckpointInfo.get_mimi sizes it for this LM."""
    info = CheckpointInfo(None, None, None, lm_config=lm_config, mimi_config=config)  # type: ignore[arg-type]
    return info.get_mimi(device=device)


# ---------------------------------------------------------------- inspection (no weights read)


@dataclass(frozen=True)
class SourceReport:
    """What a source holds, from its config and the safetensors header alone."""

    source: str
    info: CheckpointInfo | None  # None: a random preset
    lm_config: dict  # the LMModel kwargs
    params: int  # LM parameters, the oracle embedding left out
    file_bytes: int  # 0 for a random preset
    file_dtype: str | None  # e.g. "bf16", "f32", or "bf16+f32"
    fused_attention: int  # attention modules stored fused (Kyutai's layout), split on load
    has_oracle: bool
    language: str = "en"  # its text stream's (`text_language`)

    @property
    def dim(self) -> int:
        return int(self.lm_config["dim"])

    @property
    def extra_heads(self) -> int:
        return int(self.lm_config.get("extra_heads_num_heads", 0))


def inspect_source(source: str, *, hf_cache_dir: Path | None = None, local_files_only: bool | None = True,
                   hf_endpoint: str | None = None) -> SourceReport:
    """Resolve `source` (the cache only, by default) and check its weights' header against its config
    key by key, as loading would, without reading a weight."""
    resolved = resolve_source(source, hf_cache_dir=hf_cache_dir, local_files_only=local_files_only,
                              hf_endpoint=hf_endpoint)
    if isinstance(resolved, RandomPreset):
        lm = _new_lm(resolved.lm_kwargs(), "meta", torch.bfloat16, f"preset {source}")
        return SourceReport(source, None, resolved.lm_kwargs(), _numel(lm), 0, None, 0, False)
    checked = _checked(resolved, torch.bfloat16)
    dtypes = sorted({str(e.dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float", "f")
                     for e in checked.header.values() if e.dtype.is_floating_point})
    fused = sum(key.endswith(("in_proj_weight", "in_proj.weight")) for key in checked.header)
    return SourceReport(source, resolved, checked.kwargs, _numel(checked.lm), checked.path.stat().st_size,
                        "+".join(dtypes) or None, fused, checked.oracle is not None, text_language(checked.tokenizer))


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
