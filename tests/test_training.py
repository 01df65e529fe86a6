"""`kame train` from token files (no audio): augmentation, the trainer, eval, export, LoRA, torchrun, resume.

The token files are a copy task written in RUN/tokens's format (kame.training.synthetic): the
assistant says words that only its own dialogue's oracle holds, over random audio codes, so a
front-end that learned to read its oracle scores far better with its own oracle than another's.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from kame.cli import main as kame
from kame.errors import KameError
from kame.frontend.engine import BatchedEngine
from kame.frontend.loader import load_frontend
from kame.frontend.oracle import oracle_stream
from kame.training import augment
from kame.training.augment import OracleEvent
from kame.training.dataset import load_tokens, split
from kame.training.synthetic import shape_of, write_copy_task

ROOT = Path(__file__).resolve().parents[1]
KAME = [sys.executable, "-m", "kame.cli"]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


# ------------------------------------------------------------------ augmentation

EVENTS = [OracleEvent(5, (11, 12), False), OracleEvent(9, (13, 14, 15), True), OracleEvent(30, (16,), False),
          OracleEvent(40, (17, 18), True)]


def test_shift_moves_every_event_and_clamps_at_zero():
    assert [e.frame for e in augment.shift_events(EVENTS, 3)] == [8, 12, 33, 43]
    assert [e.frame for e in augment.shift_events(EVENTS, -7)] == [0, 2, 23, 33]


def test_random_shift_covers_both_ranges_and_never_zero():
    rng = random.Random(0)
    shifts = {augment.random_shift(rng) for _ in range(2000)}
    assert shifts == {*range(-15, 0), *range(1, 11)}


def test_drop_never_drops_the_last_event_of_a_turn():
    rng = random.Random(1)
    for _ in range(200):
        kept = augment.drop_events(EVENTS, 0.99, rng)
        assert [e for e in EVENTS if e.last_of_turn] == [e for e in kept if e.last_of_turn]
    rates = [len(augment.augment_events(EVENTS * 50, random.Random(s))) for s in range(50)]
    assert min(rates) < max(rates)  # the drop probability is drawn per example


def test_augmented_stream_is_seeded_and_built_by_oracle_stream():
    a = augment.augmented_stream(EVENTS, 60, 1000, 3, random.Random(7))
    b = augment.augmented_stream(EVENTS, 60, 1000, 3, random.Random(7))
    assert a == b
    events = augment.augment_events(EVENTS, random.Random(7))
    assert a == oracle_stream([(e.frame, e.tokens) for e in events], 60, 1000, 3)
    assert a != augment.augmented_stream(EVENTS, 60, 1000, 3, random.Random(8))
