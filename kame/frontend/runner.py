"""Puts a `BatchedEngine` on its own thread so that asyncio code can drive it without blocking.

Sessions push PCM frames and oracle updates into thread-safe inboxes; the engine thread waits
until every active slot has a frame (or `batch_window_s` after the first one arrived), steps all
slots that have one in a single batched call, and hands each output to its slot's callback.
Slot acquire/release run on the engine thread between steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kame.errors import EngineError
from kame.frontend.engine import FRAME_SIZE, BatchedEngine, FrameOutput
from kame.frontend.oracle import OracleUpdate

logger = logging.getLogger(__name__)

OutputCallback = Callable[[FrameOutput], None]
ErrorCallback = Callable[[BaseException], None]


@dataclass
class _SlotInbox:
    on_output: OutputCallback
    on_error: ErrorCallback | None
    frames: deque[np.ndarray] = field(default_factory=deque)
    updates: list[OracleUpdate] = field(default_factory=list)
    dropped_frames: int = 0


class SlotHandle:
    """A session's hold on one engine slot. Thread-safe; `push_*` never block."""

    def __init__(self, runner: EngineRunner, slot: int) -> None:
        self.runner, self.slot = runner, slot
        self.closed = False

    def push_frame(self, pcm: np.ndarray) -> None:
        """Queue one frame of FRAME_SIZE samples; a wrong shape is refused here, not in the batch."""
        frame = np.asarray(pcm, dtype=np.float32)
        if frame.shape != (FRAME_SIZE,):
            raise EngineError(f"a frame must be {FRAME_SIZE} samples, got shape {frame.shape}")
        if not np.isfinite(frame).all():
            raise EngineError("a frame holds NaN or infinite samples")
        self.runner._push_frame(self.slot, frame)

    def push_oracle(self, update: OracleUpdate) -> None:
        self.runner._push_oracle(self.slot, update)

    @property
    def dropped_frames(self) -> int:
        return self.runner._dropped(self.slot)

    def release(self) -> None:
        if not self.closed:
            self.closed = True
            self.runner._release(self.slot)


class EngineRunner:
    """Owns the engine thread. Use as a context manager or call `start()` / `stop()`."""

    def __init__(self, engine: BatchedEngine, batch_window_s: float = 0.02, max_pending_frames: int = 25,
                 on_step: Callable[[float, int], None] | None = None, torch_threads: int | None = None) -> None:
        self.engine = engine
        # intra-op threads of the engine thread; on a CPU, OpenMP teams started from a non-main
        # thread cost more than they give for small models (docs/benchmarks.md): 1 is best there
        self.torch_threads = torch_threads
        self.on_step = on_step  # (seconds, batch size) after each step, on the engine thread
        self.batch_window_s = batch_window_s  # how long a ready slot waits for the others
        self.max_pending_frames = max_pending_frames  # per slot; beyond it the oldest frame is dropped
        self._cond = threading.Condition()
        self._inboxes: dict[int, _SlotInbox] = {}
        self._commands: deque[tuple[Callable[[], object], concurrent.futures.Future]] = deque()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = 0
        self.step_seconds: deque[float] = deque(maxlen=1000)  # recent step durations

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> EngineRunner:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kame-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> EngineRunner:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- slots

    def acquire(self, on_output: OutputCallback, on_error: ErrorCallback | None = None,
                timeout: float | None = 30.0) -> SlotHandle:
        """Reserve and reset a slot (blocking until the engine thread has done it)."""
        return SlotHandle(self, self._call(self._acquire_fn(on_output, on_error)).result(timeout))

    async def acquire_async(self, on_output: OutputCallback, on_error: ErrorCallback | None = None) -> SlotHandle:
        future = self._call(self._acquire_fn(on_output, on_error))
        return SlotHandle(self, await asyncio.wrap_future(future))

    def _acquire_fn(self, on_output: OutputCallback, on_error: ErrorCallback | None) -> Callable[[], int]:
        def _acquire() -> int:
            slot = self.engine.acquire()
            self._inboxes[slot] = _SlotInbox(on_output, on_error)
            return slot
        return _acquire

    @property
    def free_slots(self) -> int:
        return self.engine.free_slots

    def _release(self, slot: int) -> None:
        def _do() -> None:
            self._inboxes.pop(slot, None)
            self.engine.release(slot)
        self._call(_do)

    def _call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping or self._thread is None:
                future.set_exception(EngineError("the engine runner is not running"))
                return future
            self._commands.append((fn, future))
            self._cond.notify_all()
        return future

    def _push_frame(self, slot: int, pcm: np.ndarray) -> None:
        with self._cond:
            inbox = self._inboxes.get(slot)
            if inbox is None:
                return  # released meanwhile: the frame belongs to nobody
            inbox.frames.append(pcm)
            if len(inbox.frames) > self.max_pending_frames:
                inbox.frames.popleft()
                inbox.dropped_frames += 1
            self._cond.notify_all()

    def _push_oracle(self, slot: int, update: OracleUpdate) -> None:
        with self._cond:
            inbox = self._inboxes.get(slot)
            if inbox is not None:
                inbox.updates.append(update)  # never dropped: resets must reach the slot

    def _dropped(self, slot: int) -> int:
        with self._cond:
            inbox = self._inboxes.get(slot)
            return inbox.dropped_frames if inbox else 0

    # ---------------------------------------------------------------- engine thread

    def _loop(self) -> None:
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        while True:
            commands, batch = self._next_work()
            if commands is None:
                return
            for fn, future in commands:
                self._run_command(fn, future)
            if batch:
                self._step(batch)

    def _next_work(self):
        with self._cond:
            while not (self._stopping or self._commands or self._any_frame()):
                self._cond.wait()
            if self._stopping:
                return None, None
            commands = list(self._commands)
            self._commands.clear()
            if commands:
                return commands, {}
            deadline = time.monotonic() + self.batch_window_s
            while not self._all_frames() and not self._commands and not self._stopping:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return [], self._take_batch()

    def _any_frame(self) -> bool:
        return any(inbox.frames for inbox in self._inboxes.values())

    def _all_frames(self) -> bool:
        return all(inbox.frames for inbox in self._inboxes.values())

    def _take_batch(self) -> dict[int, tuple[np.ndarray, list[OracleUpdate], _SlotInbox]]:
        batch = {}
        for slot, inbox in self._inboxes.items():
            if inbox.frames:
                updates, inbox.updates = inbox.updates, []
                batch[slot] = (inbox.frames.popleft(), updates, inbox)
        return batch

    def _reset_quietly(self, slot: int) -> None:
        try:
            self.engine.reset_slot(slot)
        except Exception:
            logger.exception("could not reset slot %d after a failed step", slot)

    @staticmethod
    def _run_command(fn: Callable[[], object], future: concurrent.futures.Future) -> None:
        try:
            future.set_result(fn())
        except Exception as exc:  # reported to the caller through its future
            future.set_exception(exc)

    def _step(self, batch) -> None:
        for slot, (_, updates, _) in batch.items():
            for update in updates:
                self.engine.push_oracle(slot, update)
        started = time.perf_counter()
        try:
            outputs = self.engine.step({slot: frame for slot, (frame, _, _) in batch.items()})
        except Exception as exc:  # contained: those slots are reset and told; the thread goes on
            logger.exception("engine step failed for slots %s", sorted(batch))
            for slot, (_, _, inbox) in batch.items():
                self._reset_quietly(slot)
                if inbox.on_error is not None:
                    inbox.on_error(exc)
            return
        elapsed = time.perf_counter() - started
        self.step_seconds.append(elapsed)
        self.steps += 1
        if self.on_step is not None:
            self.on_step(elapsed, len(batch))
        for output in outputs:
            try:
                batch[output.slot][2].on_output(output)
            except Exception:  # a broken consumer must not stop the engine for the others
                logger.exception("output callback of slot %d failed", output.slot)
