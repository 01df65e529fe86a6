"""Echo cancellation of telephone sessions: the server sends the caller the assistant's voice and hears
the caller's microphone, so it takes the echo of what it sent (kame.aec) out of what it hears, before
the ASR and the front-end do. A session is a telephone one while its audio is G.711 both ways
(audio/pcmu, audio/pcma): a speakerphone's echo comes back on it; browsers and apps cancel their own."""

from __future__ import annotations

import numpy as np

from kame.aec import EchoCanceller, EchoOptions, echo_canceller
from kame.telephony import TELEPHONE_RATE

TELEPHONE_FORMATS = frozenset({"audio/pcmu", "audio/pcma"})


class CallEcho:
    """One session's echo path, on the line's own 8 kHz audio (what the caller hears and sends, at a
    third of the canceller's cost at 24 kHz): `sent` is told the audio sent as the caller decodes it,
    `heard` cleans the caller's decoded audio. Idle (audio passes untouched) unless the session is a
    telephone one and `[echo] telephone` is on."""

    def __init__(self, options: EchoOptions) -> None:
        self.options = options
        self.canceller: EchoCanceller | None = None

    @property
    def active(self) -> bool:
        return self.canceller is not None

    def formats(self, input_type: str, output_type: str) -> None:
        """The session's audio formats are (now) these: start or stop cancelling."""
        if not (self.options.telephone and {input_type, output_type} <= TELEPHONE_FORMATS):
            self.canceller = None
        elif self.canceller is None:
            self.canceller = echo_canceller(sample_rate=TELEPHONE_RATE, delay_ms=self.options.delay_ms,
                                            max_reference_s=self.options.max_reference_s)

    def sent(self, pcm: np.ndarray) -> None:
        if self.canceller is not None:
            self.canceller.play(pcm)

    def heard(self, pcm: np.ndarray) -> np.ndarray:
        return pcm if self.canceller is None else self.canceller.capture(pcm)

    def playback_stopped(self) -> None:
        """The caller stopped playing what it was sent (a truncation): no echo of the rest will come."""
        if self.canceller is not None:
            self.canceller.clear_reference()
