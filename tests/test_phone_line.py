"""The phone path's audio outside a call (server/phone/line.py), as `kame eval robustness` runs it: the line's
band (8 kHz G.711: a 1 kHz tone passes, a 6 kHz one does not) and the telephone echo canceller, told what
went down the line, taking the echo of it out of what the caller's microphone sent back."""

from __future__ import annotations

import numpy as np

from client.eval_cli import _factory
from kame.audio import SAMPLE_RATE
from kame.frontend.engine import FRAME_SIZE
from server.phone.line import PhoneLine

SILENCE = np.zeros(FRAME_SIZE, np.float32)


def through(line: PhoneLine, mic: np.ndarray, played: np.ndarray | None = None) -> np.ndarray:
    played = np.zeros_like(mic) if played is None else played
    frames = len(mic) // FRAME_SIZE
    out = [line.process_input(mic[i * FRAME_SIZE:(i + 1) * FRAME_SIZE], played[i * FRAME_SIZE:(i + 1) * FRAME_SIZE])
           for i in range(frames)]
    assert {len(frame) for frame in out} == {FRAME_SIZE}  # a frame in, a frame out
    return np.concatenate(out)


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


def test_the_line_passes_the_phone_band_and_nothing_above_it():
    t = np.arange(FRAME_SIZE * 20) / SAMPLE_RATE
    for hz, kept in ((1000, (0.8, 1.1)), (6000, (0.0, 0.02))):
        tone = (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)
        out = through(PhoneLine(), tone)
        ratio = rms(out[FRAME_SIZE * 3:]) / rms(tone)
        assert kept[0] <= ratio <= kept[1], (hz, ratio)


def test_the_echo_of_what_went_down_the_line_is_taken_out():
    """A speakerphone: the caller's microphone takes back what the line played, 40 ms later at half level."""
    rng = np.random.default_rng(0)
    played = (rng.standard_normal(FRAME_SIZE * 40) * 0.1).astype(np.float32)
    delay = SAMPLE_RATE // 25
    echo = 0.5 * np.concatenate([np.zeros(delay, np.float32), played[:-delay]])
    out = through(PhoneLine(), echo, played)
    settled = slice(FRAME_SIZE * 25, None)  # after 2 s
    assert 20 * np.log10(rms(out[settled]) / rms(echo[settled])) < -20
    # without the reference the same audio is only band-limited (white noise keeps ~55 % of its level in
    # the phone band), not taken out
    plain = through(PhoneLine(), echo)
    assert rms(plain[settled]) > 0.4 * rms(echo[settled])


def test_kame_eval_robustness_takes_it_as_its_input_processor():
    process_input = _factory("server.phone.line:PhoneLine")()
    assert len(process_input(SILENCE, SILENCE)) == FRAME_SIZE
