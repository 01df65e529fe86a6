"""A front-end directory whose random Mimi tells sounds apart, for tests of the audio path.

The random presets' Mimi keeps moshi's all-zero codebooks, so every sound encodes to code 0. That
is on purpose: a random encoder's codes would be a hash of the sound, with nothing a model could
generalise from, and the tiny model learns its training dialogues by heart from them instead of
reading its oracle (docs/training.md). A test that must see each channel's audio in the codes (a
swapped channel, say) takes this directory instead.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from moshi.models.compression import MimiModel

from kame.frontend.loader import load_frontend
from kame.frontend.presets import TINY_COPY_DIR
from kame.training.export import MIMI_NAME, save_mimi

CALIBRATION_FRAMES = 150  # 12 s of sound: more vectors than the tiny Mimi's 64 codebook entries


def calibrate_codebooks(mimi: MimiModel, seed: int = 0) -> None:
    """Start a Mimi's codebooks as its own training does: k-means on the encoder's latents, here of
    a seeded sound (noise and tones of random loudness), one residual level per pass."""
    gen = torch.Generator().manual_seed(seed)
    frame = int(mimi.sample_rate / mimi.frame_rate)
    n = CALIBRATION_FRAMES * frame
    loudness = torch.rand(CALIBRATION_FRAMES, generator=gen).repeat_interleave(frame) ** 2
    pitch = (100 + 900 * torch.rand(CALIBRATION_FRAMES, generator=gen)).repeat_interleave(frame)
    tone = torch.sin(2 * torch.pi * pitch * torch.arange(n) / mimi.sample_rate)
    sound = 0.3 * loudness * (0.5 * torch.randn(n, generator=gen) + tone)
    active = mimi.num_codebooks
    mimi.set_num_codebooks(mimi.total_codebooks)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)  # k-means draws its first centroids from the global generator
            latent = mimi.encode_to_latent(sound.to(next(mimi.parameters()))[None, None], quantize=False)
            mimi.quantizer.train()
            for _ in range(mimi.total_codebooks):  # a level starts once the one before it has
                mimi.quantizer(latent, int(mimi.frame_rate))
    finally:
        mimi.quantizer.eval()
        mimi.set_num_codebooks(active)


def tiny_with_calibrated_mimi(out: Path) -> Path:
    """A copy of the `tiny-copy` directory (the `tiny` LM shapes) whose Mimi is calibrated."""
    shutil.copytree(TINY_COPY_DIR, out)
    frontend = load_frontend(str(out), "cpu")
    calibrate_codebooks(frontend.mimi)
    save_mimi(frontend.mimi, out / MIMI_NAME)
    return out
