"""The listening conditions of `kame eval robustness`: a question's speech as real users give it.

Each condition renders one question (24 kHz float32) from a voice, deterministically: the same
question, voice and seed give the same samples. Disfluencies and pauses need word timings a TTS does
not give, so they are built from the phrase segments of the question (its `|` boundary) spoken
separately by the same voice, trimmed of the TTS's own leading and trailing silence and joined with
set gaps; the mixing conditions (background speech, the telephone band) start from the question spoken
whole. Echo is not rendered here: it depends on what the session says back, so the session loop mixes
it frame by frame through an `EchoPath`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kame.audio import SAMPLE_RATE
from kame.pcm import TELEPHONE_RATE, Resampler, ulaw_decode, ulaw_encode

BOUNDARY = "|"  # marks a phrase boundary in a question: where pauses, fillers and restarts go
JOIN_GAP_S = 0.12  # the gap between two segments spoken separately (a short natural pause)
FILLER_GAP_S = 0.15  # around a filler
RESTART_GAP_S = 0.2  # between the cut-off start and the restart
TRIM_FLOOR = 0.02  # of a segment's peak: below it, leading and trailing samples are the TTS's silence
# samples at 24 kHz: the group delay of the telephone filters (47.5 down, 47.5 up)
TELEPHONE_DELAY = round(SAMPLE_RATE * (Resampler(SAMPLE_RATE, TELEPHONE_RATE).delay_s
                                       + Resampler(TELEPHONE_RATE, SAMPLE_RATE).delay_s))

# what a person in the room says to someone else (background speech); none of the questions' topics
BACKGROUND_SENTENCES = (
    "Could you pass me the salt, please?",
    "I think the train leaves at half past six tonight.",
    "Did you remember to water the plants this morning?",
    "My sister is coming over for dinner on Sunday.",
    "The printer on the second floor is out of paper again.",
    "We should paint the kitchen a lighter colour next spring.",
)

Speak = Callable[[str], np.ndarray]  # text -> 24 kHz float32 speech, deterministic


@dataclass(frozen=True)
class Question:
    id: str
    text: str  # with the boundary marker: "What is the capital | of Spain?"
    answer: str  # what a right answer says (the scripted LLM's reply)
    keywords: tuple[str, ...]  # any of them in an answer makes it right

    @property
    def plain(self) -> str:
        """The question as said, without the marker."""
        return " ".join(self.text.replace(BOUNDARY, " ").split())

    @property
    def segments(self) -> list[str]:
        return [s.strip() for s in self.text.split(BOUNDARY) if s.strip()]


@dataclass(frozen=True)
class Voices:
    """Who speaks: the user's voice, and another one for background speech."""

    user: Speak
    other: Speak


@dataclass(frozen=True)
class Rendered:
    pcm: np.ndarray  # the user's input, 24 kHz float32
    speech_end_s: float  # where the question's last word ends (the true end of the user's turn)
    reference: str  # what the user means to ask (the WER's reference)
    interjection: np.ndarray | None = None  # said over the assistant once it speaks (`Interjection`)


@dataclass(frozen=True)
class Condition:
    name: str
    describe: str  # one line for the report
    render: Callable[[Question, Voices, int], Rendered]  # (question, voices, seed)
    echo: bool = False  # the session loop mixes the assistant's output back into the input


# ----------------------------------------------------------------------------- building blocks


def trim(pcm: np.ndarray, floor: float = TRIM_FLOOR) -> np.ndarray:
    """`pcm` without the leading and trailing samples under `floor` x its peak (keeping 10 ms each side)."""
    pcm = np.asarray(pcm, np.float32)
    loud = np.flatnonzero(np.abs(pcm) >= floor * (np.abs(pcm).max() or 1.0))
    if not len(loud):
        return pcm[:0]
    margin = SAMPLE_RATE // 100
    return pcm[max(0, loud[0] - margin):loud[-1] + 1 + margin]


def silence(seconds: float) -> np.ndarray:
    return np.zeros(round(seconds * SAMPLE_RATE), np.float32)


def join(parts: list[np.ndarray | float]) -> np.ndarray:
    """Audio pieces and gaps (seconds) end to end."""
    return np.concatenate([silence(p) if isinstance(p, (int, float)) else p for p in parts]).astype(np.float32)


def speech_end(pcm: np.ndarray, floor: float = TRIM_FLOOR) -> float:
    """Seconds to the end of the last sample at or above `floor` x the peak."""
    loud = np.flatnonzero(np.abs(pcm) >= floor * (np.abs(pcm).max() or 1.0))
    return (loud[-1] + 1) / SAMPLE_RATE if len(loud) else 0.0


def power(pcm: np.ndarray) -> float:
    return float(np.mean(np.square(pcm, dtype=np.float64))) if len(pcm) else 0.0


def snr_db(signal: np.ndarray, noise: np.ndarray) -> float:
    return 10 * np.log10(power(signal) / power(noise))


def mix_at_snr(signal: np.ndarray, noise: np.ndarray, snr: float) -> np.ndarray:
    """`signal` plus `noise` (as long) scaled so that their power ratio is `snr` dB."""
    scale = np.sqrt(power(signal) / (power(noise) * 10 ** (snr / 10)))
    return (signal + noise * scale).astype(np.float32)


def words(text: str) -> list[str]:
    """Lower-case words, punctuation dropped (the WER's and the metrics' tokens)."""
    return re.findall(r"[a-z0-9']+", text.lower())


# ----------------------------------------------------------------------------- renderers


def clean(question: Question, voices: Voices, seed: int = 0) -> Rendered:
    pcm = trim(voices.user(question.plain))
    return Rendered(pcm, speech_end(pcm), question.plain)


def _segments(question: Question, voices: Voices) -> tuple[np.ndarray, np.ndarray]:
    """The question's words before and after its (first) boundary, each spoken alone and trimmed."""
    head, *rest = question.segments
    return trim(voices.user(head)), trim(voices.user(" ".join(rest)))


def paused(seconds: float) -> Callable[[Question, Voices, int], Rendered]:
    def render(question: Question, voices: Voices, seed: int = 0) -> Rendered:
        head, tail = _segments(question, voices)
        pcm = join([head, seconds, tail])
        return Rendered(pcm, speech_end(pcm), question.plain)
    return render


def fillers(question: Question, voices: Voices, seed: int = 0) -> Rendered:
    """"What is the capital, um, uh, of Spain?": two fillers at the boundary."""
    head, tail = _segments(question, voices)
    um, uh = trim(voices.user("Um.")), trim(voices.user("Uh."))
    pcm = join([head, FILLER_GAP_S, um, FILLER_GAP_S, uh, FILLER_GAP_S, tail])
    return Rendered(pcm, speech_end(pcm), question.plain)


def restart(question: Question, voices: Voices, seed: int = 0) -> Rendered:
    """"What is the capital of- the capital of Spain?": the first word after the boundary is cut off,
    then the user starts again two words before the boundary."""
    head, *rest = question.segments
    tail = " ".join(rest)
    false_start = f"{head} {tail.split()[0]}"
    again = " ".join(head.split()[-2:] + tail.split())
    pcm = join([trim(voices.user(false_start)), RESTART_GAP_S, trim(voices.user(again))])
    return Rendered(pcm, speech_end(pcm), question.plain)


def background(snr: float) -> Callable[[Question, Voices, int], Rendered]:
    """Another voice saying unrelated sentences (to someone else) under the whole question, at `snr` dB."""
    def render(question: Question, voices: Voices, seed: int = 0) -> Rendered:
        speech = clean(question, voices, seed)
        noise = _babble(voices.other, len(speech.pcm), seed)
        return Rendered(mix_at_snr(speech.pcm, noise, snr), speech.speech_end_s, speech.reference)
    return render


def _babble(speak: Speak, length: int, seed: int) -> np.ndarray:
    """Unrelated sentences end to end from a seeded start, cut to `length` samples, starting mid-stream."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(BACKGROUND_SENTENCES))
    parts: list[np.ndarray | float] = []
    total, index = 0, 0
    offset = int(rng.integers(0, SAMPLE_RATE // 2))  # the other talker is already speaking
    while total < length + offset:
        piece = trim(speak(BACKGROUND_SENTENCES[order[index % len(order)]]))
        parts += [piece, 0.25]
        total += len(piece) + SAMPLE_RATE // 4
        index += 1
    return join(parts)[offset:offset + length]


def interjecting(text: str) -> Callable[[Question, Voices, int], Rendered]:
    """The clean question; then, once the assistant has been talking for a moment, the user says `text`
    over it ("Mm-hmm.": a backchannel; "Wait, what about Rome?": a barge-in)."""
    def render(question: Question, voices: Voices, seed: int = 0) -> Rendered:
        asked = clean(question, voices, seed)
        return Rendered(asked.pcm, asked.speech_end_s, asked.reference, trim(voices.user(text)))
    return render


def telephone_band(pcm: np.ndarray) -> np.ndarray:
    """`pcm` through a phone line: 8 kHz, G.711 mu-law both ways, back to 24 kHz; time-aligned, same length."""
    padded = np.concatenate([np.asarray(pcm, np.float32), np.zeros(TELEPHONE_DELAY + 3, np.float32)])
    narrow = Resampler(SAMPLE_RATE, TELEPHONE_RATE)(padded)
    wide = Resampler(TELEPHONE_RATE, SAMPLE_RATE)(ulaw_decode(ulaw_encode(narrow)))
    return wide[TELEPHONE_DELAY:TELEPHONE_DELAY + len(pcm)].astype(np.float32)


def telephone(question: Question, voices: Voices, seed: int = 0) -> Rendered:
    speech = clean(question, voices, seed)
    return Rendered(telephone_band(speech.pcm), speech.speech_end_s, speech.reference)


# ----------------------------------------------------------------------------- echo


class EchoPath:
    """The room between a laptop's speaker and its microphone: what the mic picks up of the played
    signal, `delay_s` later and `gain_db` quieter. Streaming: feed it the played audio frame by frame."""

    def __init__(self, delay_s: float = 0.12, gain_db: float = -6.0) -> None:
        self.delay = round(delay_s * SAMPLE_RATE)
        self.gain = float(10 ** (gain_db / 20))
        self._line = np.zeros(self.delay, np.float32)

    def __call__(self, played: np.ndarray) -> np.ndarray:
        """The echo heard during the frame in which `played` is played (same length)."""
        line = np.concatenate([self._line, np.asarray(played, np.float32)])
        heard, self._line = line[:len(played)], line[len(played):]
        return (heard * self.gain).astype(np.float32)


# ----------------------------------------------------------------------------- the set


CONDITIONS: dict[str, Condition] = {c.name: c for c in (
    Condition("clean", "the question as the voice says it", clean),
    Condition("fillers", "'um', 'uh' at the phrase boundary", fillers),
    Condition("restart", "a false start cut off after the boundary's next word, then said again", restart),
    Condition("pause_0.5s", "0.5 s of silence at the phrase boundary", paused(0.5)),
    Condition("pause_1s", "1 s of silence at the phrase boundary", paused(1.0)),
    Condition("pause_2s", "2 s of silence at the phrase boundary", paused(2.0)),
    Condition("background_10db", "another voice talking to someone else, 10 dB under the question", background(10)),
    Condition("background_5db", "another voice talking to someone else, 5 dB under the question", background(5)),
    Condition("telephone", "8 kHz G.711 mu-law round trip, back to 24 kHz", telephone),
    Condition("echo", "the assistant's own output back into the mic (delay, attenuation: see the flags)", clean,
              echo=True),
    Condition("backchannel", "the clean question, then 'Mm-hmm.' over the assistant once it talks",
              interjecting("Mm-hmm.")),
    Condition("barge_in", "the clean question, then 'Wait, what about Rome?' over the assistant once it talks",
              interjecting("Wait, what about Rome?")),
)}


def pick(names: str | None) -> list[Condition]:
    """The conditions named in a comma list (all when None), in the table's order; unknown: ValueError."""
    if not names:
        return list(CONDITIONS.values())
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in CONDITIONS]
    if unknown:
        raise ValueError(f"unknown conditions {unknown}; known: {', '.join(CONDITIONS)}")
    return [CONDITIONS[n] for n in chosen]
