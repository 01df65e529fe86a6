"""A phone line's audio to and from the front-end's 24 kHz: G.711 (mu-law, A-law) at 8 kHz, G.722 at 16 kHz
(a SIP call's wideband codec, through PyAV), or 16-bit PCM at the carrier's rate (Vonage's 16 kHz, Exotel's
8 kHz), through the project's streaming resampler. The front-end and the ASR hear the line's band, upsampled;
nothing is made up above it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kame.audio import SAMPLE_RATE
from kame.pcm import Resampler, alaw_decode, alaw_encode, pcm16_decode, pcm16_encode, ulaw_decode, ulaw_encode
from server.phone.streams import Encoding

_CODECS = {"audio/pcmu": (ulaw_decode, ulaw_encode, 1), "audio/pcma": (alaw_decode, alaw_encode, 1),
           "audio/pcm": (pcm16_decode, pcm16_encode, 2)}


G722_RATE = 16000  # G.722 samples at 16 kHz (its RTP clock says 8000: RFC 3551), 64 kbit/s
G722_FRAME = 320  # samples PyAV's G.722 encoder takes at a time (20 ms)


def bytes_per_second(encoding: Encoding, rate: int) -> int:
    if encoding == "audio/g722":
        return 8000
    return rate * _CODECS[encoding][2]


def g722_available() -> bool:
    try:
        import av

        av.codec.Codec("g722", "w")
    except Exception:  # PyAV missing (it comes with the webrtc extra), or built without the codec
        return False
    return True


def _g722_decoder() -> Callable[[bytes], np.ndarray]:
    import av

    context = av.CodecContext.create("g722", "r")
    context.sample_rate, context.layout = G722_RATE, "mono"

    def decode(data: bytes) -> np.ndarray:
        frames = context.decode(av.Packet(data))
        if not frames:
            return np.zeros(0, np.float32)
        return np.concatenate([frame.to_ndarray().reshape(-1) for frame in frames]).astype(np.float32) / 32768
    return decode


def _g722_encoder() -> Callable[[np.ndarray], bytes]:
    import av

    context = av.CodecContext.create("g722", "w")
    context.sample_rate, context.layout, context.format = G722_RATE, "mono", "s16"
    pending, pts = np.zeros(0, "<i2"), 0

    def encode(pcm: np.ndarray) -> bytes:
        nonlocal pending, pts
        samples = np.concatenate([pending, (np.clip(pcm, -1, 1) * 32767).astype("<i2")])
        whole = len(samples) - len(samples) % G722_FRAME
        pending = samples[whole:]
        if not whole:
            return b""
        frame = av.AudioFrame.from_ndarray(samples[:whole].reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts = G722_RATE, pts
        pts += whole
        return b"".join(bytes(packet) for packet in context.encode(frame))
    return encode


def g722_silence(packet_bytes: int = 160) -> bytes:
    """A packet of G.722's silence (what concealment plays after a loss): zeros, encoded."""
    return _g722_encoder()(np.zeros(packet_bytes * 2, np.float32))


def decoder(encoding: Encoding, rate: int) -> Callable[[bytes], np.ndarray]:
    """The line's bytes -> float32 at 24 kHz (the resampler's state carried from chunk to chunk)."""
    if encoding == "audio/g722":
        decode, rate = _g722_decoder(), G722_RATE
    else:
        decode = _CODECS[encoding][0]
    if rate == SAMPLE_RATE:
        return decode
    upsample = Resampler(rate, SAMPLE_RATE)
    return lambda data: upsample(decode(data))


def encoder(encoding: Encoding, rate: int) -> Callable[[np.ndarray], bytes]:
    """float32 at 24 kHz -> the line's bytes."""
    if encoding == "audio/g722":
        encode, rate = _g722_encoder(), G722_RATE
    else:
        encode = _CODECS[encoding][1]
    if rate == SAMPLE_RATE:
        return encode
    downsample = Resampler(SAMPLE_RATE, rate)
    return lambda pcm: encode(downsample(pcm))
