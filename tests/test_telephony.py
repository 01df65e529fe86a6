"""G.711 against Python's reference coder (audioop, still in 3.11), and the 8 <-> 24 kHz resamplers."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from kame.audio import SAMPLE_RATE
from kame.pcm import TELEPHONE_RATE, Resampler, alaw_decode, alaw_encode, ulaw_decode, ulaw_encode

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop


@pytest.mark.parametrize(("encode", "decode", "ref_encode", "ref_decode"), [
    (ulaw_encode, ulaw_decode, audioop.lin2ulaw, audioop.ulaw2lin),
    (alaw_encode, alaw_decode, audioop.lin2alaw, audioop.alaw2lin),
])
def test_g711_matches_the_reference_coder_bit_for_bit(encode, decode, ref_encode, ref_decode):
    codes = bytes(range(256))
    reference = np.frombuffer(ref_decode(codes, 2), dtype="<i2")
    assert np.array_equal(np.round(decode(codes) * 32768).astype(np.int32), reference)
    for scale in (0.003, 0.2, 2.0):  # quiet, speech-like, clipped
        pcm = np.clip(np.random.default_rng(7).standard_normal(20000) * scale, -1, 1).astype(np.float32)
        assert encode(pcm) == ref_encode((pcm * 32767).astype("<i2").tobytes(), 2)


def test_resampling_keeps_a_tone_and_chunking_leaves_no_trace():
    tone8 = (0.5 * np.sin(2 * np.pi * 440 * np.arange(8000) / 8000)).astype(np.float32)
    whole = Resampler(TELEPHONE_RATE, SAMPLE_RATE)(tone8)
    up = Resampler(TELEPHONE_RATE, SAMPLE_RATE)
    chunked = np.concatenate([up(c) for c in np.array_split(tone8, 37)])
    assert len(whole) == 24000 and np.allclose(whole, chunked, atol=1e-6)
    delay = up.delay_s * SAMPLE_RATE  # the filter's group delay, in 24 kHz samples (47.5)
    expected = 0.5 * np.sin(2 * np.pi * 440 * (np.arange(24000) - delay) / 24000)
    assert np.abs(whole[200:-200] - expected[200:-200]).max() < 0.01

    down = Resampler(SAMPLE_RATE, TELEPHONE_RATE)
    back = np.concatenate([down(c) for c in np.array_split(whole, 53)])
    assert len(back) == 8000 and np.allclose(back, Resampler(SAMPLE_RATE, TELEPHONE_RATE)(whole), atol=1e-6)
    assert abs(np.sqrt(np.mean(back[500:] ** 2)) - 0.5 / np.sqrt(2)) < 0.01  # the tone's level survives


def test_downsampling_removes_what_8_khz_cannot_carry():
    high = np.sin(2 * np.pi * 6000 * np.arange(24000) / 24000).astype(np.float32)
    assert np.abs(Resampler(SAMPLE_RATE, TELEPHONE_RATE)(high)[100:]).max() < 0.01
