"""Read RUN/tokens (the token files of the data stages) into dialogues, split them, cut chunks.

The format is the contract between the data stages and the trainer: per dialogue
`user_codes` [n_q - dep_q, T], `assistant_codes` [dep_q, T] (Mimi codes, not delayed), `text` [T]
(the assistant's text stream) and a `kame` metadata JSON with the oracle events.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kame.errors import KameError
from kame.training.augment import OracleEvent

CONFIG_KEYS = ("text_card", "padding_id", "n_q", "dep_q", "card")
HELD_OUT_FRACTION = 0.1


def lm_config(lm) -> dict:
    """The manifest's `frontend_config` of a moshi LM: the CONFIG_KEYS token files must match."""
    return {"text_card": lm.text_card, "padding_id": lm.text_padding_token_id, "n_q": lm.n_q,
            "dep_q": lm.dep_q, "card": lm.card}


@dataclass(frozen=True)
class Dialogue:
    """One tokenised dialogue."""

    name: str
    text: torch.Tensor  # long [T]
    assistant: torch.Tensor  # long [dep_q, T]
    user: torch.Tensor  # long [n_q - dep_q, T]
    events: list[OracleEvent]

    @property
    def frames(self) -> int:
        return int(self.text.shape[0])

    def codes(self, start: int = 0, length: int | None = None) -> torch.Tensor:
        """LM input codes [1 + n_q, length]: text, then the assistant's, then the user's codebooks."""
        end = self.frames if length is None else start + length
        return torch.cat([self.text[None, start:end], self.assistant[:, start:end], self.user[:, start:end]])


@dataclass(frozen=True)
class TokenSet:
    frontend: str  # the base front-end the tokens were made with
    config: dict  # text_card, padding_id, n_q, dep_q, card
    dialogues: list[Dialogue]


def tokens_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "tokens"


def read_manifest(run_dir: Path) -> dict:
    path = tokens_dir(run_dir) / "manifest.json"
    if not path.is_file():
        raise KameError(f"no token files: {path} is missing; run `kame train --data DIR ...` to make them")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise KameError(f"{path} is not valid JSON: {exc}") from exc
    if not manifest.get("dialogues"):
        raise KameError(f"{path} lists no dialogues: the data stages produced no token files")
    return manifest


def read_dialogue(path: Path, config: dict) -> Dialogue:
    """One token file, checked against the manifest's front-end config."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["kame"])
            tensors = {k: f.get_tensor(k) for k in ("user_codes", "assistant_codes", "text")}
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as exc:
        raise KameError(f"cannot read token file {path}: {exc}") from exc
    if {k: meta["frontend"].get(k) for k in CONFIG_KEYS} != {k: config[k] for k in CONFIG_KEYS}:
        raise KameError(f"{path} was made for another front-end ({meta['frontend']}) than the manifest's ({config})")
    dialogue = Dialogue(
        name=meta["name"], text=tensors["text"].long(), assistant=tensors["assistant_codes"].long(),
        user=tensors["user_codes"].long(),
        events=[OracleEvent(int(frame), tuple(int(t) for t in tokens), bool(last))
                for frame, tokens, last in meta["oracle_events"]],
    )
    _check_shapes(dialogue, config, path)
    return dialogue


def _check_shapes(d: Dialogue, config: dict, path: Path) -> None:
    expected = {"assistant_codes": (config["dep_q"], d.frames),
                "user_codes": (config["n_q"] - config["dep_q"], d.frames)}
    actual = {"assistant_codes": tuple(d.assistant.shape), "user_codes": tuple(d.user.shape)}
    for key, shape in expected.items():
        if actual[key] != shape:
            raise KameError(f"{path}: {key} has shape {actual[key]}, expected {shape}")


def load_tokens(run_dir: Path) -> TokenSet:
    """Every dialogue the manifest lists."""
    manifest = read_manifest(run_dir)
    config = manifest["frontend_config"]
    folder = tokens_dir(run_dir)
    dialogues = []
    for name in manifest["dialogues"]:
        path = folder / f"{name}.safetensors"
        if not path.is_file():
            raise KameError(f"{path} is listed in the manifest but missing; rerun the token stage")
        dialogues.append(read_dialogue(path, config))
    return TokenSet(manifest["frontend"], config, dialogues)


def check_frontend(tokens: TokenSet, mine: dict, frontend: str) -> None:
    """The tokens must have been made for a model of the base's shape (`mine`: its `lm_config`)."""
    theirs = {k: tokens.config[k] for k in CONFIG_KEYS}
    if mine != theirs:
        raise KameError(
            f"the tokens in RUN/tokens were made with front-end {tokens.frontend!r} ({theirs}), which does not "
            f"match {frontend!r} ({mine}); train with --frontend {tokens.frontend} or remake the tokens")


def _name_hash(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def split(dialogues: list[Dialogue]) -> tuple[list[Dialogue], list[Dialogue]]:
    """(train, held out): the ~10 % of dialogues with the smallest name hash are held out, at least one."""
    if len(dialogues) < 2:
        raise KameError(f"need at least 2 dialogues (one is held out for evaluation), found {len(dialogues)}")
    ranked = sorted(dialogues, key=lambda d: _name_hash(d.name))
    held = max(1, round(len(dialogues) * HELD_OUT_FRACTION))
    held_names = {d.name for d in ranked[:held]}
    return [d for d in dialogues if d.name not in held_names], [d for d in dialogues if d.name in held_names]


@dataclass(frozen=True)
class Chunk:
    dialogue: Dialogue
    start: int
    length: int


def sample_chunks(dialogues: list[Dialogue], batch: int, chunk: int, rng: random.Random) -> list[Chunk]:
    """`batch` random windows of one common length: `chunk` frames, or the shortest dialogue drawn."""
    picked = [rng.choice(dialogues) for _ in range(batch)]
    length = min(chunk, *(d.frames for d in picked))
    return [Chunk(d, rng.randrange(0, d.frames - length + 1), length) for d in picked]
