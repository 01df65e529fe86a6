"""A streaming 24 kHz -> 16 kHz resampler for the ASR (whisper and Silero VAD want 16 kHz).

Low-pass (windowed sinc at 7.2 kHz) then linear interpolation at 1.5-sample steps; state is
carried between chunks so chunk boundaries leave no trace and no samples are added.
"""

from __future__ import annotations

import numpy as np

from kame.audio import SAMPLE_RATE

_TAPS = 31


def _lowpass(cutoff: float, taps: int = _TAPS) -> np.ndarray:
    n = np.arange(taps) - (taps - 1) / 2
    h = np.sinc(2 * cutoff * n) * np.hamming(taps)
    return (h / h.sum()).astype(np.float32)


class Resampler24to16:
    STEP = 1.5  # input samples per output sample

    def __init__(self) -> None:
        self._kernel = _lowpass(7200 / SAMPLE_RATE)  # cut-off below 8 kHz, the output's Nyquist
        self._history = np.zeros(_TAPS - 1, dtype=np.float32)  # unfiltered tail of the input
        self._filtered = np.zeros(0, dtype=np.float32)  # filtered samples not yet consumed
        self._pos = 0.0  # position of the next output sample within _filtered

    def __call__(self, pcm: np.ndarray) -> np.ndarray:
        x = np.concatenate([self._history, np.asarray(pcm, dtype=np.float32)])
        self._history = x[-(_TAPS - 1):]
        filtered = np.concatenate([self._filtered, np.convolve(x, self._kernel, mode="valid")])
        count = max(0, int(np.floor((len(filtered) - 1 - self._pos) / self.STEP)) + 1)
        if len(filtered) < 2 or count <= 0:
            self._filtered = filtered
            return np.zeros(0, dtype=np.float32)
        positions = self._pos + self.STEP * np.arange(count)
        positions = positions[positions <= len(filtered) - 1]
        out = np.interp(positions, np.arange(len(filtered)), filtered).astype(np.float32)
        next_pos = positions[-1] + self.STEP
        keep_from = int(np.floor(next_pos))
        self._filtered = filtered[keep_from:]
        self._pos = next_pos - keep_from
        return out
