"""Audio files in and out: any readable file becomes mono float32 PCM at 24 kHz, split in frames."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import sphn

from kame.errors import AudioFileError

SAMPLE_RATE = 24000  # Mimi's rate: every audio stream of the project
FRAME_SIZE = 1920  # samples per 80 ms frame
FRAME_S = FRAME_SIZE / SAMPLE_RATE  # 0.08 s: one frame, one engine step, one oracle token


def read_audio(path: str | Path, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Read any audio file sphn can decode, down-mixed to mono and resampled to `sample_rate`."""
    path = Path(path)
    if not path.is_file():
        raise AudioFileError(f"{path}: no such file")
    try:
        data, _ = sphn.read(str(path), sample_rate=sample_rate)
    except ValueError as exc:
        raise AudioFileError(f"{path}: cannot decode as audio ({exc})") from exc
    if data.size == 0:
        raise AudioFileError(f"{path}: the file holds no audio samples")
    duration = sphn.durations([str(path)])[0]
    length = round(duration * sample_rate) if duration else data.shape[1]  # the resampler pads its tail
    return np.ascontiguousarray(data[:, :length].mean(axis=0), dtype=np.float32)


def write_wav(path: str | Path, pcm: np.ndarray, sample_rate: int = SAMPLE_RATE) -> None:
    path = Path(path)
    if path.parent and not path.parent.exists():
        raise AudioFileError(f"{path}: folder {path.parent} does not exist")
    sphn.write_wav(str(path), np.asarray(pcm, dtype=np.float32), sample_rate)


def frames_of(pcm: np.ndarray, frame_size: int = FRAME_SIZE) -> list[np.ndarray]:
    """Split PCM in whole frames, zero-padding the last one."""
    count = -(-len(pcm) // frame_size)
    padded = np.zeros(count * frame_size, dtype=np.float32)
    padded[: len(pcm)] = pcm
    return list(padded.reshape(count, frame_size))
