"""scripts/full_size_cpu.py, the full-size check `.ci/run` runs after the tests, here at a small size:
the same folders (sparse files in Kyutai's layouts, full-size Mimi), the same loading and engines."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kame.testing import hub_layouts as hub

SCRIPT = Path(__file__).parent.parent / "scripts" / "full_size_cpu.py"


@pytest.fixture(scope="module")
def full_size():
    spec = importlib.util.spec_from_file_location("full_size_cpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_moshi_part_checks_its_outputs(full_size):
    row = full_size.run_part("moshi", 4, {**hub.TINY_LM_CONFIG, "card": 2048})  # Mimi's 2048 codes
    assert row["ok"], row
    assert row["checks"]["oracle fed each frame"] and row["checks"]["audio from frame"] == 1


@pytest.mark.slow
def test_the_stt_part_steps_prefix_audio_and_tail(full_size):
    row = full_size.run_part("stt", 0, {**hub.TINY_STT_LM_CONFIG, "card": 2048})
    assert row["ok"], row
    steps, expected = row["checks"]["steps (expected)"]
    assert steps == expected and row["checks"]["prefix frames"] == 13


def test_random_fill_keeps_norm_scales_at_one(full_size):
    import torch

    layer = torch.nn.Module()
    layer.linear = torch.nn.Linear(64, 32, bias=False)
    layer.alpha = torch.nn.Parameter(torch.zeros(1, 1, 64))
    full_size.fill_random_(layer, 0)
    assert torch.equal(layer.alpha, torch.ones(1, 1, 64))
    std = layer.linear.weight.std().item()
    assert 0.8 / 8 < std < 1.2 / 8  # 1/sqrt(fan_in)
