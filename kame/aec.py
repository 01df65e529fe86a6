"""Echo cancellation of the user's channel, between the microphone and everything that listens to it:
WebRTC's audio processing module (AEC3, through the `livekit` package's binding) takes out of what
the microphone heard the assistant's own voice, given what was played (the reference), at 24 kHz.

Where one program owns both directions: `kame talk` (client/talk.py) and telephone sessions on the
server (server/echo.py). Browsers cancel their own echo. docs/echo.md has the numbers.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Annotated

import numpy as np
from pydantic import Field

from kame.audio import SAMPLE_RATE
from kame.errors import KameError

logger = logging.getLogger(__name__)

CHUNK_S = 0.01  # the module takes 10 ms at a time (240 samples at 24 kHz, a rate it resamples inside)
_FULL_SCALE = 32767.0


class EchoCancellerUnavailable(KameError):
    """The echo canceller's library cannot be loaded on this machine."""


@dataclass(frozen=True)
class EchoOptions:
    """Echo cancellation on the server: the schema of `[echo]` (server/settings.py builds it from these fields)."""

    telephone: bool = True  # cancel the echo of telephone sessions (G.711 both ways: audio/pcmu, audio/pcma)
    # hint: played-to-heard delay in ms; None: AEC3 estimates it from the audio
    delay_ms: Annotated[int | None, Field(ge=0, le=1000)] = None
    # played audio no input has matched yet is kept this long, then dropped
    max_reference_s: Annotated[float, Field(ge=0.1, le=10)] = 2.0


def _rtc():
    try:
        from livekit import rtc
    except (ImportError, OSError) as exc:  # the package, or its native library, is missing
        raise EchoCancellerUnavailable(f"echo cancellation is unavailable: the livekit package cannot be "
                                       f"loaded ({exc}); pip install livekit==1.1.21") from exc
    return rtc


def _int16(pcm: np.ndarray) -> bytes:
    return (np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0) * _FULL_SCALE).round().astype(np.int16).tobytes()


class EchoCanceller:
    """One conversation's canceller. Feed the played audio with `play` and the microphone's with
    `capture`, in any chunk sizes, float32 at `sample_rate` (the session's 24 kHz by default); each
    10 ms of microphone audio is cleaned against the next 10 ms of played audio not yet used (silence
    when none is waiting), so the reference is consumed at the microphone's pace, as a speaker plays
    it. `process_input` does both for one pair of equal frames.

    AEC3 finds the delay between the reference and its echo by itself (measured up to 500 ms here, see
    docs/echo.md); `delay_ms` is a hint for it. Not thread-safe: one caller at a time."""

    def __init__(self, *, sample_rate: int = SAMPLE_RATE, delay_ms: int | None = None,
                 max_reference_s: float = EchoOptions.max_reference_s, noise_suppression: bool = False) -> None:
        self._rtc = _rtc()
        self.sample_rate, self.chunk = sample_rate, round(sample_rate * CHUNK_S)
        self._apm = self._rtc.AudioProcessingModule(echo_cancellation=True, noise_suppression=noise_suppression,
                                                    high_pass_filter=True)
        self.delay_ms = delay_ms
        self._max_reference = max(self.chunk, int(max_reference_s * sample_rate))
        self._reference = np.zeros(0, dtype=np.float32)  # played, not yet matched with microphone audio
        self._pending = np.zeros(0, dtype=np.float32)  # microphone audio short of a 10 ms chunk

    def play(self, pcm: np.ndarray) -> None:
        """Audio that the speaker plays: the reference."""
        reference = np.concatenate([self._reference, np.asarray(pcm, dtype=np.float32)])
        if len(reference) > self._max_reference:  # nobody's input matched it: older than any echo we can catch
            reference = reference[-self._max_reference:]
        self._reference = reference

    def clear_reference(self) -> None:
        """The played audio queued so far will not be played (the listener stopped its playback)."""
        self._reference = np.zeros(0, dtype=np.float32)

    def capture(self, pcm: np.ndarray) -> np.ndarray:
        """Microphone audio -> the same audio without the echo. Whole 10 ms chunks come back; a remainder
        waits for the next call (chunks of a multiple of 10 ms, e.g. 80 ms frames, come back whole)."""
        audio = np.concatenate([self._pending, np.asarray(pcm, dtype=np.float32)])
        chunk = self.chunk
        whole = len(audio) - len(audio) % chunk
        self._pending = audio[whole:]
        out = np.empty(whole, dtype=np.float32)
        for start in range(0, whole, chunk):
            out[start:start + chunk] = self._chunk(audio[start:start + chunk])
        return out

    def process_input(self, mic_frame: np.ndarray, played_frame: np.ndarray) -> np.ndarray:
        """One frame of microphone audio and the frame played meanwhile (24 kHz float32, equal length)
        -> the microphone's frame cleaned."""
        self.play(played_frame)
        return self.capture(mic_frame)

    def _chunk(self, mic: np.ndarray) -> np.ndarray:
        rtc, chunk, rate = self._rtc, self.chunk, self.sample_rate
        reference, self._reference = self._reference[:chunk], self._reference[chunk:]
        if len(reference) < chunk:
            reference = np.pad(reference, (0, chunk - len(reference)))
        self._apm.process_reverse_stream(rtc.AudioFrame(_int16(reference), rate, 1, chunk))
        if self.delay_ms is not None:  # the module forgets it after each chunk
            self._apm.set_stream_delay_ms(int(self.delay_ms))
        frame = rtc.AudioFrame(_int16(mic), rate, 1, chunk)
        self._apm.process_stream(frame)  # in place
        return np.asarray(frame.data, dtype=np.float32) / 32768.0


def echo_canceller(**options) -> EchoCanceller | None:
    """An `EchoCanceller`, or None (logged once) where its library is missing: callers go on without."""
    try:
        return EchoCanceller(**options)
    except EchoCancellerUnavailable as exc:
        _warn_once(str(exc))
        return None


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning("%s", message)
