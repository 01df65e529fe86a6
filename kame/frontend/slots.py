"""One acquisition of an engine slot: its inbox (what its handle pushed, read by the step policy and
taken by the engine thread) and the handle a session holds.

The handle reaches its runner only through `SlotOwner`, the four calls a handle needs, so the runner's
locking and bookkeeping stay its own and a handle can be driven by a fake owner in tests.
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np

from kame.errors import EngineError
from kame.frontend.engine import FRAME_SIZE, FrameOutput
from kame.frontend.oracle import OracleUpdate

OutputCallback = Callable[[FrameOutput], None]
ErrorCallback = Callable[[BaseException], None]


class Stamped(NamedTuple):
    generation: int  # of the acquisition whose handle pushed it
    value: object  # an np.ndarray frame or an OracleUpdate


@dataclass
class SlotInbox:
    """One acquisition of a slot: its callbacks and what its handle pushed."""

    generation: int
    on_output: OutputCallback
    on_error: ErrorCallback | None
    live: bool = True  # False: the client paces itself (faster than real time): never skip to live
    frames: deque[Stamped] = field(default_factory=deque)
    last_arrival: float | None = None  # time of the latest frame pushed (the runner's time source)
    phase: complex = 0j  # average of exp(2 pi i t / frame_s) over its arrivals t: where in the period they come
    updates: list[Stamped] = field(default_factory=list)
    dropped_frames: int = 0  # over max_pending_frames at push time, or skipped to live


def checked_frame(pcm: np.ndarray) -> np.ndarray:
    """One frame as the engine takes it (float32, FRAME_SIZE finite samples), or EngineError: a bad frame
    is refused where it is pushed, never in the batch."""
    frame = np.asarray(pcm, dtype=np.float32)
    if frame.shape != (FRAME_SIZE,):
        raise EngineError(f"a frame must be {FRAME_SIZE} samples, got shape {frame.shape}")
    if not np.isfinite(frame).all():
        raise EngineError("a frame holds NaN or infinite samples")
    return frame


def release_if_acquired(future: concurrent.futures.Future) -> None:
    """A done callback for an acquisition nobody waits for any more: its slot goes back."""
    if not future.cancelled() and future.exception() is None:
        future.result().release()


class SlotOwner(Protocol):
    """What a `SlotHandle` asks of the runner that made it (`EngineRunner`): each call is thread-safe,
    and a frame or update of a generation that no longer holds the slot is dropped and counted there."""

    def accept_frame(self, slot: int, frame: Stamped) -> None: ...

    def accept_oracle(self, slot: int, update: Stamped) -> None: ...

    def count_stale(self) -> None: ...

    def release_slot(self, slot: int, generation: int) -> concurrent.futures.Future: ...


class SlotHandle:
    """A session's hold on one engine slot, for one acquisition. Thread-safe; `push_*` never block.

    Once released, pushes are refused silently (counted in the runner's `stats.stale_dropped`): a late
    LLM answer must not crash anything.
    """

    def __init__(self, runner: SlotOwner, slot: int, inbox: SlotInbox) -> None:
        self.runner, self.slot = runner, slot
        self._inbox = inbox
        self.closed = False
        self._released: concurrent.futures.Future | None = None

    @property
    def generation(self) -> int:
        return self._inbox.generation

    def push_frame(self, pcm: np.ndarray) -> None:
        """Queue one frame of FRAME_SIZE samples; a wrong shape is refused here, not in the batch."""
        if self.closed:
            self.runner.count_stale()
            return
        self.runner.accept_frame(self.slot, Stamped(self.generation, checked_frame(pcm)))

    def push_oracle(self, update: OracleUpdate) -> None:
        if self.closed:
            self.runner.count_stale()
            return
        self.runner.accept_oracle(self.slot, Stamped(self.generation, update))

    @property
    def dropped_frames(self) -> int:
        """Frames of this acquisition that were never stepped (queue cap or skip to live)."""
        return self._inbox.dropped_frames

    def release(self) -> concurrent.futures.Future:
        """Give the slot back; the future is done once the engine thread has freed it."""
        if not self.closed:
            self.closed = True
            self._released = self.runner.release_slot(self.slot, self.generation)
        return self._released
