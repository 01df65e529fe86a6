"""Shared fixtures: tiny front-ends loaded once per test session, on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

from kame.frontend.loader import Frontend, load_frontend


@pytest.fixture(scope="session")
def tiny() -> Frontend:
    return load_frontend("tiny", "cpu")


@pytest.fixture(scope="session")
def tiny_copy() -> Frontend:
    return load_frontend("tiny-copy", "cpu")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def noise_frames(rng: np.random.Generator, count: int, scale: float = 0.1) -> list[np.ndarray]:
    return [(rng.standard_normal(1920) * scale).astype(np.float32) for _ in range(count)]
