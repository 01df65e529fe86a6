"""kame/pcm.py's resampler at every pair of rates the project uses: each chunk gives its exact share at once
(what a realtime link needs), chunking leaves no trace, the pass band is kept and what the lower rate cannot
carry is removed, not folded back."""

from __future__ import annotations

import numpy as np
import pytest

from kame.pcm import Resampler

PAIRS = [(24000, 16000), (16000, 24000), (24000, 8000), (8000, 24000), (48000, 24000), (24000, 48000)]


def _tone(rate: int, hz: float, seconds: float = 1.0) -> np.ndarray:
    return np.sin(2 * np.pi * hz * np.arange(int(rate * seconds)) / rate).astype(np.float32)


@pytest.mark.parametrize(("rate_in", "rate_out"), PAIRS)
def test_every_chunk_gives_its_exact_share_and_chunking_leaves_no_trace(rate_in, rate_out):
    x = np.random.default_rng(1).standard_normal(rate_in // 2).astype(np.float32)
    chunked, got, fed = Resampler(rate_in, rate_out), [], 0
    for size in np.random.default_rng(2).integers(1, 700, 200):
        piece = x[fed: fed + size]
        fed += len(piece)
        got.append(chunked(piece))
        assert sum(map(len, got)) == fed * rate_out // rate_in  # nothing held back for a later chunk
    whole = Resampler(rate_in, rate_out)(x)
    assert np.allclose(np.concatenate(got), whole, atol=1e-5)


@pytest.mark.parametrize(("rate_in", "rate_out"), PAIRS)
def test_the_pass_band_is_kept_and_what_the_lower_rate_cannot_carry_is_gone(rate_in, rate_out):
    low = min(rate_in, rate_out)
    resampler = Resampler(rate_in, rate_out)
    delay = round(resampler.delay_s * rate_out)
    for hz in (0.1 * low, 0.3 * low):  # speech's band, up to 60 % of the lower rate's Nyquist (the telephone's 2.4 kHz)
        out = Resampler(rate_in, rate_out)(_tone(rate_in, hz))[delay + 50: -50]
        expected = np.sin(2 * np.pi * hz * (np.arange(len(out)) + delay + 50 - resampler.delay_s * rate_out) / rate_out)
        assert np.abs(out - expected).max() < 0.02, hz
    if rate_out < rate_in:  # above the output's Nyquist: removed (Kaiser window: ~80 dB)
        out = Resampler(rate_in, rate_out)(_tone(rate_in, 0.6 * rate_in / 2 + 0.25 * rate_out))[delay + 50:]
        assert np.abs(out).max() < 1e-3
    assert 0 < resampler.delay_s < 0.0025
