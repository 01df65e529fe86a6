"""What one Opus packet costs the WebRTC paths, side by side in one run: libopus called directly
(`kame.opus`) against the same library through PyAV (FFmpeg's wrapper), decoding a peer's 20 and 40 ms
packets to 24 kHz mono and encoding the assistant's 40 ms at 24 kHz, across libopus's complexities;
what a lower complexity costs in quality, as the log-spectral distance of speech through the codec
from the speech itself (0.1-3.8 kHz, the band flite's 8 kHz voice fills); and whether speech after
digital silence decodes as well when the silence went out as empty frames, not encoded
(server/live/assistant_track.py `_quiet_after_silence`).

    python scripts/bench_opus.py [--wav SPEECH.wav] [--seconds 10]

Without --wav the speech is flite's (Debian's `flite`), else a synthetic vowel sequence."""

from __future__ import annotations

import argparse
import fractions
import shutil
import subprocess
import tempfile
import time

import av
import numpy as np
import soundfile as sf

from kame import opus
from kame.pcm import Resampler

RATE = 24000
SENTENCE = ("Hi, I am planning a trip to Japan next spring, and I would love to see some old temples "
            "and eat good food. What would you suggest for a first week?")


def speech(wav: str | None) -> np.ndarray:
    if wav is None and shutil.which("flite"):
        with tempfile.NamedTemporaryFile(suffix=".wav") as out:
            subprocess.run(["flite", "-t", SENTENCE, "-o", out.name], check=True)
            pcm, rate = sf.read(out.name, dtype="float32")
    elif wav is not None:
        pcm, rate = sf.read(wav, dtype="float32", always_2d=True)
        pcm = pcm.mean(axis=1)
    else:  # a vowel-like buzz, gliding
        t = np.arange(RATE * 6) / RATE
        f0 = 120 + 30 * np.sin(2 * np.pi * 0.5 * t)
        pcm = sum(np.sin(2 * np.pi * k * np.cumsum(f0) / RATE) / k for k in range(1, 20)).astype(np.float32) * 0.1
        rate = RATE
    return Resampler(rate, RATE)(pcm) if rate != RATE else pcm


def per_packet_us(fn, items) -> float:
    start = time.perf_counter()
    for item in items:
        fn(item)
    return (time.perf_counter() - start) / len(items) * 1e6


def pyav_encoder(complexity: int, samples: int):
    codec = av.CodecContext.create("libopus", "w")
    codec.sample_rate, codec.layout, codec.format, codec.bit_rate = RATE, "mono", "s16", 48000
    codec.time_base = fractions.Fraction(1, RATE)
    codec.options = {"application": "voip", "frame_duration": str(samples * 1000 // RATE),
                     "compression_level": str(complexity)}

    def encode(pcm: np.ndarray) -> bytes:
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = RATE
        return bytes(codec.encode(frame)[0])

    return encode


def pyav_decoder():
    """As kame.rtc's fallback: 48 kHz stereo (FFmpeg's only rate), downmixed, halved."""
    codec = av.CodecContext.create("libopus", "r")
    codec.format, codec.layout, codec.sample_rate = "s16", "stereo", 48000
    halve = Resampler(48000, RATE)

    def decode(payload: bytes) -> np.ndarray:
        pcm = [f.to_ndarray().reshape(-1, 2).mean(axis=1, dtype=np.float32) / 32768.0
               for f in codec.decode(av.Packet(payload))]
        return halve(np.concatenate(pcm))

    return decode


def distance_db(reference: np.ndarray, coded: np.ndarray) -> float:
    """Log-spectral distance (dB) over 20 ms windows of the loud part, after the codec's delay."""
    n = min(len(reference), len(coded))
    lag = min(range(400), key=lambda k: float(np.sum((reference[:n - k] - coded[k:n]) ** 2)))
    a, b = reference[:n - lag], coded[lag:n]

    def spectrum(x: np.ndarray) -> np.ndarray:
        windows = x[:len(x) // 480 * 480].reshape(-1, 480) * np.hanning(480)
        return 20 * np.log10(np.abs(np.fft.rfft(windows))[:, 2:76] + 1e-4)

    sa, sb = spectrum(a), spectrum(b)
    loud = sa.max(axis=1) > sa.max() - 40
    return float(np.sqrt(((sa[loud] - sb[loud]) ** 2).mean(axis=1)).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wav")
    parser.add_argument("--seconds", type=float, default=10.0, help="audio coded per measurement")
    args = parser.parse_args()
    if opus.library() is None:
        raise SystemExit("no libopus to call directly (kame.opus.library() is None)")
    voice = speech(args.wav)
    voice = np.tile(voice, int(np.ceil(args.seconds * RATE / len(voice))))[:int(args.seconds * RATE)]
    pcm16 = (np.clip(voice, -1, 1) * 32767).astype(np.int16)

    print("| encode 40 ms at 24 kHz | complexity | us a packet | cores a stream | distance dB |")
    print("|---|---:|---:|---:|---:|")
    chunks = [pcm16[i:i + 960] for i in range(0, len(pcm16) - 959, 960)]
    for complexity in (10, 8, 6, 5, 3, 0):
        for name, make in (("libopus", lambda c: opus.Encoder(RATE, 48000, c).encode),
                           ("PyAV", lambda c: pyav_encoder(c, 960))):
            if name == "PyAV" and complexity not in (10, 5):
                continue
            encode = make(complexity)
            us = per_packet_us(encode, chunks)
            decoder = opus.Decoder(RATE)
            coded = np.concatenate([decoder.decode(p) for p in map(make(complexity), chunks)])
            print(f"| {name} | {complexity} | {us:.0f} | {us * 25 / 1e6:.4f} | {distance_db(voice, coded):.2f} |")

    print("\n| decode a peer's packet to 24 kHz mono | packet ms | us a packet | cores a stream |")
    print("|---|---:|---:|---:|")
    for ms in (20, 40):
        encode = opus.Encoder(RATE, 48000, 10).encode
        size = RATE * ms // 1000
        packets = [encode(pcm16[i:i + size]) for i in range(0, len(pcm16) - size + 1, size)]
        for name, decode in (("libopus", opus.Decoder(RATE).decode), ("PyAV, halved", pyav_decoder())):
            us = per_packet_us(decode, packets)
            print(f"| {name} | {ms} | {us:.0f} | {us * 1000 / ms / 1e6:.4f} |")
    resume(voice)


def resume(voice: np.ndarray) -> None:
    """Speech, 2 s of zeros, the speech again: encoded throughout, or the zeros past the first packet as
    empty frames; the distance of each decode from the source, over the second speech and its first 100 ms."""
    from server.live.assistant_track import _quiet_after_silence

    speech16 = (np.clip(voice[:2 * RATE], -1, 1) * 32767).astype(np.int16)
    signal = np.concatenate([speech16, np.zeros(2 * RATE, np.int16), speech16])
    source, again = signal.astype(np.float32) / 32767, 4 * RATE
    print("\n| the silence before the second speech | its packets' bytes | distance dB, the speech after "
          "| its first 100 ms |")
    print("|---|---:|---:|---:|")
    for name, wrap in (("encoded", lambda f: f), ("empty frames past the first packet", _quiet_after_silence)):
        encoder = opus.Encoder(RATE, 48000, 5)
        encode = wrap(lambda pcm, encoder=encoder: av.Packet(encoder.encode(pcm)))
        packets = [bytes(encode(signal[i:i + 960])) for i in range(0, len(signal), 960)]
        decoder = opus.Decoder(RATE)
        coded = np.concatenate([decoder.decode(p) for p in packets])
        silence_bytes = sum(map(len, packets[50:100]))
        print(f"| {name} | {silence_bytes} | {distance_db(source[again:], coded[again:]):.2f} | "
              f"{distance_db(source[again:again + 2400], coded[again:again + 2400]):.2f} |")


if __name__ == "__main__":
    main()
