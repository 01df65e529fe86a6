"""Small helpers every data stage shares: atomic JSON files, input hashes, the frame rate."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from kame.errors import KameError

FRAME_RATE = 12.5  # Mimi frames (and oracle tokens) per second
ORACLE_STRATEGIES = ("random", "llm")  # how the oracles stage simulates events (kame.training.oracles)


class DataError(KameError):
    """A dialogue, a stage's input or a run folder cannot be used as training data."""


def frame_of(time_s: float) -> int:
    """The frame a time in seconds falls in (the spec's `int(time * 12.5)`)."""
    return int(time_s * FRAME_RATE)


def digest(*parts: str | bytes) -> str:
    """One sha256 over several pieces (each length-prefixed, so that the split matters)."""
    sha = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        sha.update(len(data).to_bytes(8, "little"))
        sha.update(data)
    return sha.hexdigest()


def write_json(path: Path, value: object) -> None:
    """Write through a temporary file, so that an interrupted run never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=1, ensure_ascii=False))
    tmp.replace(path)


def read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: cannot read it as JSON ({exc})") from exc


def stored_hash(path: Path) -> str | None:
    """The `inputs_sha256` an earlier run stored in a JSON output, None if absent or unreadable."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return value.get("inputs_sha256") if isinstance(value, dict) else None


def prepared_files(run_dir: Path) -> list[Path]:
    files = sorted((run_dir / "prepared").glob("*.json"))
    if not files:
        raise DataError(f"{run_dir / 'prepared'} holds no dialogues: run `kame data prepare` first")
    return files
