"""Offline inference: run the front-end over an audio file with a scripted oracle schedule."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kame.audio import FRAME_SIZE, SAMPLE_RATE, frames_of
from kame.errors import KameError
from kame.frontend.engine import FRAME_RATE, BatchedEngine, GenerationConfig
from kame.frontend.loader import Frontend
from kame.frontend.oracle import OracleUpdate, PieceDecoder, tokenize_words
from kame.frontend.persona import persona_prompt
from kame.frontend.voices import VoiceLibrary


@dataclass(frozen=True)
class OracleCue:
    """At `at_s` seconds of input audio, reset the oracle to `text`."""

    at_s: float
    text: str


@dataclass(frozen=True)
class TextPiece:
    frame: int
    time_s: float
    token: int
    text: str


@dataclass
class InferResult:
    audio: np.ndarray  # float32 at 24 kHz, one frame out per frame in
    pieces: list[TextPiece] = field(default_factory=list)
    oracle: list[dict] = field(default_factory=list)  # applied updates: frame, time, epoch, text

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces).strip()

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "duration_s": len(self.audio) / SAMPLE_RATE,
            "pieces": [p.__dict__ for p in self.pieces],
            "oracle": self.oracle,
        }


def run_inference(
    frontend: Frontend,
    pcm: np.ndarray,
    cues: list[OracleCue] = (),
    tail_s: float = 1.0,
    gen: GenerationConfig | None = None,
    persona: str | None = None,
    voice: str | None = None,
    voices: VoiceLibrary | None = None,
) -> InferResult:
    """Step the front-end over `pcm` (24 kHz mono) plus `tail_s` of silence, applying `cues`; `persona`: a
    PersonaPlex-layout front-end's role text, prefilled first as its reference does (SessionError elsewhere).
    Frames and times count from the conversation's first frame, the prompt's left out."""
    prompt = persona_prompt(frontend, persona, voice, voices)
    if cues and frontend.tokenizer is None:
        raise KameError(f"front-end {frontend.source!r} has no text tokenizer, so it cannot take an oracle")
    pcm = np.concatenate([pcm, np.zeros(int(tail_s * SAMPLE_RATE), dtype=np.float32)])
    pending = sorted(cues, key=lambda c: c.at_s)
    engine = BatchedEngine(frontend, batch_size=1, gen=gen)
    try:
        slot = engine.acquire()
        engine.prefill(slot, prompt)
        result = InferResult(audio=np.zeros(0, dtype=np.float32))
        chunks = []
        pieces = PieceDecoder(frontend.tokenizer) if frontend.tokenizer is not None else None
        for index, frame in enumerate(frames_of(pcm, FRAME_SIZE)):
            now = index / FRAME_RATE
            while pending and pending[0].at_s <= now:
                cue = pending.pop(0)
                epoch = len(result.oracle)
                engine.push_oracle(slot, OracleUpdate.reset(epoch, tuple(tokenize_words(frontend.tokenizer, cue.text))))
                result.oracle.append({"frame": index, "time_s": now, "epoch": epoch, "text": cue.text})
            out = engine.step({slot: frame})[0]
            chunks.append(out.pcm)
            if out.text_token is not None and pieces is not None and (text := pieces.push(out.text_token)):
                frame_index = out.frame - len(prompt)
                result.pieces.append(TextPiece(frame_index, frame_index / FRAME_RATE, out.text_token, text))
        result.audio = np.concatenate(chunks) if chunks else result.audio
        return result
    finally:
        engine.close()
