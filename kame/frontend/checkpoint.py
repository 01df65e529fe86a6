"""Where a checkpoint's files are (a local folder, a hub repo or the hub's cache), as moshi's own
`CheckpointInfo`, resolved the way moshi's loaders resolve a repo.

config.json is read as `CheckpointInfo.from_hf_repo` reads it: its file names, model type, LoRA,
generation, TTS and STT settings and model id; every other key is an LMModel kwarg. A file name is
resolved as moshi's `hf_get` resolves it: `hf://owner/repo/path` is a file of another hub repo,
`file:///abs/path` a local file, any other name a file of this repo (or of this folder). A repo or
folder without config.json is a Moshi 7B with moshi's default names, as moshi assumes. On top of
moshi: every failure is one error naming the file and what to do, and the cache can be read offline.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from moshi.models import loaders
from moshi.models.loaders import CheckpointInfo

from kame.errors import FrontendLoadError

logger = logging.getLogger(__name__)

OFFLINE_HINT = (
    "To run without the hub, pass a local directory in the same layout; or the offline defaults: the demo "
    "front-end `--frontend tiny-copy`, the bundled Whisper `--asr whisper`."
)
# config.json keys that moshi's CheckpointInfo takes out (the rest are LMModel kwargs), with their defaults
NAME_KEYS = {"moshi_name": loaders.MOSHI_NAME, "mimi_name": loaders.MIMI_NAME,
             "tokenizer_name": loaders.TEXT_TOKENIZER_NAME, "mimi_config_name": None, "lora_name": None}
TABLE_KEYS = ("lm_gen_config", "tts_config", "stt_config", "model_id")


@dataclass(frozen=True)
class HubOptions:
    cache_dir: Path | None = None  # None: huggingface_hub's (HF_HOME, HF_HUB_CACHE)
    local_files_only: bool | None = None  # None: the HF_HUB_OFFLINE env var
    endpoint: str | None = None  # None: huggingface_hub's (HF_ENDPOINT)

    @functools.cached_property
    def offline(self) -> bool:
        """Read the cache only: when asked, or when the hub does not answer (checked on first use,
        so a folder whose files are all local never waits for the network)."""
        if self.local_files_only is not None:
            return self.local_files_only
        if hub_offline_env():
            return True
        if not hub_reachable(self.endpoint):
            logger.warning("the Hugging Face hub is unreachable: looking in the local cache only")
            return True
        return False


def looks_like_repo_id(source: str) -> bool:
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not source.startswith((".", "/", "~"))


def hub_offline_env() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def hub_reachable(endpoint: str | None, timeout_s: float = 3.0) -> bool:
    """A quick TCP check, so that an offline machine falls back to the cache at once instead of
    after huggingface_hub's ~25 s of retries. Behind a proxy, assume the hub is reachable."""
    if any(os.environ.get(var) for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    from huggingface_hub import constants

    url = urlsplit(endpoint or constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)

    def connect() -> bool:
        try:
            with socket.create_connection((url.hostname or "", port), timeout=timeout_s):
                return True
        except OSError:
            return False

    # the name lookup has no timeout of its own: a broken resolver must not hold the start up either
    pool = ThreadPoolExecutor(1, thread_name_prefix="hub-check")
    try:
        return pool.submit(connect).result(timeout=timeout_s + 0.5)
    except FuturesTimeout:
        return False
    finally:
        pool.shutdown(wait=False)


# ---------------------------------------------------------------- files


def hub_file(repo: str, filename: str, hub: HubOptions) -> Path:
    """One file of a hub repo, downloaded (with huggingface_hub's progress bar) or from the cache."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HFValidationError,
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
    except HFValidationError as exc:
        raise FrontendLoadError(f"{repo!r} is not a valid Hugging Face repo id: {exc}") from exc
    except OSError as exc:  # requests' connection errors derive from OSError
        raise FrontendLoadError(f"cannot fetch {filename!r} of {repo!r}: {exc}. {OFFLINE_HINT}") from exc


class _Names:
    """Resolves config.json's file names as moshi's `hf_get` does, relative to a folder or a repo."""

    def __init__(self, base: Path | str, hub: HubOptions, config_where: str) -> None:
        self.base, self.hub, self.config_where = base, hub, config_where

    def get(self, name: str, key: str) -> Path:
        from huggingface_hub.errors import EntryNotFoundError

        if not isinstance(name, str) or not name:
            raise FrontendLoadError(f"{self.config_where}: {key} must be a file name, not {name!r}")
        if name.startswith("file://"):
            return self._existing(Path(name.removeprefix("file://")), key)
        if name.startswith("hf://"):
            parts = name.removeprefix("hf://").split("/")
            if len(parts) < 3 or not all(parts):
                raise FrontendLoadError(f"{self.config_where}: {key} {name!r} is not hf://owner/repo/path")
            repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
        elif isinstance(self.base, Path):
            return self._existing(self.base / name, key)
        else:
            repo, filename = self.base, name
        try:
            return hub_file(repo, filename, self.hub)
        except EntryNotFoundError as exc:
            raise FrontendLoadError(
                f"{repo} has no file {filename!r} (named by {key!r} in {self.config_where})") from exc

    def _existing(self, path: Path, key: str) -> Path:
        if not path.is_file():
            raise FrontendLoadError(
                f"missing {path} (named by {key!r} in {self.config_where}); put the file there or fix the name")
        return path


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FrontendLoadError(f"missing {path}")
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FrontendLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise FrontendLoadError(f"{path}: expected a JSON object")
    return value


# ---------------------------------------------------------------- resolution


def resolve_folder(root: Path, hub: HubOptions) -> CheckpointInfo:
    """A local folder laid out like a hub repo (a snapshot folder, or a checkpoint of ours)."""
    config_path = root / "config.json"
    if config_path.is_file():
        return _info(_read_json(config_path), _Names(root, hub, str(config_path)))
    logger.warning("%s has no config.json: assuming a Moshi 7B snapshot with moshi's default file names "
                   "(%s, %s, %s)", root, loaders.MOSHI_NAME, loaders.MIMI_NAME, loaders.TEXT_TOKENIZER_NAME)
    return _info(None, _Names(root, hub, f"{root} (no config.json: Moshi 7B defaults)"))


def resolve_repo(repo: str, hub: HubOptions) -> CheckpointInfo:

    logger.info("fetching %s from the Hugging Face hub%s", repo, " (cache only)" if hub.offline else "")
    config = _config_file(repo, hub)
    if config is None:
        logger.warning("%s has no config.json: assuming a Moshi 7B with moshi's default file names", repo)
        return _info(None, _Names(repo, hub, f"{repo} (no config.json: Moshi 7B defaults)"))
    return _info(_read_json(config), _Names(repo, hub, f"{repo}/config.json"))


def _config_file(repo: str, hub: HubOptions) -> Path | None:
    """The repo's config.json, or None where it has none. Offline, a repo has none when an earlier
    download found none (huggingface_hub's `.no_exist` marker), or when its weights are in the cache
    and it is not (a snapshot of a legacy repo, such as kyutai/moshiko-pytorch-bf16)."""
    from huggingface_hub import _CACHED_NO_EXIST, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError

    if hub.offline:
        cached = try_to_load_from_cache(repo, "config.json", cache_dir=hub.cache_dir)
        if cached is _CACHED_NO_EXIST:
            return None
        if cached is None and isinstance(try_to_load_from_cache(repo, loaders.MOSHI_NAME, cache_dir=hub.cache_dir),
                                         str):
            return None
    try:
        return hub_file(repo, "config.json", hub)
    except EntryNotFoundError:
        return None


def _info(raw: dict | None, names: _Names) -> CheckpointInfo:
    """moshi's CheckpointInfo of a config (None: Moshi 7B), its files resolved."""
    lm_config = dict(raw) if raw is not None else {}
    files = {key: lm_config.pop(key, default) for key, default in NAME_KEYS.items()}
    model_type = lm_config.pop("model_type", "moshi")
    tables = {key: lm_config.pop(key, {}) for key in TABLE_KEYS}
    for key, value in [("model_type", model_type), *tables.items()]:
        if not isinstance(value, str if key == "model_type" else dict):
            raise FrontendLoadError(f"{names.config_where}: {key} must be a JSON "
                                    f"{'string' if key == 'model_type' else 'object'}, not {value!r}")
    if bool(lm_config.get("lora", False)) != bool(files["lora_name"]):
        raise FrontendLoadError(f"{names.config_where}: `lora` and `lora_name` go together (moshi builds the LoRA "
                                "layers from the first and loads their weights from the second)")
    mimi_config = _read_json(names.get(files["mimi_config_name"], "mimi_config_name")) \
        if files["mimi_config_name"] else None
    return CheckpointInfo(
        moshi_weights=names.get(files["moshi_name"], "moshi_name"),
        mimi_weights=names.get(files["mimi_name"], "mimi_name"),
        tokenizer=names.get(files["tokenizer_name"], "tokenizer_name"),
        lm_config=lm_config if raw is not None else None, raw_config=raw, mimi_config=mimi_config,
        model_type=model_type,
        lora_weights=names.get(files["lora_name"], "lora_name") if files["lora_name"] else None,
        **tables,
    )


def lm_kwargs(info: CheckpointInfo) -> dict:
    """The LMModel kwargs of a checkpoint: its config's, or Moshi 7B's when it has none."""
    return dict(info.lm_config if info.lm_config is not None else loaders._lm_kwargs)


def config_notes(info: CheckpointInfo, uses: set[str]) -> list[str]:
    """One line for each config.json setting this use of the checkpoint leaves aside."""
    reasons = {
        "lm_gen_config": "the generation settings of a model that decodes greedily here",
        "stt_config": "speech-to-text settings, for an ASR",
        "tts_config": "text-to-speech settings (this server runs no TTS; moshi's Mimi still reads 'multistream')",
    }
    notes = [f"config.json: {key} ignored ({reasons[key]})" for key in reasons
             if key not in uses and getattr(info, key)]
    if info.model_id:
        notes.append(f"config.json: model_id {json.dumps(info.model_id)} (for the record)")
    return notes
