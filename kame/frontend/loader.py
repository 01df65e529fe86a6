"""Resolve a front-end *source* (preset, local directory or Hugging Face repo) into a ready model.

A source directory is laid out like a Moshi/KAME repo on the hub: ``config.json`` holding the LM
kwargs plus ``moshi_name``, ``mimi_name``, optional ``mimi_config_name``, ``tokenizer_name`` and
``lm_gen_config``. A KAME checkpoint is a Moshi LM state dict plus ``oracle_emb.weight``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import sentencepiece
import torch
from moshi.models import loaders
from moshi.models.compression import MimiModel
from moshi.models.lm import LMModel
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from kame.errors import FrontendLoadError
from kame.frontend.presets import DIRECTORY_PRESETS, PRESET_NAMES, RANDOM_PRESETS, RandomPreset

logger = logging.getLogger(__name__)

DEFAULT_SOURCE = "SakanaAI/kame"
ORACLE_KEY = "oracle_emb.weight"
OFFLINE_HINT = (
    "To run without the hub, pass a local directory in the same layout, or the offline demo "
    "preset `--frontend tiny-copy`."
)


@dataclass
class Frontend:
    """Everything the engine needs: LM + oracle embedding, Mimi codec, tokenizer, defaults."""

    lm: LMModel
    oracle_emb: nn.Embedding  # [text_card + 1, dim], added to the LM input each frame
    mimi: MimiModel
    tokenizer: sentencepiece.SentencePieceProcessor | None
    lm_gen_config: dict = field(default_factory=dict)
    source: str = ""
    stt_config: dict = field(default_factory=dict)  # Kyutai STT checkpoints: audio prefix and delay
    quantize: str | None = None  # "int8": the LM's linear layers hold int8 weights (bitsandbytes)

    @property
    def device(self) -> torch.device:
        return self.lm.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm.dtype


@dataclass(frozen=True)
class _HubOptions:
    cache_dir: Path | None
    offline: bool
    endpoint: str | None


@dataclass(frozen=True)
class _Layout:
    """The files of a front-end directory, resolved to local paths."""

    lm_config: dict
    moshi_weights: Path
    mimi_weights: Path
    mimi_config: dict | None
    tokenizer: Path
    lm_gen_config: dict
    stt_config: dict


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise FrontendLoadError("device 'cuda' was requested but no CUDA GPU is available; use --device cpu")
    return resolved


def load_frontend(
    source: str = DEFAULT_SOURCE,
    device: str | torch.device = "auto",
    dtype: torch.dtype | None = None,
    *,
    hf_cache_dir: Path | None = None,
    local_files_only: bool | None = None,
    hf_endpoint: str | None = None,
    quantize: str | None = None,
) -> Frontend:
    """Load the front-end named by `source`: a preset, a local directory, or a hub repo id.

    `local_files_only` (default: the HF_HUB_OFFLINE env var) reads the hub cache only;
    `hf_cache_dir` and `hf_endpoint` override huggingface_hub's cache folder and hub URL.
    `quantize="int8"` (CUDA only) turns the LM's linear layers into bitsandbytes int8 ones, one
    layer at a time on the GPU, so that the bf16 weights never all sit there at once.
    """
    dev = resolve_device(device)
    dtype = dtype or default_dtype(dev)
    check_quantize(quantize, dev)
    if source in RANDOM_PRESETS:
        frontend = _load_random(RANDOM_PRESETS[source], dev, dtype)  # random weights: made on the device
    else:
        if source in DIRECTORY_PRESETS:
            layout = _read_layout_dir(DIRECTORY_PRESETS[source])
        elif Path(source).expanduser().is_dir():
            layout = _read_layout_dir(Path(source).expanduser())
        elif _looks_like_repo_id(source):
            offline = local_files_only if local_files_only is not None else _hub_offline_env()
            if not offline and not _hub_reachable(hf_endpoint):
                logger.warning("the Hugging Face hub is unreachable: looking in the local cache only")
                offline = True
            layout = _read_layout_hub(source, _HubOptions(hf_cache_dir, offline, hf_endpoint))
        else:
            raise FrontendLoadError(
                f"front-end source {source!r} is neither a preset ({', '.join(PRESET_NAMES)}), "
                "an existing directory, nor a Hugging Face repo id like 'SakanaAI/kame'"
            )
        # to be quantized, the weights are read into CPU memory first, then go to the GPU layer by layer
        frontend = _load_layout(layout, torch.device("cpu") if quantize else dev, dtype)
    if quantize:
        _quantize_int8(frontend, dev)
    frontend.source = source
    logger.info("front-end %s ready on %s (%s%s)", source, dev, str(dtype).removeprefix("torch."),
                ", int8 linear layers" if quantize else "")
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
    frontend.oracle_emb.to(device)
    frontend.mimi.to(device)
    frontend.quantize = "int8"


def _looks_like_repo_id(source: str) -> bool:
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not source.startswith((".", "/", "~"))


def _hub_reachable(endpoint: str | None, timeout_s: float = 3.0) -> bool:
    """A quick TCP check, so that an offline machine falls back to the cache at once instead of
    after huggingface_hub's ~25 s of retries. Behind a proxy, assume the hub is reachable."""
    if any(os.environ.get(var) for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    from huggingface_hub import constants

    url = urlsplit(endpoint or constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _hub_offline_env() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


# ---------------------------------------------------------------- layouts


def _parse_config(raw: dict, where: str) -> tuple[dict, dict]:
    """Split a repo config.json into (LM kwargs, file names and generation defaults)."""
    if not isinstance(raw, dict):
        raise FrontendLoadError(f"{where}: expected a JSON object")
    lm_config = dict(raw)
    names = {
        "moshi_name": lm_config.pop("moshi_name", loaders.MOSHI_NAME),
        "mimi_name": lm_config.pop("mimi_name", loaders.MIMI_NAME),
        "mimi_config_name": lm_config.pop("mimi_config_name", None),
        "tokenizer_name": lm_config.pop("tokenizer_name", loaders.TEXT_TOKENIZER_NAME),
        "lm_gen_config": lm_config.pop("lm_gen_config", {}),
        "stt_config": lm_config.pop("stt_config", {}),
    }
    for key in ("model_type", "model_id", "tts_config", "lora_name"):
        lm_config.pop(key, None)
    return lm_config, names


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FrontendLoadError(f"missing {path}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FrontendLoadError(f"{path} is not valid JSON: {exc}") from exc


def _read_layout_dir(root: Path) -> _Layout:
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FrontendLoadError(
            f"{root} has no config.json: a front-end directory needs one with the LM kwargs and "
            "moshi_name, mimi_name, tokenizer_name (the layout of a Moshi/KAME hub repo)"
        )
    lm_config, names = _parse_config(_read_json(config_path), str(config_path))

    def existing(key: str) -> Path:
        path = root / names[key]
        if not path.is_file():
            raise FrontendLoadError(
                f"missing {path} (named by {key!r} in {config_path}); put the file there or fix the name"
            )
        return path

    mimi_config = _read_json(existing("mimi_config_name")) if names["mimi_config_name"] else None
    return _Layout(
        lm_config, existing("moshi_name"), existing("mimi_name"), mimi_config,
        existing("tokenizer_name"), names["lm_gen_config"], names["stt_config"],
    )


def _hub_get(repo: str, filename: str, hub: _HubOptions) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        return Path(hf_hub_download(repo, filename, cache_dir=hub.cache_dir, local_files_only=hub.offline,
                                    endpoint=hub.endpoint))
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise FrontendLoadError(
            f"Hugging Face repo {repo!r} was not found or needs access (log in with `hf auth login`). "
            f"{OFFLINE_HINT}"
        ) from exc
    except LocalEntryNotFoundError as exc:  # a subclass of EntryNotFoundError: catch it first
        raise FrontendLoadError(
            f"cannot fetch {filename!r} of {repo!r}: the hub is unreachable or offline mode is on, "
            f"and the file is not in the local cache. {OFFLINE_HINT}"
        ) from exc
    except EntryNotFoundError:
        raise
    except OSError as exc:  # requests' connection errors derive from OSError
        raise FrontendLoadError(f"cannot fetch {filename!r} of {repo!r}: {exc}. {OFFLINE_HINT}") from exc


def _read_layout_hub(repo: str, hub: _HubOptions) -> _Layout:
    from huggingface_hub.errors import EntryNotFoundError

    logger.info("fetching front-end %s from the Hugging Face hub%s", repo, " (cache only)" if hub.offline else "")
    try:
        raw = _read_json(_hub_get(repo, "config.json", hub))
    except EntryNotFoundError:
        logger.info("%s has no config.json: assuming the Moshi 7B layout", repo)
        raw = {}
    lm_config, names = _parse_config(raw, f"{repo}/config.json")

    def get(key: str) -> Path:
        try:
            return _hub_get(repo, names[key], hub)
        except EntryNotFoundError as exc:
            raise FrontendLoadError(f"{repo} has no file {names[key]!r} (named by {key!r})") from exc

    mimi_config = _read_json(get("mimi_config_name")) if names["mimi_config_name"] else None
    return _Layout(
        lm_config or dict(loaders._lm_kwargs), get("moshi_name"), get("mimi_name"), mimi_config,
        get("tokenizer_name"), names["lm_gen_config"], names["stt_config"],
    )


# ---------------------------------------------------------------- models


def _num_codebooks(lm_config: dict) -> int:
    return max(lm_config["dep_q"], lm_config["n_q"] - lm_config["dep_q"])


def _build_mimi(weights: Path | None, config: dict | None, lm_config: dict, device: torch.device) -> MimiModel:
    where = str(weights) if weights else "the tiny Mimi config"
    try:
        return loaders.get_mimi(weights, config, device=device, num_codebooks=_num_codebooks(lm_config))
    except (RuntimeError, KeyError, SafetensorError) as exc:
        raise FrontendLoadError(
            f"cannot load the Mimi codec from {where}: {exc}. Check mimi_config_name matches the weights"
        ) from exc


def _new_lm(lm_config: dict, device: torch.device | str, dtype: torch.dtype, where: str) -> LMModel:
    try:
        return loaders.get_moshi_lm(None, lm_kwargs=lm_config, device=device, dtype=dtype)
    except (TypeError, AssertionError, KeyError, ValueError) as exc:
        raise FrontendLoadError(f"{where}: the LM config is not valid for moshi's LMModel: {exc}") from exc


def _check_state(model: nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    expected = model.state_dict()
    unknown = sorted(set(state) - set(expected))
    missing = sorted(set(expected) - set(state))
    if unknown:
        raise FrontendLoadError(
            f"{path} has keys the LM does not know: {', '.join(unknown[:5])}"
            f"{' ...' if len(unknown) > 5 else ''}; is config.json the one made for these weights?"
        )
    if missing:
        raise FrontendLoadError(
            f"{path} lacks {len(missing)} LM weights, e.g. {', '.join(missing[:5])}; the file is "
            "incomplete or config.json describes another model"
        )
    for key, value in state.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise FrontendLoadError(
                f"{path}: {key} has shape {tuple(value.shape)}, the config expects "
                f"{tuple(expected[key].shape)}; config.json does not match these weights"
            )


def _load_lm(layout: _Layout, device: torch.device, dtype: torch.dtype) -> tuple[LMModel, nn.Embedding]:
    """The LM and its oracle embedding with their weights on `device`."""
    path = layout.moshi_weights
    lm = _new_lm(layout.lm_config, "meta", dtype, str(path))
    try:
        state = load_file(path, device=str(device))
    except (SafetensorError, OSError) as exc:
        raise FrontendLoadError(f"cannot read {path} as safetensors: {exc}") from exc
    oracle = state.pop(ORACLE_KEY, None)
    _check_state(lm, state, path)
    for key, value in state.items():
        if value.dtype.is_floating_point:
            keep_fp32 = key.startswith(("condition_provider.", "fuser."))
            state[key] = value.float() if keep_fp32 else value.to(dtype)
    lm.load_state_dict(state, assign=True)
    lm.eval()
    return lm, _oracle_embedding(lm, oracle, path, device, dtype)


def _oracle_embedding(
    lm: LMModel, weight: torch.Tensor | None, path: Path | str, device: torch.device, dtype: torch.dtype
) -> nn.Embedding:
    rows, dim = lm.text_card + 1, lm.dim
    if weight is None:
        logger.info("%s has no %s%s: oracle embedding initialised from text_emb", path, ORACLE_KEY,
                    "" if str(path).startswith("preset") else " (a plain Moshi checkpoint)")
        weight = lm.text_emb.weight.detach().clone()
    elif tuple(weight.shape) != (rows, dim):
        raise FrontendLoadError(
            f"{path}: {ORACLE_KEY} has shape {tuple(weight.shape)}, expected ({rows}, {dim}) "
            "(text_card + 1 rows, like text_emb)"
        )
    emb = nn.Embedding(rows, dim, device=device, dtype=dtype)
    with torch.no_grad():
        emb.weight.copy_(weight.to(device=device, dtype=dtype))
    return emb.eval().requires_grad_(False)


def _load_tokenizer(path: Path | None) -> sentencepiece.SentencePieceProcessor | None:
    if path is None:
        return None
    try:
        return sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as exc:
        raise FrontendLoadError(f"cannot load the SentencePiece tokenizer {path}: {exc}") from exc


def _load_layout(layout: _Layout, device: torch.device, dtype: torch.dtype) -> Frontend:
    lm, oracle_emb = _load_lm(layout, device, dtype)
    mimi = _build_mimi(layout.mimi_weights, layout.mimi_config, layout.lm_config, device)
    tokenizer = _load_tokenizer(layout.tokenizer)
    _check_tokenizer(tokenizer, lm, layout.tokenizer)
    return Frontend(lm, oracle_emb, mimi, tokenizer, dict(layout.lm_gen_config), stt_config=layout.stt_config)


def _check_tokenizer(tokenizer: sentencepiece.SentencePieceProcessor | None, lm: LMModel, path: Path | None) -> None:
    if tokenizer is not None and tokenizer.vocab_size() > lm.text_card:
        raise FrontendLoadError(
            f"{path} has {tokenizer.vocab_size()} pieces but the LM's text_card is {lm.text_card}"
        )


def _load_random(preset: RandomPreset, device: torch.device, dtype: torch.dtype) -> Frontend:
    logger.info("front-end preset %s: %s", preset.name, preset.description)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(preset.seed)
        lm = _new_lm(preset.lm_kwargs(), device, dtype, f"preset {preset.name}")
        mimi = _build_mimi(None, preset.mimi_config, preset.lm_config, device)
    oracle_emb = _oracle_embedding(lm, None, f"preset {preset.name}", device, dtype)
    tokenizer = _load_tokenizer(preset.tokenizer)
    _check_tokenizer(tokenizer, lm, preset.tokenizer)
    return Frontend(lm, oracle_emb, mimi, tokenizer, dict(preset.lm_gen_config), stt_config=dict(preset.stt_config))
