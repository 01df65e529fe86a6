"""Echo on a table: what a speakerphone's microphone hears (the user, plus the assistant's voice played
back late and quieter, optionally through a room), and the measures of a canceller on it (ERLE, WER).
Shared by tests/test_aec.py and scripts/aec_check.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kame.audio import FRAME_SIZE, SAMPLE_RATE
from kame.eval.robustness_metrics import wer_counts

USER_TEXT = "What is the tallest mountain in Europe, and how high is it?"
ASSISTANT_TEXT = ("The capital of France is Paris. It has been the capital for more than a thousand years, "
                  "and it sits on the river Seine.")


@dataclass(frozen=True)
class EchoScene:
    """One microphone recording: the user and the played audio's echo (through a room, a phone line)."""

    played: np.ndarray  # what was sent to the speaker: the canceller's reference
    user: np.ndarray  # the user's own voice alone (zeros where silent)
    mic: np.ndarray  # what the microphone's side delivers: user + echo
    echo_only: slice  # samples with echo and no user: where ERLE is measured


def phone_line(pcm: np.ndarray) -> np.ndarray:
    """24 kHz audio as it comes out of a G.711 mu-law call: 8 kHz, quantised, back to 24 kHz."""
    from kame.pcm import TELEPHONE_RATE, Resampler, ulaw_decode, ulaw_encode

    narrow = Resampler(SAMPLE_RATE, TELEPHONE_RATE)(pcm)
    return Resampler(TELEPHONE_RATE, SAMPLE_RATE)(ulaw_decode(ulaw_encode(narrow)))[: len(pcm)]


def room_response(rt60_s: float, seed: int = 0) -> np.ndarray:
    """A synthetic room: a direct path, then exponentially decaying noise (-60 dB after `rt60_s`)."""
    length = int(rt60_s * SAMPLE_RATE)
    t = np.arange(length) / SAMPLE_RATE
    tail = np.random.default_rng(seed).normal(0, 1, length) * 10 ** (-3 * t / rt60_s)
    tail[: int(0.003 * SAMPLE_RATE)] = 0  # first reflections come a few ms after the direct sound
    response = 0.3 * tail / np.sqrt(np.sum(tail ** 2))  # reverberant energy 10 dB under the direct sound's
    response[0] = 1.0
    return response.astype(np.float32)


def scene(assistant: np.ndarray, user: np.ndarray | None, *, delay_ms: float, gain_db: float = -6.0,
          rt60_s: float = 0.0, telephone: bool = False, lead_s: float = 0.3, user_at_s: float = 4.0,
          tail_s: float = 1.0) -> EchoScene:
    """The assistant speaks from `lead_s`; its echo comes back `delay_ms` later at `gain_db` (through a
    room of `rt60_s`, 0: none; both ways through a G.711 line with `telephone`); the user (if any) starts
    at `user_at_s`, talking over the assistant's end."""
    lead, at = int(lead_s * SAMPLE_RATE), int(user_at_s * SAMPLE_RATE)
    length = max(lead + len(assistant), at + (0 if user is None else len(user))) + int(tail_s * SAMPLE_RATE)
    length += -length % FRAME_SIZE
    played = np.zeros(length, dtype=np.float32)
    played[lead:lead + len(assistant)] = assistant
    heard = phone_line(played) if telephone else played
    heard = np.convolve(heard, room_response(rt60_s))[:length] if rt60_s > 0 else heard
    delay = int(delay_ms * SAMPLE_RATE / 1000)
    echo = np.zeros(length, dtype=np.float32)
    echo[delay:] = heard[: length - delay] * 10 ** (gain_db / 20)
    voice = np.zeros(length, dtype=np.float32)
    if user is not None:
        voice[at:at + len(user)] = user
    mic = phone_line(voice + echo) if telephone else voice + echo
    echo_end = at if user is not None else lead + len(assistant)
    return EchoScene(played, voice, mic.astype(np.float32), slice(lead + delay + int(1.5 * SAMPLE_RATE), echo_end))


def cancel_frames(process_input: Callable[[np.ndarray, np.ndarray], np.ndarray], mic: np.ndarray,
                  played: np.ndarray, frame: int = FRAME_SIZE) -> np.ndarray:
    """`process_input(mic_frame, played_frame)` over whole recordings, 80 ms frame by frame (at 24 kHz
    unless `frame` says otherwise), as a live session would call it."""
    return np.concatenate([process_input(mic[i:i + frame], played[i:i + frame])
                           for i in range(0, len(mic) - len(mic) % frame, frame)])


def erle_db(mic: np.ndarray, cleaned: np.ndarray, where: slice) -> float:
    """Echo return loss enhancement: how much quieter the echo-only part became, in dB."""
    before, after = float(np.mean(mic[where] ** 2)), float(np.mean(cleaned[where] ** 2))
    return 10 * np.log10(max(before, 1e-20) / max(after, 1e-20))


def word_error_rate(reference: str, hypothesis: str) -> float:
    """(substitutions + deletions + insertions) / reference words, on lower-case words without
    punctuation: the robustness evaluation's WER, with an empty reference counted as one word."""
    edits, total = wer_counts(reference, hypothesis)
    return edits / max(total, 1)
