"""The test voice (piper): one text always gives the same audio, whatever was said before it.

The speech cache is keyed by text, and the end-to-end tests expect Whisper to hear the same
waveform every run; a voice object kept between sentences broke that once (its noise generator
carries on), and three end-to-end tests failed on a mis-heard question.
"""

from __future__ import annotations

import numpy as np

from kame.audio import read_audio
from kame.testing.speech import synthesize_wav


def test_a_text_sounds_the_same_whatever_came_before(tmp_path):
    text = "What colour is the sky on a clear day?"
    first = read_audio(synthesize_wav(text, tmp_path / "a.wav"), 22050)
    synthesize_wav("Something else entirely, said in between.", tmp_path / "b.wav")
    again = read_audio(synthesize_wav(text, tmp_path / "c.wav"), 22050)
    assert len(first) > 22050 and np.abs(first).max() > 0.05  # speech, not silence
    assert np.array_equal(first, again)


def test_a_text_sounds_the_same_in_every_process(tmp_path):
    """piper's noise is seeded: unseeded, onnxruntime drew a seed per process and a fresh cache (CI's)
    heard another question each run."""
    import subprocess
    import sys

    text = "Tell me a fun fact about the ocean."
    speak = "import sys; from kame.testing.speech import synthesize_wav; synthesize_wav(sys.argv[1], sys.argv[2])"
    for name in ("a.wav", "b.wav"):
        subprocess.run([sys.executable, "-c", speak, text, str(tmp_path / name)], check=True, timeout=120)
    assert (tmp_path / "a.wav").read_bytes() == (tmp_path / "b.wav").read_bytes()
