"""GPT-Live's standby over WebRTC: a session idle for `idle_timeout_s` pauses (the front-end's slot
gets no frames, so the engine steps it no more; the ASR hears nothing), the user's speech above
`wake_policy.vad_threshold` resumes it. What was said while the detector made up its mind (the
last `PREROLL_S`) goes to the session on waking, so the first words are heard and transcribed.

`Standby` is the state and the time (the mapping's clock); `SpeechDetector` is Silero VAD on the
paused session's audio (the transport runs it: only while paused)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np

from kame.asr.vad import VAD_CHUNK, StreamingVad
from kame.audio import SAMPLE_RATE
from kame.pcm import Resampler

PREROLL_S = 0.6  # audio kept while paused: what the detector heard before it decided, and a little more
DEFAULT_VAD_THRESHOLD = 0.5  # the protocol's default


@dataclass
class Standby:
    """When a session pauses and for how long it was paused; active time is the rest."""

    idle_timeout_s: float
    vad_threshold: float
    last_activity: float
    paused_since: float | None = None
    paused_s: float = 0.0  # finished pauses, less the audio each wake kept (heard: `resume`)
    preroll: collections.deque[np.ndarray] = field(default_factory=collections.deque)

    @property
    def paused(self) -> bool:
        return self.paused_since is not None

    def active(self, now: float) -> None:
        """Something happened (words either way, a delegation, a client event): the idle time restarts."""
        self.last_activity = max(self.last_activity, now)

    def due(self) -> float | None:
        """When the session pauses if nothing happens before; None while paused."""
        return None if self.paused else self.last_activity + self.idle_timeout_s

    def pause(self, now: float) -> None:
        self.paused_since = now
        self.preroll.clear()

    def hear(self, pcm: np.ndarray) -> None:
        """Paused: the user's audio is kept for the wake (the last PREROLL_S of it)."""
        self.preroll.append(pcm)
        while sum(map(len, self.preroll)) - len(self.preroll[0]) >= PREROLL_S * SAMPLE_RATE:
            self.preroll.popleft()

    def resume(self, now: float) -> np.ndarray:
        """The audio kept, for the session to hear now: it counts as heard, not as paused time (the
        session's clock and the usage report both read `paused_s`)."""
        kept = np.concatenate(list(self.preroll)) if self.preroll else np.zeros(0, np.float32)
        self.paused_s += max(0.0, now - self.paused_since - len(kept) / SAMPLE_RATE)
        self.paused_since = None
        self.last_activity = now
        self.preroll.clear()
        return kept

    def usage(self, seconds: int, now: float) -> dict:
        """`session.usage.updated`'s breakdown of `seconds`: paused whole seconds, the rest active (a pause
        in progress counts whole: what it keeps is heard only if the user wakes it)."""
        paused = int(self.paused_s + (now - self.paused_since if self.paused else 0.0))
        paused = min(paused, seconds)
        return {"active_seconds": seconds - paused, "paused_seconds": paused}


class SpeechDetector:
    """Silero VAD over 24 kHz audio (resampled to its 16 kHz, 32 ms windows): whether any window of a
    chunk reached the threshold. A new one per pause (Silero's state starts fresh)."""

    def __init__(self, session, threshold: float) -> None:
        self.threshold = threshold
        self._vad = StreamingVad(session)
        self._resample = Resampler(SAMPLE_RATE, 16000)
        self._pending = np.zeros(0, np.float32)

    def __call__(self, pcm: np.ndarray) -> bool:
        self._pending = np.concatenate([self._pending, self._resample(pcm)])
        speech = False
        while len(self._pending) >= VAD_CHUNK:
            window, self._pending = self._pending[:VAD_CHUNK], self._pending[VAD_CHUNK:]
            speech |= self._vad(window) >= self.threshold
        return speech
