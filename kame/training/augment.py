"""Oracle augmentation for training: jitter the timing of a dialogue's oracle and drop some of it.

At inference the oracle arrives late or early and some updates never come; training on a
perturbed oracle teaches the front-end to follow it without trusting every token's frame.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kame.frontend.oracle import oracle_stream

MAX_SHIFT_RIGHT = 10  # frames the whole event list may move later
MAX_SHIFT_LEFT = 15  # frames it may move earlier (clamped at frame 0)
DROP_RANGE = (0.1, 0.7)  # the per-example drop probability is drawn uniformly from this range


@dataclass(frozen=True)
class OracleEvent:
    """One oracle reset of a dialogue, as stored in its token file."""

    frame: int
    tokens: tuple[int, ...]  # after the start token
    last_of_turn: bool  # the last oracle before the assistant's turn ends: never dropped


def shift_events(events: list[OracleEvent], shift: int) -> list[OracleEvent]:
    """Every event moved by `shift` frames (negative: earlier), none before frame 0."""
    return [OracleEvent(max(0, e.frame + shift), e.tokens, e.last_of_turn) for e in events]


def drop_events(events: list[OracleEvent], probability: float, rng: random.Random) -> list[OracleEvent]:
    """Each event dropped with `probability`, except the last one of each turn."""
    return [e for e in events if e.last_of_turn or rng.random() >= probability]


def random_shift(rng: random.Random) -> int:
    """A shift of 1..MAX_SHIFT_RIGHT frames later or 1..MAX_SHIFT_LEFT earlier, each value equally likely."""
    choices = [*range(-MAX_SHIFT_LEFT, 0), *range(1, MAX_SHIFT_RIGHT + 1)]
    return rng.choice(choices)


def augment_events(events: list[OracleEvent], rng: random.Random) -> list[OracleEvent]:
    """One training example's oracle: the whole list shifted, then some events dropped."""
    shifted = shift_events(events, random_shift(rng))
    return drop_events(shifted, rng.uniform(*DROP_RANGE), rng)


def stream_of(events: list[OracleEvent], frames: int, start_token: int, padding_token: int) -> list[int]:
    """The oracle token of every frame, through the engine's own timeline (`oracle_stream`)."""
    return oracle_stream([(e.frame, e.tokens) for e in events], frames, start_token, padding_token)


def augmented_stream(events: list[OracleEvent], frames: int, start_token: int, padding_token: int,
                     rng: random.Random) -> list[int]:
    """The oracle stream of one augmented example."""
    return stream_of(augment_events(events, rng), frames, start_token, padding_token)
