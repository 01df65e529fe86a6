"""Silero VAD (the model faster-whisper ships) run as a stream, and the pause rule that ends a
turn where the ASR has no end-of-turn model of its own (with Smart Turn judging the pause, if given)."""

from __future__ import annotations

import math

import numpy as np

from kame.audio import SAMPLE_RATE
from kame.pcm import Resampler

RATE = 16000
VAD_CHUNK = 512  # Silero's window at 16 kHz (32 ms)
VAD_CONTEXT = 64


def silero_session():
    """The ONNX session of faster-whisper's Silero VAD (one per engine; streams keep their own state)."""
    from faster_whisper.vad import get_vad_model

    return get_vad_model().session


class StreamingVad:
    """Silero VAD with its recurrent state carried from chunk to chunk."""

    def __init__(self, session) -> None:
        self.session = session
        self.state_h = np.zeros((1, 1, 128), dtype=np.float32)
        self.state_c = np.zeros((1, 1, 128), dtype=np.float32)
        self.context = np.zeros(VAD_CONTEXT, dtype=np.float32)

    def __call__(self, chunk: np.ndarray) -> float:
        batch = np.concatenate([self.context, chunk])[None, :]
        self.context = chunk[-VAD_CONTEXT:]
        out, self.state_h, self.state_c = self.session.run(
            None, {"input": batch, "h": self.state_h, "c": self.state_c})
        return float(np.asarray(out).reshape(-1)[0])


class SilenceEndOfTurn:
    """An end-of-turn signal from silence, one 80 ms frame of 24 kHz audio at a time: 1.0 once speech
    was heard and then `silence_frames` frames without it, until speech comes again; else 0.0 (what an
    end-of-turn head would say, with a pause for a turn's end). The stream ends an utterance on the
    first frame without text while it is 1.0, so a pause ends the words before it once.

    With `judge` (end_of_turn.FramePauseJudge), the pause must also be judged complete by Smart Turn, or
    reach the judge's fallback: a pause in mid-sentence does not end the turn."""

    def __init__(self, session, silence_frames: int, threshold: float = 0.5, judge=None) -> None:
        self.silence_frames, self.threshold, self.judge = silence_frames, threshold, judge
        self._vad = StreamingVad(session)
        self._resample = Resampler(SAMPLE_RATE, 16000)
        self._pending = np.zeros(0, dtype=np.float32)
        self._heard_speech = False
        self._quiet = 0  # frames since the last one with speech

    @staticmethod
    def frames_for(min_silence_s: float, delay_s: float, frame_rate: float) -> int:
        """The pause that ends a turn, in frames: `min_silence_s`, and at least the ASR's delay and two
        frames more (the VAD's own lag), so that the words said before the pause have come out of a
        delayed-streams model first."""
        return max(math.ceil(min_silence_s * frame_rate), math.ceil(delay_s * frame_rate) + 2)

    def __call__(self, frame: np.ndarray) -> float:
        audio16 = self._resample(frame)
        self._pending = np.concatenate([self._pending, audio16])
        if self.judge is not None:
            self.judge.hear(audio16)
        speech = False
        while len(self._pending) >= VAD_CHUNK:
            chunk, self._pending = self._pending[:VAD_CHUNK], self._pending[VAD_CHUNK:]
            speech |= self._vad(chunk) >= self.threshold
        if speech:
            self._heard_speech, self._quiet = True, 0
            if self.judge is not None:
                self.judge.speech()
        else:
            self._quiet += 1
        if not self._heard_speech:
            return 0.0
        judged = self.judge is None or self.judge.complete(self._quiet)  # asked on every frame: it asks early
        return 1.0 if judged and self._quiet >= self.silence_frames else 0.0
