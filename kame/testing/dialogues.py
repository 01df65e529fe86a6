"""Synthetic two-channel dialogues for training tests: piper speaks a user question on the left
channel, then the assistant's answer on the right. Each answer holds a word drawn at random that
the question does not give away, so a front-end can only say it if its oracle told it."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile

from kame.testing.speech import speech

RATE = 22050  # piper's rate for this voice: the files are written at it, as a recording might be

OBJECTS = ("box", "car", "door", "cup", "kite", "ball", "hat", "bag", "bike", "lamp")
COLORS = ("red", "green", "blue", "yellow", "purple", "orange", "black", "white", "pink", "brown")
PETS = ("cat", "dog", "rabbit", "parrot")
PLACES = ("kitchen", "garden", "garage", "bedroom", "hallway", "attic", "basement", "office")
FRIENDS = ("Oliver", "Sophie", "Martin", "Laura", "Peter", "Emma", "Daniel", "Nora")


@dataclass(frozen=True)
class Exchange:
    question: str
    answer: str
    key: str  # the word of the answer only the oracle knows


def exchange(rng: random.Random) -> Exchange:
    kind = rng.randrange(3)
    if kind == 0:
        thing, color = rng.choice(OBJECTS), rng.choice(COLORS)
        return Exchange(f"What color is the {thing}?", f"The {thing} is {color}.", color)
    if kind == 1:
        pet, place = rng.choice(PETS), rng.choice(PLACES)
        return Exchange(f"Where is the {pet} sleeping?", f"The {pet} is in the {place}.", place)
    name = rng.choice(FRIENDS)
    return Exchange("What is the name of my friend?", f"Your friend is called {name}.", name)


def tts_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kame" / "tts"


def make_dialogues(out_dir: Path, n: int, seed: int = 0, cache_dir: Path | None = None) -> list[Path]:
    """Write `n` dialogues `out_dir/dialogue-NNN.wav` (left user, right assistant, 22.05 kHz) of one
    or two exchanges each; speech is cached by text in `cache_dir` so reruns are fast."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = Path(cache_dir) if cache_dir else tts_cache()
    paths = []
    for index in range(n):
        rng = random.Random(f"{seed}:{index}")
        exchanges = _draw(rng)
        path = out_dir / f"dialogue-{index:03d}.wav"
        soundfile.write(str(path), _dialogue_audio(exchanges, rng, cache).T, RATE, subtype="PCM_16")
        paths.append(path)
    return paths


def dialogue_exchanges(seed: int, index: int) -> list[Exchange]:
    """The exchanges of dialogue `index` of `make_dialogues(..., seed)` (to check what was said)."""
    return _draw(random.Random(f"{seed}:{index}"))


def _draw(rng: random.Random) -> list[Exchange]:
    return [exchange(rng) for _ in range(rng.choice((1, 2)))]


def _dialogue_audio(exchanges: list[Exchange], rng: random.Random, cache: Path) -> np.ndarray:
    """[2, T] float32: a short lead-in, then question, pause, answer, pause for each exchange."""
    pieces: list[tuple[int, np.ndarray]] = []
    cursor = int(rng.uniform(0.2, 0.5) * RATE)
    for item in exchanges:
        for channel, text in ((0, item.question), (1, item.answer)):
            pcm = speech(text, cache, RATE)
            pieces.append((channel, np.pad(pcm, (cursor, 0))))
            cursor += len(pcm) + int(rng.uniform(0.4, 0.8) * RATE)
    audio = np.zeros((2, cursor), dtype=np.float32)
    for channel, pcm in pieces:
        audio[channel, : len(pcm)] += pcm
    return audio
