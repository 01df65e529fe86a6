"""A question spoken with a pause in the middle (a user who hesitates), for tests and scripts/eot_sweep.py.

The question is synthesised whole, so the words before the pause keep the prosody of a sentence that
goes on; it is cut before one of its words, where the sound is quietest near that word's start (Whisper's
word timestamps), and silence is put in between.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kame.audio import SAMPLE_RATE
from kame.pcm import Resampler
from kame.testing.speech import speech

HOP = SAMPLE_RATE // 100  # 10 ms frames for the energy
SEARCH_S = (0.1, 0.05)  # the cut is sought this far before and after the word's timestamp


@dataclass(frozen=True)
class PausedQuestion:
    pcm: np.ndarray  # 24 kHz: the question, the pause inside it, then `tail_s` of silence
    text: str
    before: str  # the words said before the pause
    pause_at_s: float  # audio time the pause starts
    speech_end_s: float  # audio time the last word ends (the true end of the turn)


def _energy(pcm: np.ndarray) -> np.ndarray:
    frames = pcm[: len(pcm) // HOP * HOP].reshape(-1, HOP)
    return np.sqrt((frames**2).mean(axis=1))


def speech_end(pcm: np.ndarray, floor: float = 0.01) -> float:
    """Where the last 10 ms with sound ends (synthesised speech has a little quiet after it), in seconds."""
    loud = np.flatnonzero(_energy(pcm) > floor)
    return 0.0 if len(loud) == 0 else (loud[-1] + 1) * HOP / SAMPLE_RATE


def word_starts(pcm: np.ndarray, model) -> list[tuple[str, float]]:
    """Each word of 24 kHz `pcm` and when it starts (s), from a faster-whisper `WhisperModel`."""
    segments, _ = model.transcribe(Resampler(SAMPLE_RATE, 16000)(pcm), language="en", word_timestamps=True, beam_size=1,
                                   condition_on_previous_text=False)
    return [(w.word.strip(), w.start) for s in segments for w in s.words]


def quietest_cut(pcm: np.ndarray, at_s: float) -> int:
    """The sample to cut at: the quietest 10 ms near `at_s`."""
    energy = _energy(pcm)
    lo = max(0, int((at_s - SEARCH_S[0]) * 100))
    hi = min(len(energy), int((at_s + SEARCH_S[1]) * 100) + 1)
    return (lo + int(np.argmin(energy[lo:hi]))) * HOP if hi > lo else int(at_s * SAMPLE_RATE)


def paused_question(text: str, word: int, pause_s: float, cache_dir: str | Path, model,
                    lead_s: float = 0.5, tail_s: float = 3.0, starts: list | None = None) -> PausedQuestion:
    """`text` spoken with `pause_s` of silence before its `word`-th word (0-based; negative counts from
    the end), after `lead_s` of silence; `model`: a faster-whisper WhisperModel for the word timestamps
    (or `starts`, what `word_starts` said of this text before)."""
    pcm = speech(text, cache_dir)
    starts = starts if starts is not None else word_starts(pcm, model)
    cut = quietest_cut(pcm, starts[word][1])
    before = " ".join(w for w, _ in starts[:word])
    lead, pause, tail = (np.zeros(int(s * SAMPLE_RATE), np.float32) for s in (lead_s, pause_s, tail_s))
    end = lead_s + pause_s + speech_end(pcm)
    return PausedQuestion(np.concatenate([lead, pcm[:cut], pause, pcm[cut:], tail]), text, before,
                          lead_s + cut / SAMPLE_RATE, end)
