"""GPT-Live's silence is digital: between its bursts of speech its audio is zeros. A front-end's is whatever
its codec makes of quiet (tiny-copy: continuous noise; a trained Moshi: a low floor, its level unmeasured
here), and a client that judges the assistant's speech by its level waits for a silence that never comes:
LiveKit's GPTLiveModel ends an assistant "burst" only after 0.8 s below ~0.0011 RMS, and reports a function
tool's output only then (docs/live.md, "Silence"). `SilenceGate` sends zeros once the front-end has said
no word (no text token) for `hold_s`, the last frame before them faded out, until its next word."""

from __future__ import annotations

import numpy as np

from kame.audio import FRAME_S


class SilenceGate:
    def __init__(self, hold_s: float) -> None:
        self.hold_frames = max(1, round(hold_s / FRAME_S))
        self._last_word: int | None = None  # the frame of the front-end's latest text token
        self._open = False

    def word(self, frame: int) -> None:
        """The front-end said a word (a text piece) at `frame`."""
        self._last_word = frame

    def __call__(self, frame: int, pcm: np.ndarray) -> np.ndarray:
        """The frame's audio as it goes out."""
        speaking = self._last_word is not None and frame - self._last_word <= self.hold_frames
        was_open, self._open = self._open, speaking
        if speaking:
            return pcm
        if was_open:  # the first frame of silence: a fade, not a click
            return (pcm * np.linspace(1.0, 0.0, len(pcm), dtype=np.float32)).astype(np.float32)
        return np.zeros_like(pcm)
