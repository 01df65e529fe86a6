"""A phone line's audio to and from the front-end's 24 kHz: G.711 (mu-law, A-law) at 8 kHz, or 16-bit PCM
at the carrier's rate (Vonage's 16 kHz, Exotel's 8 kHz), through the project's streaming resampler. The
front-end and the ASR hear the phone band, upsampled; nothing is made up above it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kame.audio import SAMPLE_RATE
from kame.pcm import Resampler, alaw_decode, alaw_encode, pcm16_decode, pcm16_encode, ulaw_decode, ulaw_encode
from server.phone.streams import Encoding

_CODECS = {"audio/pcmu": (ulaw_decode, ulaw_encode, 1), "audio/pcma": (alaw_decode, alaw_encode, 1),
           "audio/pcm": (pcm16_decode, pcm16_encode, 2)}


def bytes_per_second(encoding: Encoding, rate: int) -> int:
    return rate * _CODECS[encoding][2]


def decoder(encoding: Encoding, rate: int) -> Callable[[bytes], np.ndarray]:
    """The line's bytes -> float32 at 24 kHz (the resampler's state carried from chunk to chunk)."""
    decode = _CODECS[encoding][0]
    if rate == SAMPLE_RATE:
        return decode
    upsample = Resampler(rate, SAMPLE_RATE)
    return lambda data: upsample(decode(data))


def encoder(encoding: Encoding, rate: int) -> Callable[[np.ndarray], bytes]:
    """float32 at 24 kHz -> the line's bytes."""
    encode = _CODECS[encoding][1]
    if rate == SAMPLE_RATE:
        return encode
    downsample = Resampler(SAMPLE_RATE, rate)
    return lambda pcm: encode(downsample(pcm))
