"""Echo cancellation of telephone sessions: the server sends the caller the assistant's voice and hears
the caller's microphone, so it takes the echo of what it sent (kame.aec) out of what it hears, before
the ASR and the front-end do. A session is a telephone one while its audio is G.711 both ways
(audio/pcmu, audio/pcma): a speakerphone's echo comes back on it; browsers and apps cancel their own."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kame.aec import EchoCanceller, EchoOptions, echo_canceller

TELEPHONE_FORMATS = frozenset({"audio/pcmu", "audio/pcma"})


class CallEcho:
    """One session's echo path, at 24 kHz around the session's codecs: `sent` is told the audio before
    it is encoded for the caller, `heard` cleans the caller's audio once decoded. (At the line's own
    8 kHz the canceller costs half as much, but lost more of the caller's words in double talk:
    docs/echo.md.) Idle, audio untouched, unless the session is a telephone one and `[echo] telephone`
    is on."""

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
            options = self.options
            self.canceller = echo_canceller(delay_ms=options.delay_ms, max_reference_s=options.max_reference_s)

    def sent(self, pcm: np.ndarray) -> None:
        if self.canceller is not None:
            self.canceller.play(pcm)

    def heard(self, pcm: np.ndarray) -> np.ndarray:
        return pcm if self.canceller is None else self.canceller.capture(pcm)

    def playback_stopped(self) -> None:
        """The caller stopped playing what it was sent (a truncation): no echo of the rest will come."""
        if self.canceller is not None:
            self.canceller.clear_reference()

    def decoder(self, decode: Callable[[bytes], np.ndarray]) -> Callable[[bytes], np.ndarray]:
        """The session's decoder, followed by the canceller while it is active."""
        return decode if self.canceller is None else lambda data: self.heard(decode(data))

    def encoder(self, encode: Callable[[np.ndarray], bytes]) -> Callable[[np.ndarray], bytes]:
        """The session's encoder, telling the canceller what it encodes while it is active."""
        if self.canceller is None:
            return encode

        def encode_sent(pcm: np.ndarray) -> bytes:
            self.sent(pcm)
            return encode(pcm)
        return encode_sent
