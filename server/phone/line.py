"""A phone call's audio path, outside a call: what `PhoneCarrier` does to the caller's audio (the line's
codec at 8 kHz, the server's decoder and upsampler, the telephone echo canceller told what was sent down
the line), as an input processor of `kame eval robustness`:

    kame eval robustness --input-processor server.phone.line:PhoneLine --conditions clean,echo

so that the robustness figures of a phone call come from the phone path's own code, not from a model of
it. The caller's side (the handset's microphone onto the line) is the line's encoder at 8 kHz; what the
session played goes down the line through the server's encoder, which tells the echo canceller.
"""

from __future__ import annotations

import numpy as np

from kame.aec import EchoOptions
from server.echo import CallEcho
from server.phone import audio as phone_audio
from server.phone.streams import Encoding


class PhoneLine:
    """One session's phone line: `process_input(mic, played)` is the frame the session hears when the caller's
    microphone took `mic` (24 kHz, with any echo in it) while the assistant's `played` went down the line."""

    def __init__(self, encoding: Encoding = "audio/pcmu", rate: int = 8000,
                 echo: EchoOptions | None = None) -> None:
        self.echo = CallEcho(echo if echo is not None else EchoOptions())
        self.echo.formats("audio/pcmu", "audio/pcmu")  # as PhoneCarrier: a phone line, whatever its codec
        self._handset = phone_audio.encoder(encoding, rate)  # the caller's side, onto the line
        self._decode = self.echo.decoder(phone_audio.decoder(encoding, rate))  # the server's side: as in a call
        self._encode = self.echo.encoder(phone_audio.encoder(encoding, rate))

    def process_input(self, mic: np.ndarray, played: np.ndarray) -> np.ndarray:
        self._encode(np.asarray(played, np.float32))  # down the line (the canceller's reference)
        return self._decode(self._handset(np.asarray(mic, np.float32)))
