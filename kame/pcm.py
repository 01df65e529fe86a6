"""The project's audio formats, in one place: PCM16 bytes, G.711 mu-law and A-law at 8 kHz (the telephone's,
OpenAI Realtime's `audio/pcmu` and `audio/pcma`), and streaming resampling between any two rates (the ASR's
16 kHz, the telephone's 8 kHz, WebRTC's 48 kHz, a client's 16 kHz PCM, the front-end's 24 kHz).

`Resampler` is a polyphase windowed-sinc (Kaiser) low-pass: its state is kept between chunks, so chunk
boundaries leave no trace, and every chunk in gives its exact share out at once (after n input samples,
floor(n * rate_out / rate_in) have come out), with about 1 ms of delay (`delay_s`). soxr's streams, which
this replaced, give their output in blocks (at 48 -> 24 kHz in 20 ms packets: nothing, then two packets'
worth), which is latency a realtime link cannot spend; its "quick" setting streams evenly but has no
anti-aliasing filter. Audio files are decoded and resampled by sphn (`kame.audio.read_audio`). The G.711 codecs follow
ITU-T G.711's segment tables, vectorised (bit-exact with the reference coder: tests/test_telephony.py).
"""

from __future__ import annotations

import math

import numpy as np

from kame.protocol import ProtocolError

TELEPHONE_RATE = 8000
TELEPHONE_BAND_HZ = 3400  # G.711's voice band (300-3400 Hz): the cut-off of the resamplers to and from 8 kHz
TAPS = 32  # of the low-pass, per sample of the lower of the two rates (the higher's, when upsampling)
BETA = 8.0  # Kaiser window: ~80 dB of stopband
CUTOFF = 0.92  # of the lower rate's Nyquist, by default: the low-pass's -6 dB point
_MU_BIAS = 0x84


# ----------------------------------------------------------------------------- PCM16


def pcm16_decode(data: bytes) -> np.ndarray:
    if len(data) % 2:
        raise ProtocolError("PCM16 audio must have an even number of bytes")
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def pcm16_encode(pcm: np.ndarray) -> bytes:
    return (np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


# ----------------------------------------------------------------------------- G.711


def _to_int16(pcm: np.ndarray) -> np.ndarray:
    return (np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0) * 32767.0).astype(np.int32)


def _segment(magnitude: np.ndarray, floor_bits: int) -> np.ndarray:
    """G.711's exponent: the position of the top bit above `floor_bits`, 0-7."""
    with np.errstate(divide="ignore"):
        top = np.floor(np.log2(np.maximum(magnitude, 1))).astype(np.int32)
    return np.clip(top - floor_bits, 0, 7)


def ulaw_encode(pcm: np.ndarray) -> bytes:
    """Float samples in [-1, 1] -> mu-law bytes (G.711 on the 14-bit sample, as the reference coder)."""
    x = _to_int16(pcm) >> 2
    mask = np.where(x < 0, 0x7F, 0xFF)
    magnitude = np.minimum(np.minimum(np.abs(x), 8159) + (_MU_BIAS >> 2), 0x1FFF)  # 0x1FFF: the top code
    exponent = _segment(magnitude, 5)
    mantissa = (magnitude >> (exponent + 1)) & 0x0F
    return (((exponent << 4) | mantissa) ^ mask).astype(np.uint8).tobytes()


def ulaw_decode(data: bytes) -> np.ndarray:
    """mu-law bytes -> float32 samples in [-1, 1]."""
    b = ~np.frombuffer(data, dtype=np.uint8).astype(np.int32) & 0xFF
    exponent, mantissa = (b >> 4) & 0x07, b & 0x0F
    magnitude = (((mantissa << 3) + _MU_BIAS) << exponent) - _MU_BIAS
    return (np.where(b & 0x80, -magnitude, magnitude) / 32768.0).astype(np.float32)


def alaw_encode(pcm: np.ndarray) -> bytes:
    """Float samples in [-1, 1] -> A-law bytes."""
    x = _to_int16(pcm)
    sign = np.where(x >= 0, 0x80, 0x00)
    magnitude = np.minimum(np.where(x >= 0, x, -x - 1), 32767)
    exponent = np.where(magnitude < 256, 0, _segment(magnitude, 7))
    mantissa = np.where(exponent == 0, magnitude >> 4, magnitude >> (exponent + 3)) & 0x0F
    return ((sign | (exponent << 4) | mantissa) ^ 0x55).astype(np.uint8).tobytes()


def alaw_decode(data: bytes) -> np.ndarray:
    """A-law bytes -> float32 samples in [-1, 1]."""
    b = np.frombuffer(data, dtype=np.uint8).astype(np.int32) ^ 0x55
    exponent, mantissa = (b >> 4) & 0x07, b & 0x0F
    magnitude = np.where(exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0))
    return (np.where(b & 0x80, magnitude, -magnitude) / 32768.0).astype(np.float32)


# ----------------------------------------------------------------------------- resampling


class Resampler:
    """`rate_in` -> `rate_out`, streaming (see the module's note); `cutoff_hz`: the low-pass's -6 dB point
    (default: 92 % of the lower rate's Nyquist; the telephone's band to and from 8 kHz); `delay_s`: its group
    delay."""

    def __init__(self, rate_in: int, rate_out: int, cutoff_hz: float | None = None) -> None:
        g = math.gcd(rate_in, rate_out)
        self.up, self.down = rate_out // g, rate_in // g
        span = max(self.up, self.down)
        length = TAPS * span  # at the upsampled rate (rate_in * up)
        n = np.arange(length) - (length - 1) / 2
        if cutoff_hz is None and TELEPHONE_RATE in (rate_in, rate_out):
            cutoff_hz = TELEPHONE_BAND_HZ
        lower = min(rate_in, rate_out)
        fc = (cutoff_hz / lower if cutoff_hz is not None else CUTOFF * 0.5) / span
        h = 2 * fc * np.sinc(2 * fc * n) * np.kaiser(length, BETA) * self.up
        self._k = -(-length // self.up)  # taps per phase
        h = np.pad(h, (0, self._k * self.up - length))
        self._phases = [h[p::self.up].astype(np.float32) for p in range(self.up)]
        # the inputs kept between chunks: a window, and the few an output due next may end before the newest
        self._keep = self._k - 1 + self.down
        self._history = np.zeros(self._keep, np.float32)
        self._in = self._out = 0  # samples in and out so far
        self.delay_s = (length - 1) / 2 / (rate_in * self.up)

    def __call__(self, pcm: np.ndarray) -> np.ndarray:
        pcm = np.asarray(pcm, np.float32).reshape(-1)
        x = np.concatenate([self._history, pcm])
        first = self._in - self._keep  # the input index of x[0]
        self._in += len(pcm)
        due = (self._in * self.up) // self.down
        at = np.arange(self._out, due) * self.down  # each output's place at the upsampled rate
        self._out = due
        newest, phase = at // self.up - first - (self._k - 1), at % self.up  # its newest input, as a 'valid' index
        out = np.empty(len(at), np.float32)
        for p, taps in enumerate(self._phases):
            pick = phase == p
            if pick.any():
                out[pick] = np.convolve(x, taps, mode="valid")[newest[pick]]
        self._history = x[len(x) - self._keep:]
        return out
