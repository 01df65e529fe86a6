"""Semantic end of turn: does a pause end the user's turn, or is the user still in mid-sentence?

Smart Turn v3 (Daily's model, BSD-2-Clause; the ONNX file that the pipecat-ai wheel ships) hears the
last 8 s of 16 kHz audio as Whisper log-mel features and gives the probability that the turn is
complete. It judges how the speech before a pause sounds, with a short bit of the pause after it
(given a longer silence it calls nearly every turn complete), so it hears the pause cut to `tail_s`,
once per pause; a fallback silence ends the turn whatever it said (`PauseRule`).
docs/turn-taking.md has the measurements.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from kame.errors import KameError

logger = logging.getLogger(__name__)

RATE = 16000
WINDOW_S = 8  # the model hears the last 8 s, left-padded with zeros when shorter
SMART_TURN_DIST = "pipecat-ai"
SMART_TURN_FILE = "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"
# of smart-turn-v3.2-cpu.onnx in pipecat-ai==1.12.0 (its RECORD says the same)
SMART_TURN_SHA256 = "2bb026316b14a660486a75b1733cd3fbab8c2fd0314dc9af7be49f8cca967e4f"
END_OF_TURN_MODES = ("smart-turn", "silence")


class EndOfTurnError(KameError):
    """A bad end-of-turn setting: an unknown mode, or a model file that is not there."""


class TurnModel(Protocol):
    def __call__(self, audio: np.ndarray) -> float:
        """The probability that the turn is complete, from 16 kHz float32 audio ending now."""


class SmartTurn:
    """Smart Turn v3 on onnxruntime; one per engine, shared by its streams (ONNX Runtime's `run` is
    thread-safe). Blocking (0.1-0.3 s on one busy CPU core): call it from a worker thread."""

    def __init__(self, path: str | Path, threads: int = 1) -> None:
        import onnxruntime as ort
        from transformers import WhisperFeatureExtractor

        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        self.path = Path(path)
        self.session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
        self.features = WhisperFeatureExtractor(chunk_length=WINDOW_S)  # 80 mels x 800 frames

    def __call__(self, audio: np.ndarray) -> float:
        window = np.zeros(WINDOW_S * RATE, dtype=np.float32)
        tail = np.asarray(audio, dtype=np.float32)[-len(window):]
        window[len(window) - len(tail):] = tail
        mel = self.features(window, sampling_rate=RATE, return_tensors="np", do_normalize=True).input_features
        (probability,) = self.session.run(None, {"input_features": mel.astype(np.float32)})
        return float(np.asarray(probability).reshape(-1)[0])


def bundled_smart_turn() -> tuple[Path | None, str]:
    """The model file of the installed pipecat-ai wheel (found without importing pipecat), or None and why."""
    try:
        dist = importlib.metadata.distribution(SMART_TURN_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None, "pipecat-ai is not installed (pip install -e '.[turn]')"
    path = Path(str(dist.locate_file(SMART_TURN_FILE)))
    if not path.is_file():
        return None, f"pipecat-ai {dist.version} has no {Path(SMART_TURN_FILE).name} (pip install -e '.[turn]')"
    if hashlib.sha256(path.read_bytes()).hexdigest() != SMART_TURN_SHA256:
        return None, f"{path} is not the known Smart Turn v3.2 file (sha256 differs; pipecat-ai {dist.version})"
    return path, f"Smart Turn v3.2 from pipecat-ai {dist.version}, sha256 checked"


def load_turn_model(mode: str, path: str | None = None) -> tuple[SmartTurn | None, str]:
    """The model `mode` asks for and a line saying what decides a turn's end; None: the silence rule.

    Smart Turn from an explicit `path` must load (EndOfTurnError otherwise); the bundled one is used
    where pipecat-ai is installed, and its absence is no error: the silence rule stands in."""
    if mode not in END_OF_TURN_MODES:
        raise EndOfTurnError(f"unknown end_of_turn {mode!r}; choose one of {', '.join(END_OF_TURN_MODES)}")
    if mode == "silence":
        return None, "the silence rule (end_of_turn = silence)"
    if path:
        if not Path(path).expanduser().is_file():
            raise EndOfTurnError(f"no Smart Turn model at {path}")
        return SmartTurn(Path(path).expanduser()), f"Smart Turn from {path}"
    found, why = bundled_smart_turn()
    if found is None:
        return None, f"the silence rule: {why}"
    return SmartTurn(found), why


@dataclass
class PauseRule:
    """When a pause ends an utterance, counted in 16 kHz samples of silence (the VAD's).

    With a model: at `ask_s` of silence the model is asked, once per pause, on the utterance up to
    `tail_s` into the pause; complete (probability >= `threshold`) ends it, else it stays open until
    speech resumes (a new pause asks again) or `fallback_s` of silence ends it anyway. Asking later
    than the model's `tail_s` keeps the short pauses inside a sentence (a comma) from being judged at
    all. Without a model: `min_silence_s` ends it."""

    model: TurnModel | None
    min_silence_s: float
    ask_s: float
    fallback_s: float
    threshold: float
    tail_s: float = 0.1
    asked: bool = False  # the model was asked in this pause
    last_probability: float | None = None

    def speech(self) -> None:
        self.asked = False

    def ends(self, silence: int, audio: list[np.ndarray]) -> bool:
        """`silence` samples of silence so far in an utterance whose chunks are `audio`."""
        if self.model is None:
            return silence >= self.min_silence_s * RATE
        if silence >= self.fallback_s * RATE:
            return True
        if self.asked or silence < self.ask_s * RATE:
            return False
        self.asked = True
        cut = max(0, silence - int(self.tail_s * RATE))  # the end of the pause that the model does not hear
        chunks, kept = [], 0
        for chunk in reversed(audio):  # the last 8 s before the cut is all the model hears
            if kept >= WINDOW_S * RATE + cut:
                break
            chunks.append(chunk)
            kept += len(chunk)
        heard = np.concatenate(chunks[::-1])
        try:
            self.last_probability = self.model(heard[: len(heard) - cut])
        except Exception:  # onnxruntime raises its own kinds; the stream goes on
            logger.exception("the end-of-turn model failed: this pause ends the turn (the silence rule)")
            return True
        logger.debug("end of turn: p(complete)=%.3f after %.2f s of silence", self.last_probability, silence / RATE)
        return self.last_probability >= self.threshold


class FramePauseJudge:
    """The model for a frame-by-frame pause rule on a thread that must not wait (Kyutai STT's engine
    thread, `vad.SilenceEndOfTurn`): once a pause reaches `ask_frames` the question goes to `executor`,
    and its answer counts when it is back; speech drops it; `fallback_frames` of pause end the turn anyway."""

    def __init__(self, model: TurnModel, executor, frame_samples: int, ask_frames: int, fallback_frames: int,
                 threshold: float, tail_s: float = 0.1) -> None:
        self.model, self.executor, self.threshold = model, executor, threshold
        self.frame_samples, self.ask_frames, self.fallback_frames = frame_samples, ask_frames, fallback_frames
        self.tail = int(tail_s * RATE)
        self._keep = WINDOW_S * RATE + (fallback_frames + 1) * frame_samples  # the last 8 s and the pause
        self._audio: deque[np.ndarray] = deque()  # 16 kHz, a frame a piece: no copy per frame
        self._held = 0
        self._answer = None  # the future of this pause's question

    def hear(self, audio16: np.ndarray) -> None:
        self._audio.append(audio16)
        self._held += len(audio16)
        while self._held - len(self._audio[0]) >= self._keep:
            self._held -= len(self._audio.popleft())

    def speech(self) -> None:
        self._answer = None  # a question still running is answered into nothing

    def complete(self, quiet: int) -> bool:
        """Whether the pause of `quiet` frames ends the turn, as far as the model knows by now."""
        if quiet >= self.fallback_frames:
            return True
        if quiet >= self.ask_frames and self._answer is None:
            cut = max(0, quiet * self.frame_samples - self.tail)
            audio = np.concatenate(self._audio)
            self._answer = self.executor.submit(self.model, audio[: len(audio) - cut])
        answer = self._answer
        if answer is None or not answer.done():
            return False
        if answer.exception() is not None:  # the silence rule's answer; said once per failure
            if not getattr(answer, "reported", False):
                answer.reported = True
                logger.error("the end-of-turn model failed (%s): this pause ends the turn", answer.exception())
            return True
        return answer.result() >= self.threshold
