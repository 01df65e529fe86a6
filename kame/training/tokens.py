"""Stage 3, tokens: each dialogue as the streams a front-end trains on, `RUN/tokens/NAME.safetensors`:
Mimi codes of both channels, the assistant's text stream, and the oracle events as token ids."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from kame.audio import FRAME_SIZE, SAMPLE_RATE
from kame.files import sha256_of
from kame.frontend.loader import Frontend, load_frontend
from kame.frontend.oracle import TextTokenizer, tokenize_words
from kame.training.dataset import lm_config
from kame.training.dialogues import read_channels
from kame.training.runfiles import DataError, digest, frame_of, prepared_files, read_json, write_json

logger = logging.getLogger(__name__)

BATCH_SECONDS = 240.0  # audio (both channels together) per Mimi encode call


@dataclass(frozen=True)
class _Dialogue:
    name: str
    prepared: dict
    oracles: dict
    inputs: str  # hash of what its token file is made from
    out: Path


def place_tokens(words: list[tuple[int, list[int]]], frames: int, padding_id: int) -> tuple[list[int], list[int]]:
    """The text stream of `(start frame, tokens)` words, in start order: each word's tokens one per
    frame from its start frame on (or right after the previous word's tokens, if those still run),
    padding elsewhere. Also the indices of the words whose tail ran past the last frame (cut)."""
    stream, cursor, cut = [padding_id] * frames, 0, []
    for index, (start, tokens) in sorted(enumerate(words), key=lambda item: item[1][0]):
        position = max(start, cursor)
        for token in tokens:
            if position < frames:
                stream[position] = token
            position += 1
        if position > frames:
            cut.append(index)
        cursor = position
    return stream, cut


def text_stream(words: list[dict], frames: int, tokenizer: TextTokenizer, padding_id: int) -> list[int]:
    """The assistant's words as one token per frame (`place_tokens`), each from int(start * 12.5)."""
    said = [word for word in words if word["speaker"] == "assistant"]
    stream, cut = place_tokens([(frame_of(w["start"]), tokenize_words(tokenizer, w["word"])) for w in said],
                               frames, padding_id)
    for index in cut:
        logger.warning("the text of %r runs past the end of the audio: its tail is cut", said[index]["word"])
    return stream


def write_token_file(path: Path, tensors: dict[str, torch.Tensor], meta: dict, inputs: str | None = None) -> None:
    """One dialogue's token file, through a temporary file: its tensors, `meta` as the `kame`
    metadata, and (for the token stage's reruns) the hash of its inputs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"kame": json.dumps(meta)} | ({"inputs_sha256": inputs} if inputs is not None else {})
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.replace(path)


def write_manifest(run_dir: Path, frontend: str, config: dict, names: list[str]) -> None:
    write_json(Path(run_dir) / "tokens" / "manifest.json",
               {"frontend": frontend, "frontend_config": config, "dialogues": names})


def oracle_events(events: list[dict], tokenizer: TextTokenizer) -> list[list]:
    """`[[frame, [token ids], last_of_turn], ...]`: each event's text, word by word (no start token)."""
    return [[int(e["frame"]), tokenize_words(tokenizer, e["text"]), bool(e["last_of_turn"])] for e in events]


def stored_inputs(path: Path) -> str | None:
    try:
        with safe_open(str(path), "pt") as handle:
            return (handle.metadata() or {}).get("inputs_sha256")
    except Exception:  # missing, truncated or not a safetensors file: made again
        return None


def _dialogues(run_dir: Path, frontend: str) -> list[_Dialogue]:
    items = []
    for path in prepared_files(run_dir):
        oracle_path = run_dir / "oracles" / path.name
        if not oracle_path.is_file():
            raise DataError(f"{oracle_path} is missing: run `kame data oracles` first")
        prepared, oracles = read_json(path), read_json(oracle_path)
        if not isinstance(oracles, dict) or "events" not in oracles:
            raise DataError(f"{oracle_path}: not an oracle file (run `kame data oracles` again)")
        inputs = digest(path.read_text(), oracle_path.read_text(), frontend)
        items.append(_Dialogue(path.stem, prepared, oracles, inputs, run_dir / "tokens" / f"{path.stem}.safetensors"))
    return items


def _audio(dialogue: _Dialogue) -> np.ndarray:
    source = Path(dialogue.prepared["source"])
    if not source.is_file() or sha256_of(source) != dialogue.prepared["sha256"]:
        raise DataError(f"{source} is missing or changed since it was prepared: run `kame data prepare` again")
    channels, _ = read_channels(source, SAMPLE_RATE)
    return channels


@torch.no_grad()
def encode(frontend: Frontend, pcms: list[np.ndarray]) -> list[torch.Tensor]:
    """Mimi codes [K, T] of each [2, samples] dialogue (both channels), in one padded batch: Mimi's
    encoder is causal, so the padding at the end leaves earlier frames unchanged."""
    frames = [math.ceil(p.shape[1] / FRAME_SIZE) for p in pcms]
    batch = torch.zeros(2 * len(pcms), 1, max(frames) * FRAME_SIZE)
    for index, pcm in enumerate(pcms):
        batch[2 * index: 2 * index + 2, 0, : pcm.shape[1]] = torch.from_numpy(pcm)
    mimi = frontend.mimi
    codes = mimi.encode(batch.to(device=frontend.device, dtype=next(mimi.parameters()).dtype)).cpu()
    return [codes[2 * i: 2 * i + 2, :, :count] for i, count in enumerate(frames)]  # [2, K, T]


def token_file(frontend: Frontend, dialogue: _Dialogue, codes: torch.Tensor) -> None:
    """Write one dialogue's token file from its Mimi codes [2 channels, K, T]."""
    lm, tokenizer = frontend.lm, frontend.tokenizer
    frames = codes.shape[-1]
    config = lm_config(lm)
    text = text_stream(dialogue.prepared["words"], frames, tokenizer, lm.text_padding_token_id)
    meta = {"name": dialogue.name, "frames": frames,
            "oracle_events": oracle_events(dialogue.oracles["events"], tokenizer), "frontend": config}
    tensors = {
        "user_codes": codes[0, : lm.n_q - lm.dep_q].to(torch.int16).contiguous(),
        "assistant_codes": codes[1, : lm.dep_q].to(torch.int16).contiguous(),
        "text": torch.tensor(text, dtype=torch.int32),
    }
    write_token_file(dialogue.out, tensors, meta, dialogue.inputs)


def tokenize(run_dir: Path, *, frontend: str, device: str = "auto", quantize: str | None = None) -> list[Path]:
    """Stage 3: every prepared dialogue with its oracles into `RUN/tokens/NAME.safetensors`, and the
    manifest; token files made from the same inputs are kept (the front-end is then not even loaded)."""
    run_dir = Path(run_dir)
    dialogues = _dialogues(run_dir, frontend)
    todo = [d for d in dialogues if stored_inputs(d.out) != d.inputs]
    manifest_path = run_dir / "tokens" / "manifest.json"
    manifest = read_json(manifest_path) if manifest_path.is_file() else {}
    names = [d.name for d in dialogues]
    up_to_date = isinstance(manifest, dict) and (manifest.get("frontend"), manifest.get("dialogues")) == (
        frontend, names)
    if not todo and up_to_date:
        return [d.out for d in dialogues]
    loaded = load_frontend(frontend, device, quantize=quantize)
    if loaded.tokenizer is None:
        raise DataError(f"front-end {frontend!r} has no text tokenizer: the text stream cannot be made")
    config = lm_config(loaded.lm)
    if loaded.mimi.num_codebooks < max(config["dep_q"], config["n_q"] - config["dep_q"]):
        raise DataError(f"front-end {frontend!r}: its Mimi gives {loaded.mimi.num_codebooks} codebooks, the LM needs "
                        f"{config['dep_q']} per channel")
    with tqdm(total=len(dialogues), initial=len(dialogues) - len(todo), desc="tokens", unit="dialogue") as bar:
        for batch in _batches(todo):
            for dialogue, codes in zip(batch, encode(loaded, [_audio(d) for d in batch]), strict=True):
                token_file(loaded, dialogue, codes)
                bar.update()
    write_manifest(run_dir, frontend, config, names)
    return [d.out for d in dialogues]


def _batches(dialogues: list[_Dialogue]) -> list[list[_Dialogue]]:
    """Dialogues of similar length together, each batch under BATCH_SECONDS of padded audio."""
    ordered = sorted(dialogues, key=lambda d: d.prepared["duration_s"])
    batches: list[list[_Dialogue]] = []
    for dialogue in ordered:
        if batches and 2 * dialogue.prepared["duration_s"] * (len(batches[-1]) + 1) <= BATCH_SECONDS:
            batches[-1].append(dialogue)
        else:
            batches.append([dialogue])
    return batches
