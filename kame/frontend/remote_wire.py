"""The wire between the engine host (kame/frontend/engine_host.py) and its fronts (kame/frontend/remote.py):
the pickled messages each side sends, and what a side may drop when its peer stops reading."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kame.frontend.oracle import OracleUpdate
from kame.frontend.runner import RunnerStats
from kame.frontend.sampling import Sampling

STATUS_S = 0.5  # how often the host tells every front its runners' free slots and counters
# messages either side may queue for a peer that does not read (a few seconds of 128 sessions' pushes, or 20 s
# of steps' outputs); beyond it the oldest frames or outputs are dropped, never a request or a reply
MAX_QUEUED = 4096


# ---------------------------------------------------------------- messages (front -> host)


@dataclass(frozen=True)
class Acquire:
    request: int
    runner: str
    live: bool
    sampling: Sampling | None


@dataclass(frozen=True)
class Pushes:
    """What one front's sessions pushed since its last send, in order: (slot, generation, frame) and
    (slot, generation, oracle update)."""

    runner: str
    frames: list[tuple[int, int, np.ndarray]]
    oracles: list[tuple[int, int, OracleUpdate]]


@dataclass(frozen=True)
class Release:
    request: int
    runner: str
    slot: int
    generation: int


# ---------------------------------------------------------------- messages (host -> front)


@dataclass(frozen=True)
class HostInfo:
    """Sent first, on each connection: what the host serves (`extra`: what its builder adds for the fronts,
    e.g. the front-end's source and tokenizer)."""

    runners: dict[str, int]  # name -> slots
    sampling: dict[str, Sampling | None]  # name -> a session's default sampling (None: the runner has none)
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Acquired:
    request: int
    slot: int
    generation: int


@dataclass(frozen=True)
class Refused:
    request: int
    busy: bool  # all slots taken (else the engine failed)
    message: str


@dataclass(frozen=True)
class Released:
    request: int


@dataclass(frozen=True)
class Outputs:
    """One step's outputs for one front's sessions: (generation, output, the slot's dropped frames)."""

    runner: str
    items: list[tuple[int, object, int]]


@dataclass(frozen=True)
class SlotFailed:
    runner: str
    slot: int
    generation: int
    message: str


@dataclass(frozen=True)
class Status:
    """Each runner's free slots and counters, and the steps (seconds, batch) since the last status."""

    free_slots: dict[str, int]
    stats: dict[str, RunnerStats]
    steps: dict[str, list[tuple[float, int]]]


def drop_oldest(queue: deque, kind: type) -> None:
    """Remove the oldest item of `kind` (outputs, or pushed frames and updates): what a stalled peer can lose."""
    for index, item in enumerate(queue):
        if isinstance(item, kind):
            del queue[index]
            return
