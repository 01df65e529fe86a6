"""Streaming 2:1 resamplers between WebRTC's 48 kHz and the front-end's 24 kHz: one windowed-sinc
low-pass (64 taps, 0.66 ms of delay), every chunk in gives its exact share out at once. soxr's
streams give their output in blocks (at 48 -> 24 kHz in 20 ms packets: nothing, then two packets'
worth), which is latency a realtime link cannot spend.
"""

from __future__ import annotations

import numpy as np

TAPS = 64
CUTOFF = 11000 / 48000  # of the 48 kHz rate: under the 24 kHz side's 12 kHz Nyquist


def _lowpass() -> np.ndarray:
    n = np.arange(TAPS) - (TAPS - 1) / 2
    h = np.sinc(2 * CUTOFF * n) * np.kaiser(TAPS, 8.0)
    return (h / h.sum()).astype(np.float32)


class Down2:
    """48 kHz in, 24 kHz out: filtered, then every other sample."""

    def __init__(self) -> None:
        self._kernel = _lowpass()
        self._history = np.zeros(TAPS - 1, np.float32)
        self._phase = 0  # which filtered sample of the next chunk is the first kept

    def __call__(self, pcm: np.ndarray) -> np.ndarray:
        x = np.concatenate([self._history, np.asarray(pcm, np.float32)])
        self._history = x[len(x) - (TAPS - 1):]
        filtered = np.convolve(x, self._kernel, mode="valid")
        out = filtered[self._phase::2]
        self._phase = (self._phase + len(filtered)) % 2
        return out.astype(np.float32, copy=False)


class Up2:
    """24 kHz in, 48 kHz out: each sample twice as many, by the two phases of the low-pass."""

    def __init__(self) -> None:
        kernel = 2 * _lowpass()
        self._even, self._odd = kernel[0::2], kernel[1::2]
        self._history = np.zeros(TAPS // 2 - 1, np.float32)

    def __call__(self, pcm: np.ndarray) -> np.ndarray:
        x = np.concatenate([self._history, np.asarray(pcm, np.float32)])
        self._history = x[len(x) - (TAPS // 2 - 1):]
        out = np.empty(2 * (len(x) - (TAPS // 2 - 1)), np.float32)
        out[0::2] = np.convolve(x, self._even, mode="valid")
        out[1::2] = np.convolve(x, self._odd, mode="valid")
        return out
