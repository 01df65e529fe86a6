"""Puts a `BatchedEngine` on its own thread, driven by a frame clock, so asyncio code never blocks on it.

Sessions push PCM frames and oracle updates into thread-safe inboxes, stamped with the generation of
their slot acquisition: anything of another generation is dropped, so nothing of a slot's previous
occupant reaches the next. A batched step costs the whole batch however many slots it steps.

`clock="tick"`: the engine thread steps once per `frame_s` for every slot that has a frame, at the
phase of the frame period that keeps the sessions' mean wait shortest (their arrivals' phases are
learnt, `TickSchedule`), at once when every sending slot has its frame, and at once when a live slot
holds two frames or more (it is behind: after a stall, extra steps, batched across slots, catch every
slot up, its audio kept). `clock="eager"`: step as soon as a frame arrives, waiting at most
`batch_window_s` for the other sending slots. With either, a live slot holding more than
`jitter_frames` at a step drops its oldest frames down to that (skip to live: only when the
engine cannot keep up), a step longer than a frame is counted as an overrun, and the thread
sleeps while no slot has a frame. A slot acquired with `live=False` (a client that sends
faster than real time on purpose) never skips and never triggers a catch-up: alone, it is stepped
as fast as the engine goes. Slot acquire/release run on the engine thread between steps.
"""

from __future__ import annotations

import asyncio
import cmath
import concurrent.futures
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
import torch

from kame.audio import FRAME_S
from kame.errors import EngineError
from kame.frontend.engine import FRAME_SIZE, BatchedEngine, FrameOutput
from kame.frontend.oracle import OracleUpdate
from kame.frontend.sampling import Sampling

logger = logging.getLogger(__name__)

OutputCallback = Callable[[FrameOutput], None]
ErrorCallback = Callable[[BaseException], None]
Clock = Literal["tick", "eager"]
OVERRUN_LOG_INTERVAL_S = 60.0  # an overloaded engine warns at most this often
SENDING_FRAMES = 2  # a slot that pushed a frame within this many frame periods is sending
PHASE_WEIGHT = 0.2  # how much each arrival moves a slot's learnt phase (an exponential average)
PHASE_STEADY = 0.5  # a slot's phase counts once its average is this consistent (1: every arrival alike)


@dataclass
class RunnerStats:
    """Counters of an `EngineRunner`; plain ints, readable from any thread."""

    steps: int = 0  # batched engine steps
    frames_stepped: int = 0  # slot frames in those steps (frames_stepped / steps: the mean batch)
    stale_dropped: int = 0  # frames and oracle updates of a finished acquisition, never applied
    skipped_frames: int = 0  # frames dropped to bring a live slot back to live (over jitter_frames)
    overruns: int = 0  # steps that took longer than a frame


class _Stamped(NamedTuple):
    generation: int  # of the acquisition whose handle pushed it
    value: object  # an np.ndarray frame or an OracleUpdate


@dataclass
class _SlotInbox:
    """One acquisition of a slot: its callbacks and what its handle pushed."""

    generation: int
    on_output: OutputCallback
    on_error: ErrorCallback | None
    live: bool = True  # False: the client paces itself (faster than real time): never skip to live
    frames: deque[_Stamped] = field(default_factory=deque)
    last_arrival: float | None = None  # monotonic time of the latest frame pushed
    phase: complex = 0j  # average of exp(2 pi i t / frame_s) over its arrivals t: where in the period they come
    updates: list[_Stamped] = field(default_factory=list)
    dropped_frames: int = 0  # over max_pending_frames at push time, or skipped to live


class TickSchedule:
    """When the tick clock steps, as a function of the slots and a time passed in (no thread and no
    clock of its own: the runner passes `time.monotonic()`, tests a manual time).

    A step is due at `next_tick`, which lies at `phase_s` of the frame period (times modulo
    `frame_s`) at least half a frame after the step that planned it. It comes early when every
    sending slot holds a frame within two margins of the tick ("ready": waiting out the arrivals'
    jitter would only add latency), and when a live slot holds
    two frames or more ("behind": a stall left it late; the catch-up steps every slot that has a frame,
    so the extra step serves the whole batch, and does not move the plan). The phase is the one that
    keeps the live slots' summed wait (tick - arrival, modulo the frame) shortest: just after one of
    their learnt arrival phases; the current one is kept unless another saves over a millisecond a slot.
    """

    def __init__(self, frame_s: float, margin_s: float | None = None) -> None:
        self.frame_s = frame_s
        self.margin_s = frame_s / 16 if margin_s is None else margin_s  # "just after": the arrivals' jitter
        self.next_tick: float | None = None  # None: idle (the next frame is stepped at once)
        self.phase_s: float | None = None  # where in the period the tick lies; None: no steady arrivals yet

    def arrived(self, inbox: _SlotInbox, now: float) -> None:
        """A frame was pushed into `inbox` at `now`: learn the slot's phase (live slots only)."""
        inbox.last_arrival = now
        if inbox.live:
            arrival = cmath.exp(2j * math.pi * (now % self.frame_s) / self.frame_s)
            inbox.phase = arrival if inbox.phase == 0 else inbox.phase + PHASE_WEIGHT * (arrival - inbox.phase)

    def sending(self, inbox: _SlotInbox, now: float) -> bool:
        """Holds a frame, or pushed one lately: a slot whose client stopped sending holds nobody up."""
        return bool(inbox.frames) or (inbox.last_arrival is not None
                                      and now - inbox.last_arrival <= SENDING_FRAMES * self.frame_s)

    def ready(self, inboxes: Collection[_SlotInbox], now: float) -> bool:
        """Some slot holds a frame and every sending slot does."""
        return any(inbox.frames for inbox in inboxes) and all(
            inbox.frames for inbox in inboxes if self.sending(inbox, now))

    def reason(self, inboxes: list[_SlotInbox], now: float) -> str | None:
        """Why to step now: "due", "behind" or "ready"; None: wait (for `next_tick` or a frame)."""
        if not any(inbox.frames for inbox in inboxes):
            return None
        if self.next_tick is None or now >= self.next_tick:
            return "due"
        if any(self._behind(inbox) for inbox in inboxes):
            return "behind"
        return "ready" if self._near(now) and self.ready(inboxes, now) else None

    def wakes(self, inbox: _SlotInbox, inboxes: Collection[_SlotInbox], now: float) -> bool:
        """Whether a frame just pushed into `inbox` is a reason to step before the tick (the cheap
        checks first, and the slots as a view, not a copy: this runs at every push)."""
        return self._behind(inbox) or (self._near(now) and self.ready(inboxes, now))

    @staticmethod
    def _behind(inbox: _SlotInbox) -> bool:
        return inbox.live and len(inbox.frames) >= 2

    def _near(self, now: float) -> bool:
        """Close enough to the tick to step when every frame is in: no need to wait out the margin (but
        no earlier, or the step would stay at whatever phase it had, the arrivals just before it waiting
        a whole frame); without a phase (no steady live slot: self-paced clients) at any time."""
        return self.phase_s is None or self.next_tick is None or self.next_tick - now <= 2 * self.margin_s

    def stepped(self, reason: str, inboxes: list[_SlotInbox], now: float) -> None:
        """A step starts at `now` for `reason`: plan the next tick (a catch-up keeps the plan)."""
        if reason == "behind" and self.next_tick is not None:
            return
        self.phase_s = self._best_phase(inboxes, now)
        if self.phase_s is None:
            self.next_tick = now + self.frame_s
        else:
            earliest = now + self.frame_s / 2
            self.next_tick = earliest + (self.phase_s - earliest) % self.frame_s

    def idle(self) -> None:
        """The tick came and no slot had a frame: sleep until one comes, then step it at once."""
        self.next_tick = None

    def _best_phase(self, inboxes: list[_SlotInbox], now: float) -> float | None:
        period = self.frame_s
        phases = np.array([cmath.phase(inbox.phase) / (2 * math.pi) * period % period for inbox in inboxes
                           if inbox.live and abs(inbox.phase) >= PHASE_STEADY and self.sending(inbox, now)])
        if not len(phases):
            return None
        candidates = (phases + self.margin_s) % period
        if self.phase_s is not None:
            candidates = np.append(candidates, self.phase_s)
        waits = ((candidates[:, None] - phases[None, :]) % period).sum(axis=1)
        best = int(np.argmin(waits))
        if self.phase_s is not None and waits[-1] <= waits[best] + 0.001 * len(phases):
            return self.phase_s
        return float(candidates[best])


class SlotHandle:
    """A session's hold on one engine slot, for one acquisition. Thread-safe; `push_*` never block.

    Once released, pushes are refused silently (counted in `stats.stale_dropped`): a late LLM answer
    must not crash anything.
    """

    def __init__(self, runner: EngineRunner, slot: int, inbox: _SlotInbox) -> None:
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
            self.runner._count_stale()
            return
        frame = np.asarray(pcm, dtype=np.float32)
        if frame.shape != (FRAME_SIZE,):
            raise EngineError(f"a frame must be {FRAME_SIZE} samples, got shape {frame.shape}")
        if not np.isfinite(frame).all():
            raise EngineError("a frame holds NaN or infinite samples")
        self.runner._push_frame(self.slot, _Stamped(self.generation, frame))

    def push_oracle(self, update: OracleUpdate) -> None:
        if self.closed:
            self.runner._count_stale()
            return
        self.runner._push_oracle(self.slot, _Stamped(self.generation, update))

    @property
    def dropped_frames(self) -> int:
        """Frames of this acquisition that were never stepped (queue cap or skip to live)."""
        return self._inbox.dropped_frames

    def release(self) -> concurrent.futures.Future:
        """Give the slot back; the future is done once the engine thread has freed it."""
        if not self.closed:
            self.closed = True
            self._released = self.runner._release(self.slot, self.generation)
        return self._released


class EngineRunner:
    """Owns the engine thread. Use as a context manager or call `start()` / `stop()`."""

    def __init__(self, engine: BatchedEngine, batch_window_s: float = 0.02, max_pending_frames: int = 25,
                 on_step: Callable[[float, int], None] | None = None, torch_threads: int | None = None, *,
                 clock: Clock = "tick", frame_s: float = FRAME_S, jitter_frames: int | None = 3) -> None:
        if clock not in ("tick", "eager"):
            raise ValueError(f"clock must be 'tick' or 'eager', got {clock!r}")
        if frame_s <= 0 or (jitter_frames is not None and jitter_frames < 0) or max_pending_frames < 1:
            raise ValueError("frame_s must be > 0, jitter_frames >= 0 (or None) and max_pending_frames >= 1")
        self.engine = engine
        # intra-op threads of the engine thread; on a CPU, OpenMP teams started from a non-main
        # thread cost more than they give for small models (docs/benchmarks.md): 1 is best there
        self.torch_threads = torch_threads
        self.on_step = on_step  # (seconds, batch size) after each step, on the engine thread
        self.clock = clock  # tick: one step per frame_s for all slots; eager: step when a frame arrives
        self.frame_s = frame_s  # the tick period (one frame of audio); a longer step is an overrun
        # frames a live slot may hold at a step before it skips to live; None: never (nothing may be lost)
        self.jitter_frames = jitter_frames
        self.batch_window_s = batch_window_s  # eager: how long a ready slot waits for the others
        self.max_pending_frames = max_pending_frames  # per slot, both clocks; beyond it the oldest is dropped
        self.stats = RunnerStats()
        self._cond = threading.Condition()
        self._inboxes: dict[int, _SlotInbox] = {}
        self._commands: deque[tuple[Callable[[], object], concurrent.futures.Future]] = deque()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._generation = 0  # of the latest acquisition
        self._schedule = TickSchedule(frame_s)  # when to step (tick clock); arrivals are noted for both
        self._idle = False  # the engine thread sleeps until a frame arrives
        self._holding = 0  # inboxes that hold a frame (kept as frames come and go: the eager wait counts on it)
        self._overrun_logged_at: float | None = None

    @property
    def steps(self) -> int:
        return self.stats.steps

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

    def warm_up(self, frames: int = 3, timeout_s: float = 120.0) -> int:
        """Step one slot a few frames of silence so that first-call costs are paid before any user
        comes; returns the frames that came back (blocking)."""
        done: list[FrameOutput] = []
        finished = threading.Event()

        def on_output(output: FrameOutput) -> None:
            done.append(output)
            if len(done) >= frames:
                finished.set()

        handle = self.acquire(on_output, timeout=timeout_s)
        for _ in range(frames):
            handle.push_frame(np.zeros(FRAME_SIZE, dtype=np.float32))
        finished.wait(timeout_s)
        handle.release().result(timeout_s)
        return len(done)

    # ---------------------------------------------------------------- slots

    def acquire(self, on_output: OutputCallback, on_error: ErrorCallback | None = None,
                timeout: float | None = 30.0, live: bool = True, sampling: Sampling | None = None) -> SlotHandle:
        """Reserve and reset a slot under a new generation (blocking until the engine thread has done it).

        `live=False`: the client sends faster than real time on purpose; its frames never skip to live.
        `sampling`: the slot's own sampling settings (None: the checkpoint's)."""
        future = self._call(self._acquire_fn(on_output, on_error, live, sampling))
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.add_done_callback(_release_if_acquired)  # the slot must not stay taken by nobody
            raise

    async def acquire_async(self, on_output: OutputCallback, on_error: ErrorCallback | None = None,
                            live: bool = True, sampling: Sampling | None = None) -> SlotHandle:
        future = self._call(self._acquire_fn(on_output, on_error, live, sampling))
        try:
            return await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            future.add_done_callback(_release_if_acquired)  # a caller gone meanwhile gives the slot back
            raise

    def _acquire_fn(self, on_output: OutputCallback, on_error: ErrorCallback | None,
                    live: bool, sampling: Sampling | None) -> Callable[[], SlotHandle]:
        def _acquire() -> SlotHandle:
            # the engine may be another batch with slots (kyutai-stt's), which samples as it must
            slot = self.engine.acquire() if sampling is None else self.engine.acquire(sampling)
            with self._cond:
                self._generation += 1
                inbox = self._inboxes[slot] = _SlotInbox(self._generation, on_output, on_error, live)
            return SlotHandle(self, slot, inbox)
        return _acquire

    @property
    def free_slots(self) -> int:
        return self.engine.free_slots

    def _release(self, slot: int, generation: int) -> concurrent.futures.Future:
        def _do() -> None:
            with self._cond:
                inbox = self._inboxes.get(slot)
                if inbox is None or inbox.generation != generation:
                    return  # released already: the slot may belong to someone else now
                del self._inboxes[slot]
                self._holding -= bool(inbox.frames)
                self.stats.stale_dropped += len(inbox.frames) + len(inbox.updates)  # left behind, never applied
            self.engine.release(slot)
        return self._call(_do)

    def _call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping or self._thread is None:
                future.set_exception(EngineError("the engine runner is not running"))
                return future
            self._commands.append((fn, future))
            self._cond.notify_all()
        return future

    def _current_inbox(self, slot: int, generation: int) -> _SlotInbox | None:
        """The slot's inbox if `generation` still holds it, else None (counted stale); under the lock."""
        inbox = self._inboxes.get(slot)
        if inbox is None or inbox.generation != generation:
            self.stats.stale_dropped += 1
            return None
        return inbox

    def _push_frame(self, slot: int, frame: _Stamped) -> None:
        with self._cond:
            inbox = self._current_inbox(slot, frame.generation)
            if inbox is None:
                return
            inbox.frames.append(frame)
            if len(inbox.frames) == 1:
                self._holding += 1
            now = time.monotonic()
            self._schedule.arrived(inbox, now)
            if len(inbox.frames) > self.max_pending_frames:
                inbox.frames.popleft()
                inbox.dropped_frames += 1
            if self.clock == "eager" or self._idle or self._schedule.wakes(inbox, self._inboxes.values(), now):
                self._cond.notify_all()  # else the tick wakes the thread by itself

    def _push_oracle(self, slot: int, update: _Stamped) -> None:
        with self._cond:
            inbox = self._current_inbox(slot, update.generation)
            if inbox is not None:
                inbox.updates.append(update)  # never dropped within a generation: resets must reach the slot

    def _count_stale(self) -> None:
        with self._cond:
            self.stats.stale_dropped += 1

    # ---------------------------------------------------------------- engine thread: when to step

    def _loop(self) -> None:
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        while (work := self._next_work()) is not None:
            commands, batch = work
            for fn, future in commands:
                self._run_command(fn, future)
            if batch:
                self._step(batch)
        with self._cond:
            commands = self._take_commands()
        for _, future in commands:  # nobody may wait forever on a command the thread will never run
            future.set_exception(EngineError("the engine runner stopped"))

    def _next_work(self):
        """(commands, batch) to run next, or None to stop."""
        return self._next_tick_work() if self.clock == "tick" else self._next_eager_work()

    def _next_tick_work(self):
        schedule = self._schedule
        with self._cond:
            while not self._stopping:
                if self._commands:
                    return self._take_commands(), {}
                now = time.monotonic()
                inboxes = list(self._inboxes.values())
                reason = schedule.reason(inboxes, now)
                if reason is not None:
                    schedule.stepped(reason, inboxes, now)
                    return [], self._take_batch()
                if schedule.next_tick is not None and now >= schedule.next_tick:
                    schedule.idle()  # the tick found no frame: sleep until one arrives, then step at once
                self._wait(None if schedule.next_tick is None else schedule.next_tick - now)
            return None

    def _count_overrun(self, elapsed: float) -> None:
        """A step longer than a frame: the engine is behind real time; it warns once a minute at most."""
        if elapsed <= self.frame_s:
            return
        self.stats.overruns += 1
        now = time.monotonic()
        if self._overrun_logged_at is None or now - self._overrun_logged_at >= OVERRUN_LOG_INTERVAL_S:
            self._overrun_logged_at = now
            logger.warning("an engine step took %.0f ms, longer than the %.0f ms frame (%d overruns so far): "
                           "the engine is overloaded and live sessions skip to live", elapsed * 1000,
                           self.frame_s * 1000, self.stats.overruns)

    def _wait(self, timeout: float | None) -> None:
        self._idle = timeout is None
        self._cond.wait(timeout)
        self._idle = False

    def _next_eager_work(self):
        with self._cond:
            while not (self._stopping or self._commands or self._any_frame()):
                self._wait(None)
            if self._stopping:
                return None
            if self._commands:
                return self._take_commands(), {}
            now = time.monotonic()
            deadline = now + self.batch_window_s
            # every sending slot holds a frame: counted once, then the wait checks a counter (it wakes at
            # every push)
            sending = sum(self._schedule.sending(inbox, now) for inbox in self._inboxes.values())
            while self._holding < sending and not self._commands and not self._stopping:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return [], self._take_batch()

    def _take_commands(self) -> list[tuple[Callable[[], object], concurrent.futures.Future]]:
        commands = list(self._commands)
        self._commands.clear()
        return commands

    def _any_frame(self) -> bool:
        return self._holding > 0

    def _take_batch(self) -> dict[int, tuple[np.ndarray, list[OracleUpdate], _SlotInbox]]:
        """One frame (and the pending oracle updates) of every slot that has one; under the lock."""
        batch = {}
        for slot, inbox in self._inboxes.items():
            if not inbox.frames:
                continue
            if inbox.live and self.jitter_frames is not None:
                self._skip_to_live(inbox, self.jitter_frames)
            frame = self._pop_current(inbox)
            if not inbox.frames:
                self._holding -= 1
            if frame is None:
                continue  # its updates wait for its next frame
            updates = [update.value for update in inbox.updates if update.generation == inbox.generation]
            self.stats.stale_dropped += len(inbox.updates) - len(updates)
            inbox.updates = []
            batch[slot] = (frame, updates, inbox)
        return batch

    def _pop_current(self, inbox: _SlotInbox) -> np.ndarray | None:
        """The inbox's oldest frame of its own generation (the push checked it already: this is the last
        guard, a comparison a frame; filtering the whole inbox at every step cost 7 % of the GIL at 64
        sessions); others are dropped and counted stale."""
        while inbox.frames:
            stamped = inbox.frames.popleft()
            if stamped.generation == inbox.generation:
                return stamped.value
            self.stats.stale_dropped += 1
        return None

    def _skip_to_live(self, inbox: _SlotInbox, jitter_frames: int) -> None:
        excess = len(inbox.frames) - max(1, jitter_frames)  # 0 and 1 both mean: step the newest frame
        for _ in range(max(0, excess)):
            if inbox.frames.popleft().generation == inbox.generation:
                inbox.dropped_frames += 1
                self.stats.skipped_frames += 1
            else:  # (one that got in past the push's check: stale, as in _take_batch)
                self.stats.stale_dropped += 1

    # ---------------------------------------------------------------- engine thread: the step

    @staticmethod
    def _run_command(fn: Callable[[], object], future: concurrent.futures.Future) -> None:
        try:
            future.set_result(fn())
        except Exception as exc:  # reported to the caller through its future
            future.set_exception(exc)

    def _reset_quietly(self, slot: int) -> None:
        try:
            self.engine.reset_slot(slot)
        except Exception:
            logger.exception("could not reset slot %d after a failed step", slot)

    def _step(self, batch) -> None:
        started = time.perf_counter()
        try:
            for slot, (_, updates, _) in batch.items():
                for update in updates:
                    self.engine.push_oracle(slot, update)
            outputs = self.engine.step({slot: frame for slot, (frame, _, _) in batch.items()})
        except Exception as exc:  # contained: those slots are reset and told; the thread goes on
            logger.exception("engine step failed for slots %s", sorted(batch))
            for slot, (_, _, inbox) in batch.items():
                self._reset_quietly(slot)
                if inbox.on_error is not None:
                    inbox.on_error(exc)
            return
        elapsed = time.perf_counter() - started
        self._count_overrun(elapsed)
        self.stats.steps += 1
        self.stats.frames_stepped += len(batch)
        if self.on_step is not None:
            self.on_step(elapsed, len(batch))
        for output in outputs:  # to the acquisition whose frame this was, whatever happened since
            try:
                batch[output.slot][2].on_output(output)
            except Exception:  # a broken consumer must not stop the engine for the others
                logger.exception("output callback of slot %d failed", output.slot)


def _release_if_acquired(future: concurrent.futures.Future) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().release()
