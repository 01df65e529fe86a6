"""Telephone audio: G.711 mu-law and A-law at 8 kHz, and streaming 8 kHz <-> 24 kHz resampling.

The OpenAI Realtime API's `audio/pcmu` and `audio/pcma` formats are G.711 at 8 kHz (Twilio's
media streams send mu-law). The codecs follow ITU-T G.711's segment tables, vectorised; the
resamplers are a windowed-sinc low-pass at 3.6 kHz (below 8 kHz's Nyquist) around zero-stuffing
or decimation by 3, carrying their state so chunk boundaries leave no trace.
"""

from __future__ import annotations

import numpy as np

from kame.audio import SAMPLE_RATE

TELEPHONE_RATE = 8000
FACTOR = SAMPLE_RATE // TELEPHONE_RATE  # 3
_TAPS = 63
_MU_BIAS = 0x84


def _lowpass(cutoff_hz: float, rate: int, taps: int = _TAPS) -> np.ndarray:
    n = np.arange(taps) - (taps - 1) / 2
    h = np.sinc(2 * cutoff_hz / rate * n) * np.hamming(taps)
    return (h / h.sum()).astype(np.float32)


_KERNEL = _lowpass(3600, SAMPLE_RATE)


def _to_int16(pcm: np.ndarray) -> np.ndarray:
    return (np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0) * 32767.0).astype(np.int32)


def _segment(magnitude: np.ndarray, floor_bits: int) -> np.ndarray:
    """G.711's exponent: the position of the top bit above `floor_bits`, 0-7."""
    with np.errstate(divide="ignore"):
        top = np.floor(np.log2(np.maximum(magnitude, 1))).astype(np.int32)
    return np.clip(top - floor_bits, 0, 7)


def ulaw_encode(pcm: np.ndarray) -> bytes:
    """Float samples in [-1, 1] -> mu-law bytes (G.711 on the 14-bit sample, as the reference coder)."""
    x = _to_int16(pcm) >> 2
    mask = np.where(x < 0, 0x7F, 0xFF)
    magnitude = np.minimum(np.minimum(np.abs(x), 8159) + (_MU_BIAS >> 2), 0x1FFF)  # 0x1FFF: the top code
    exponent = _segment(magnitude, 5)
    mantissa = (magnitude >> (exponent + 1)) & 0x0F
    return (((exponent << 4) | mantissa) ^ mask).astype(np.uint8).tobytes()


def ulaw_decode(data: bytes) -> np.ndarray:
    """mu-law bytes -> float32 samples in [-1, 1]."""
    b = ~np.frombuffer(data, dtype=np.uint8).astype(np.int32) & 0xFF
    exponent, mantissa = (b >> 4) & 0x07, b & 0x0F
    magnitude = (((mantissa << 3) + _MU_BIAS) << exponent) - _MU_BIAS
    return (np.where(b & 0x80, -magnitude, magnitude) / 32768.0).astype(np.float32)


def alaw_encode(pcm: np.ndarray) -> bytes:
    """Float samples in [-1, 1] -> A-law bytes."""
    x = _to_int16(pcm)
    sign = np.where(x >= 0, 0x80, 0x00)
    magnitude = np.minimum(np.where(x >= 0, x, -x - 1), 32767)
    exponent = np.where(magnitude < 256, 0, _segment(magnitude, 7))
    mantissa = np.where(exponent == 0, magnitude >> 4, magnitude >> (exponent + 3)) & 0x0F
    return ((sign | (exponent << 4) | mantissa) ^ 0x55).astype(np.uint8).tobytes()


def alaw_decode(data: bytes) -> np.ndarray:
    """A-law bytes -> float32 samples in [-1, 1]."""
    b = np.frombuffer(data, dtype=np.uint8).astype(np.int32) ^ 0x55
    exponent, mantissa = (b >> 4) & 0x07, b & 0x0F
    magnitude = np.where(exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0))
    return (np.where(b & 0x80, magnitude, -magnitude) / 32768.0).astype(np.float32)


class Upsampler:
    """8 kHz -> 24 kHz, streaming: every input sample gives exactly 3 output samples."""

    def __init__(self) -> None:
        self._history = np.zeros(_TAPS - 1, dtype=np.float32)

    def __call__(self, pcm: np.ndarray) -> np.ndarray:
        stuffed = np.zeros(len(pcm) * FACTOR, dtype=np.float32)
        stuffed[::FACTOR] = np.asarray(pcm, dtype=np.float32) * FACTOR
        x = np.concatenate([self._history, stuffed])
        self._history = x[-(_TAPS - 1):]
        return np.convolve(x, _KERNEL, mode="valid").astype(np.float32)


class Downsampler:
    """24 kHz -> 8 kHz, streaming: one output sample per 3 inputs, whatever the chunk sizes."""

    def __init__(self) -> None:
        self._history = np.zeros(_TAPS - 1, dtype=np.float32)
        self._phase = 0  # index, in the next filtered chunk, of the next sample to keep

    def __call__(self, pcm: np.ndarray) -> np.ndarray:
        x = np.concatenate([self._history, np.asarray(pcm, dtype=np.float32)])
        self._history = x[-(_TAPS - 1):]
        filtered = np.convolve(x, _KERNEL, mode="valid")
        kept = filtered[self._phase::FACTOR]
        self._phase = (self._phase - len(filtered)) % FACTOR
        return kept.astype(np.float32)
