"""PersonaPlex's voices, by name: the `.pt` files of its `voices.tgz` (NATF0.pt ... VARM4.pt).

A `.pt` voice holds no Mimi codes but what the reference saved while stepping through a voice's codes: each
step's summed input embedding (`embeddings`, [steps, 1, 1, dim]; the first frame takes no step of its own) and
the generator's token cache at the end (`cache`, [1, streams, positions], the reference's ring of max_delay + 3
positions). KAME replays it as the reference does (kame/frontend/persona.py: a frame per embedding, the LM
stepped on it as it is; the cache's tokens put back at the voice's last frame).

Voices are looked up by name only, never by path: in the configured folder (`voices_dir`), else the checkpoint's
own `voices/` folder, else its `voices.tgz` (unpacked once into a cache folder of ours).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kame.errors import SessionError

logger = logging.getLogger(__name__)

VOICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
VOICE_SUFFIXES = (".pt",)


@dataclass(frozen=True, eq=False)
class VoiceEmbeddings:
    """A voice as the reference saves it: a summed input embedding per step ([steps, dim]) and the token cache
    after its last frame ([streams, positions])."""

    name: str
    embeddings: torch.Tensor
    cache: torch.Tensor

    @property
    def frames(self) -> int:
        """The voice's frames (one more than its steps: the first is the start of the sequence)."""
        return len(self.embeddings) + 1


def read_voice(path: Path, dim: int, streams: int) -> VoiceEmbeddings:
    """A `.pt` voice, checked against the model it is for (SessionError naming what does not fit)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # the reference saves its cache on its GPU
    except Exception as exc:  # a truncated, unreadable or foreign file: torch and the OS raise many kinds
        raise SessionError(f"voice {path.name}: not a PersonaPlex voice file ({type(exc).__name__})") from exc
    if not isinstance(state, dict) or not {"embeddings", "cache"} <= state.keys() or not all(
            isinstance(state[key], torch.Tensor) for key in ("embeddings", "cache")):
        raise SessionError(f"voice {path.name}: not a PersonaPlex voice file (no 'embeddings' and 'cache' tensors)")
    embeddings, cache = state["embeddings"], state["cache"]
    if embeddings.dim() != 4 or embeddings.shape[1:3] != (1, 1) or embeddings.shape[3] != dim or not len(embeddings):
        raise SessionError(f"voice {path.name}: embeddings of shape {tuple(embeddings.shape)}, not "
                           f"[steps, 1, 1, {dim}]: made for another model")
    if cache.dim() != 3 or cache.shape[0] != 1 or cache.shape[1] != streams:
        raise SessionError(f"voice {path.name}: a token cache of shape {tuple(cache.shape)}, not [1, {streams}, "
                           "positions]: made for another model")
    return VoiceEmbeddings(path.stem, embeddings.reshape(len(embeddings), dim), cache[0].to(torch.long))


class VoiceLibrary:
    """The voices a server offers, by name (`NATF2.pt` or `NATF2`)."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self._cache: dict[str, VoiceEmbeddings] = {}

    def names(self) -> list[str]:
        if self.folder is None or not self.folder.is_dir():
            return []
        return sorted(p.name for p in self.folder.iterdir()
                      if p.suffix in VOICE_SUFFIXES and p.is_file() and VOICE_NAME.fullmatch(p.name))

    def voice(self, name: str, dim: int, streams: int) -> VoiceEmbeddings:
        """The voice named `name`; SessionError for a path, an unknown name, or a front-end without voices."""
        if not VOICE_NAME.fullmatch(name) or ".." in name:
            raise SessionError(f"voice_prompt {ascii(name[:40])}: a voice is named, not a path (such as NATF2.pt)")
        if self.folder is None:
            raise SessionError("this front-end has no voices: voice prompts come with PersonaPlex checkpoints "
                               "(voices.tgz), or set voices_dir")
        file = name if name.endswith(VOICE_SUFFIXES) else name + ".pt"
        path = self.folder / file
        if not path.is_file():
            known = self.names()
            listed = ", ".join(known[:24]) + (" ..." if len(known) > 24 else "")
            raise SessionError(f"voice_prompt {name!r}: no such voice; there are: {listed or 'none'}"
                               + ("" if name.endswith(VOICE_SUFFIXES) or not Path(name).suffix else
                                  " (voices given as audio files are not served yet: only .pt voices)"))
        key = f"{path}:{path.stat().st_mtime_ns}"
        if key not in self._cache:
            self._cache[key] = read_voice(path, dim, streams)
        return self._cache[key]


def locate_voices(configured: Path | None, checkpoint: Path | None,
                  hub_repo: str | None = None) -> tuple[str, Path | str] | None:
    """Where a server's voices are, in the order `kame serve` looks, nothing unpacked or downloaded:
    ("folder", `configured` or the checkpoint's `voices/`), ("archive", its `voices.tgz`), ("hub", `hub_repo`,
    whose `voices.tgz` is fetched); None: no voices."""
    if configured is not None:
        return "folder", Path(configured).expanduser()
    if checkpoint is not None and (checkpoint / "voices").is_dir():
        return "folder", checkpoint / "voices"
    if checkpoint is not None and (checkpoint / "voices.tgz").is_file():
        return "archive", checkpoint / "voices.tgz"
    return ("hub", hub_repo) if hub_repo else None


def hub_repo_of(source: str) -> str | None:
    """`source` where it names a hub repo (owner/name, not a local path); else None."""
    return source if source.count("/") == 1 and not Path(source).expanduser().exists() else None


def voices_folder(configured: Path | None, checkpoint: Path | None) -> Path | None:
    """Where a server's voices are (`locate_voices`, no hub): a `voices.tgz` unpacked into our cache (once per
    archive); None: no voices."""
    return _open(locate_voices(configured, checkpoint))


def frontend_voices(configured: Path | None, frontend) -> Path | None:
    """A server's voices folder (`voices_folder`); for a PersonaPlex-layout front-end from the hub whose
    `voices.tgz` is not in the cache yet, downloaded (huggingface_hub: its cache, HF_TOKEN, HF_HUB_OFFLINE)."""
    lm, source = getattr(frontend, "lm", None), getattr(frontend, "source", "") or ""
    hub = hub_repo_of(source) if getattr(lm, "predicted_q", None) else None
    return _open(locate_voices(configured, getattr(frontend, "folder", None), hub))


def _open(where: tuple[str, Path | str] | None) -> Path | None:
    """The folder `locate_voices` found, its archive unpacked or fetched first; None where that fails (said)."""
    if where is None:
        return None
    kind, place = where
    if kind == "folder":
        return place
    if kind == "archive":
        try:
            return unpack_voices(place)
        except (OSError, tarfile.TarError) as exc:  # a broken archive or a read-only cache: no voices, said
            logger.warning("voices: cannot unpack %s (%s: %s): voice_prompt is refused; set voices_dir", place,
                           type(exc).__name__, exc)
            return None
    try:
        from huggingface_hub import hf_hub_download

        return unpack_voices(Path(hf_hub_download(place, "voices.tgz")))
    except Exception as exc:  # offline, gated, or no voices in that repo: sessions may still use a role text
        logger.info("no voices for %s (%s: %s): voice_prompt is refused; set voices_dir", place,
                    type(exc).__name__, exc)
        return None


def unpack_voices(archive: Path) -> Path:
    """`voices.tgz` unpacked (its `.pt` files only, no links, nothing outside) into ~/.cache/kame/voices/<digest>."""
    digest = hashlib.sha256()
    with open(archive, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    root = Path(os.environ.get("KAME_CACHE", Path.home() / ".cache" / "kame")) / "voices" / digest.hexdigest()[:16]
    done = root / ".unpacked"
    if done.is_file():
        return root
    root.mkdir(parents=True, exist_ok=True)
    count = 0
    with tarfile.open(archive, "r:*") as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            if not member.isfile() or not name.endswith(VOICE_SUFFIXES) or not VOICE_NAME.fullmatch(name):
                continue
            source = tar.extractfile(member)
            if source is None:
                continue
            with tempfile.NamedTemporaryFile(dir=root, prefix=f".{name}.", delete=False) as partial:
                partial.write(source.read())
            os.replace(partial.name, root / name)  # two servers unpacking at once each replace it whole
            count += 1
    done.write_text(str(count))
    logger.info("voices: %d unpacked from %s into %s", count, archive, root)
    return root
