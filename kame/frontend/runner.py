"""Puts a `BatchedEngine` on its own thread, driven by a frame clock, so asyncio code never blocks on it.

Sessions push PCM frames and oracle updates into thread-safe inboxes (kame/frontend/slots.py), stamped
with the generation of their slot acquisition: anything of another generation is dropped, so nothing of
a slot's previous occupant reaches the next. A batched step costs the whole batch however many slots
it steps.

When to step is the step policy's (kame/frontend/step_policy.py), named by `clock`: "tick" steps once
per `frame_s` for every slot that has a frame, at the phase of the frame period that keeps the sessions'
mean wait shortest, early when every sending slot has its frame, and at once when a live slot is behind;
"eager" steps as soon as a frame arrives, waiting at most `batch_window_s` for the other sending
slots. The policy decides on the runner's time source (`now()`, injected: a manual clock in tests);
the thread waits on its condition variable for what the policy says. With either, a live slot holding
more than `jitter_frames` at a step drops its oldest frames down to that (skip to live: only when the
engine cannot keep up), a step longer than a frame is counted as an overrun, and the thread
sleeps while no slot has a frame. A slot acquired with `live=False` (a client that sends
faster than real time on purpose) never skips and never triggers a catch-up: alone, it is stepped
as fast as the engine goes. Slot acquire/release run on the engine thread between steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kame.audio import FRAME_S
from kame.clock import MonotonicClock
from kame.errors import EngineError
from kame.frontend.engine import FRAME_SIZE, BatchedEngine, FrameOutput, PromptFrame
from kame.frontend.oracle import OracleUpdate
from kame.frontend.sampling import Sampling
from kame.frontend.slots import (
    ErrorCallback,
    OutputCallback,
    SlotHandle,
    SlotInbox,
    Stamped,
    release_if_acquired,
)
from kame.frontend.step_policy import EngineClock, make_policy, sending

logger = logging.getLogger(__name__)

OVERRUN_LOG_INTERVAL_S = 60.0  # an overloaded engine warns at most this often
# the defaults of the runner and so of kame.runtime.RuntimeSettings (and the server's settings)
BATCH_WINDOW_S, MAX_PENDING_FRAMES, JITTER_FRAMES = 0.02, 25, 3
PREFILL_CHUNK = 16  # prompt frames stepped at most at once, between two steps of the talking sessions
PREFILL_MARGIN = 2.0  # a chunk is stepped only where this many times its expected cost fits before the next step
PREFILL_COST_GAIN = 0.3  # of each part's measured cost a frame, into the estimate
PREFILL_COST_FADE = 0.9  # an estimate that lets no frame into half a frame's slack, times this each time
PREFILL_STARVED_S = 1.0  # an engine with no slack still steps a prompt frame this often


@dataclass
class _Prefill:
    """A slot being prefilled with its prompt; its acquirer gets the handle once it is done."""

    handle: SlotHandle
    frames: Sequence[PromptFrame]
    done: concurrent.futures.Future
    stepped: int = 0


class TimeSource(Protocol):
    """Where the runner reads the time (`kame.clock.MonotonicClock` or `ManualClock`): only `now()`, since
    the engine thread waits on its own condition variable, never on the clock."""

    def now(self) -> float: ...


@dataclass
class RunnerStats:
    """Counters of an `EngineRunner`; plain ints, readable from any thread."""

    steps: int = 0  # batched engine steps
    frames_stepped: int = 0  # slot frames in those steps (frames_stepped / steps: the mean batch)
    stale_dropped: int = 0  # frames and oracle updates of a finished acquisition, never applied
    skipped_frames: int = 0  # frames dropped to bring a live slot back to live (over jitter_frames)
    overruns: int = 0  # steps that took longer than a frame


class EngineRunner:
    """Owns the engine thread. Use as a context manager or call `start()` / `stop()`.

    `accept_frame`, `accept_oracle`, `count_stale` and `release_slot` are what its `SlotHandle`s call
    (`SlotOwner`); sessions use the handles."""

    def __init__(self, engine: BatchedEngine, batch_window_s: float = BATCH_WINDOW_S,
                 max_pending_frames: int = MAX_PENDING_FRAMES, on_step: Callable[[float, int], None] | None = None,
                 torch_threads: int | None = None, *, clock: EngineClock = "tick", frame_s: float = FRAME_S,
                 jitter_frames: int | None = JITTER_FRAMES, time_source: TimeSource | None = None) -> None:
        # tick: one step per frame_s for all slots; eager: step when a frame arrives (batch_window_s)
        self.policy = make_policy(clock, frame_s, batch_window_s)
        if frame_s <= 0 or (jitter_frames is not None and jitter_frames < 0) or max_pending_frames < 1:
            raise ValueError("frame_s must be > 0, jitter_frames >= 0 (or None) and max_pending_frames >= 1")
        self.engine = engine
        # intra-op threads of the engine thread; on a CPU, OpenMP teams started from a non-main
        # thread cost more than they give for small models (docs/benchmarks-history.md, "the engine thread
        # and OpenMP"): 1 is best there
        self.torch_threads = torch_threads
        self.on_step = on_step  # (seconds, batch size) after each step, on the engine thread
        self.after_step: Callable[[], None] | None = None  # once a step's outputs are all handed out (a host's flush)
        self.frame_s = frame_s  # the tick period (one frame of audio); a longer step is an overrun
        # frames a live slot may hold at a step before it skips to live; None: never (nothing may be lost)
        self.jitter_frames = jitter_frames
        self.max_pending_frames = max_pending_frames  # per slot, both clocks; beyond it the oldest is dropped
        self.time_source = time_source or MonotonicClock()  # arrivals, the policy's decisions, the overrun warning
        self.stats = RunnerStats()
        self._warming = False  # during warm_up: slow first steps are neither counted nor warned about
        self._cond = threading.Condition()
        self._inboxes: dict[int, SlotInbox] = {}
        self._commands: deque[tuple[Callable[[], object], concurrent.futures.Future]] = deque()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._generation = 0  # of the latest acquisition
        self._idle = False  # the engine thread sleeps until a frame arrives
        self._holding = 0  # inboxes that hold a frame (kept as frames come and go: the eager wait counts on it)
        self._overrun_logged_at: float | None = None
        self._prefills: deque[_Prefill] = deque()  # slots acquired with a prompt, stepped through it in slack
        self._prefill_frame_s = 0.0  # the latest cost of one prompt frame (0: not measured yet)
        self._prefill_waiting_since: float | None = None  # a prompt got no frame in since then

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

        warm_views = getattr(self.engine, "warm_views", None)  # each batch size's CUDA graphs, captured first
        if warm_views is not None:
            sizes = self._call(warm_views).result(timeout_s)
            if sizes:
                logger.info("captured the engine's CUDA graphs for %d batch sizes: %s", len(sizes), sizes)
        handle = self.acquire(on_output, timeout=timeout_s)
        self._warming = True  # first steps capture CUDA graphs and compile (20 s on a 7B): not an overload
        try:
            for _ in range(frames):
                handle.push_frame(np.zeros(FRAME_SIZE, dtype=np.float32))
            finished.wait(timeout_s)
            handle.release().result(timeout_s)
        finally:
            self._warming = False
        return len(done)

    # ---------------------------------------------------------------- slots

    def acquire(self, on_output: OutputCallback, on_error: ErrorCallback | None = None,
                timeout: float | None = 30.0, live: bool = True, sampling: Sampling | None = None,
                prompt: Sequence[PromptFrame] = ()) -> SlotHandle:
        """Reserve and reset a slot under a new generation (blocking until the engine thread has done it).

        `live=False`: the client sends faster than real time on purpose; its frames never skip to live.
        `sampling`: the slot's own sampling settings (None: the checkpoint's). `prompt`: a persona's, stepped
        first (`acquire_future`)."""
        future = self.acquire_future(on_output, on_error, live, sampling, prompt)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.add_done_callback(release_if_acquired)  # the slot must not stay taken by nobody
            raise

    def acquire_future(self, on_output: OutputCallback, on_error: ErrorCallback | None = None,
                       live: bool = True, sampling: Sampling | None = None,
                       prompt: Sequence[PromptFrame] = ()) -> concurrent.futures.Future:
        """`acquire` without waiting: the future's result is the handle (a caller gone meanwhile must
        release it: `release_if_acquired`). With a `prompt` (a persona's), the slot is stepped through it first,
        in the time the talking sessions' steps leave (they never wait for it), and the handle comes after."""
        acquire = self._acquire_fn(on_output, on_error, live, sampling)
        if not prompt:
            return self._call(acquire)
        done: concurrent.futures.Future = concurrent.futures.Future()

        def acquire_then_prefill() -> SlotHandle:
            handle = acquire()
            self._prefills.append(_Prefill(handle, list(prompt), done))  # on the engine thread, as _next_work
            return handle

        def failed(acquired: concurrent.futures.Future) -> None:
            if acquired.exception() is not None and done.set_running_or_notify_cancel():
                done.set_exception(acquired.exception())

        self._call(acquire_then_prefill).add_done_callback(failed)
        return done

    async def acquire_async(self, on_output: OutputCallback, on_error: ErrorCallback | None = None,
                            live: bool = True, sampling: Sampling | None = None,
                            prompt: Sequence[PromptFrame] = ()) -> SlotHandle:
        future = self.acquire_future(on_output, on_error, live, sampling, prompt)
        try:
            return await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            if prompt:  # a prompt not stepped yet is dropped (the runner gives its slot back)
                future.cancel()
            future.add_done_callback(release_if_acquired)  # a caller gone meanwhile gives the slot back
            raise

    def _acquire_fn(self, on_output: OutputCallback, on_error: ErrorCallback | None,
                    live: bool, sampling: Sampling | None) -> Callable[[], SlotHandle]:
        def _acquire() -> SlotHandle:
            # the engine may be another batch with slots (kyutai-stt's), which samples as it must
            slot = self.engine.acquire() if sampling is None else self.engine.acquire(sampling)
            with self._cond:
                self._generation += 1
                inbox = self._inboxes[slot] = SlotInbox(self._generation, on_output, on_error, live)
            return SlotHandle(self, slot, inbox)
        return _acquire

    @property
    def free_slots(self) -> int:
        return self.engine.free_slots

    def _call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping or self._thread is None:
                future.set_exception(EngineError("the engine runner is not running"))
                return future
            self._commands.append((fn, future))
            self._cond.notify_all()
        return future

    # ---------------------------------------------------------------- what the handles call (SlotOwner)

    def release_slot(self, slot: int, generation: int) -> concurrent.futures.Future:
        """Free `slot` on the engine thread if `generation` still holds it (a later release is a no-op)."""
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

    def accept_frame(self, slot: int, frame: Stamped) -> None:
        """Queue a frame its handle checked; the policy notes the arrival and says whether it wakes the thread."""
        with self._cond:
            inbox = self._current_inbox(slot, frame.generation)
            if inbox is None:
                return
            inbox.frames.append(frame)
            if len(inbox.frames) == 1:
                self._holding += 1
            now = self.time_source.now()
            self.policy.arrived(inbox, now)
            if len(inbox.frames) > self.max_pending_frames:
                inbox.frames.popleft()
                inbox.dropped_frames += 1
            if self._idle or self.policy.wakes(inbox, self._inboxes.values(), now):
                self._cond.notify_all()  # else the time the policy gave wakes the thread by itself

    def accept_oracle(self, slot: int, update: Stamped) -> None:
        with self._cond:
            inbox = self._current_inbox(slot, update.generation)
            if inbox is not None:
                inbox.updates.append(update)  # never dropped within a generation: resets must reach the slot

    def count_stale(self) -> None:
        """A push through a released handle: refused, counted."""
        with self._cond:
            self.stats.stale_dropped += 1

    def _current_inbox(self, slot: int, generation: int) -> SlotInbox | None:
        """The slot's inbox if `generation` still holds it, else None (counted stale); under the lock."""
        inbox = self._inboxes.get(slot)
        if inbox is None or inbox.generation != generation:
            self.stats.stale_dropped += 1
            return None
        return inbox

    # ---------------------------------------------------------------- engine thread: when to step

    def _loop(self) -> None:
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        while (work := self._next_work()) is not None:
            commands, batch, prefill = work
            for fn, future in commands:
                self._run_command(fn, future)
            if batch:
                self._step(batch)
            if prefill is not None:
                self._prefill(*prefill)
        with self._cond:
            commands = self._take_commands()
        for _, future in commands:  # nobody may wait forever on a command the thread will never run
            future.set_exception(EngineError("the engine runner stopped"))
        while self._prefills:
            entry = self._prefills.popleft()
            entry.handle.release()
            if entry.done.set_running_or_notify_cancel():
                entry.done.set_exception(EngineError("the engine runner stopped"))

    def _next_work(self):
        """(commands, batch) to run next, or None to stop: commands go first, but a batch the policy was
        gathering (eager's window) is stepped as it is when one comes; else the policy says when to step,
        and the thread waits that long or until a push wakes it."""
        policy = self.policy
        with self._cond:
            while True:
                if self._stopping or self._commands:
                    if policy.interrupt():
                        return [], self._take_batch(), None
                    return None if self._stopping else (self._take_commands(), {}, None)
                now = self.time_source.now()
                at = policy.next_step(self._inboxes.values(), self._holding, now)
                if at is not None and at <= now:
                    return [], self._take_batch(), None
                if self._prefills:  # the time until the next step: a prompt's frames, if some fit in it
                    slack = self._slack(at, now)
                    frames = self._prefill_budget(slack, now)
                    if frames:
                        return [], {}, (self._prefills[0], frames)
                    if at is None:  # a talking session may stop sending: look again a frame after its due one
                        at = now + (slack if slack is not None else 0.0) + self.frame_s
                self._wait(None if at is None else at - now)

    def _slack(self, at: float | None, now: float) -> float | None:
        """The time until the talking sessions' next step: until `at`, or (no step planned) until the next
        frame a live session sending is due to push; None when none is."""
        if at is not None:
            return at - now
        due = [inbox.last_arrival + self.frame_s for inbox in self._inboxes.values()
               if inbox.live and sending(inbox, now, self.frame_s) and inbox.last_arrival is not None]
        return max(0.0, min(due) - now) if due else None

    def _prefill_budget(self, slack_s: float | None, now: float) -> int:
        """Prompt frames that fit in `slack_s` (None: the engine is idle: half a frame's worth) at the measured
        cost. An engine with no slack at all (its steps longer than half a frame) still gets a frame in after
        PREFILL_STARVED_S without one: the prompt goes on, slowly, rather than the session waiting forever."""
        frames = self._fitting(self.frame_s / 2 if slack_s is None else slack_s, slack_s is None)
        if frames:
            self._prefill_waiting_since = None
            return frames
        if self._prefill_waiting_since is None:
            self._prefill_waiting_since = now
        elif now - self._prefill_waiting_since >= PREFILL_STARVED_S:
            self._prefill_waiting_since = None
            return 1
        return 0

    def _fitting(self, slack_s: float, idle: bool) -> int:
        cost = self._prefill_frame_s
        if cost == 0.0:  # the first frame measures the cost, in a good half of a frame's slack
            return 1 if idle or slack_s >= self.frame_s / 2 else 0
        frames = min(PREFILL_CHUNK, int(slack_s / (cost * PREFILL_MARGIN)))
        if idle:
            return max(frames, 1)
        if not frames and slack_s >= self.frame_s / 2:
            # a cost once measured high (a slow part: the OS, a collection) is not trusted for good: it fades
            # until a frame fits, and that frame measures it again
            self._prefill_frame_s = cost * PREFILL_COST_FADE
        return frames

    def _prefill(self, entry: _Prefill, frames: int) -> None:
        """Step the first waiting slot through the next `frames` of its prompt; its handle goes out at the end."""
        handle, begin = entry.handle, entry.stepped
        if entry.done.cancelled():  # its caller gave up: the slot goes back, the prompt is not stepped
            self._prefills.popleft()
            handle.release()
            return
        end = min(len(entry.frames), begin + frames)
        started = time.perf_counter()
        try:
            self.engine.prefill(handle.slot, entry.frames, begin, end)
        except Exception as exc:  # contained: the slot goes back, its acquirer is told
            logger.exception("prefilling slot %d failed", handle.slot)
            self._prefills.popleft()
            handle.release()
            if entry.done.set_running_or_notify_cancel():
                entry.done.set_exception(exc)
            return
        cost = (time.perf_counter() - started) / (end - begin)
        previous = self._prefill_frame_s
        self._prefill_frame_s = cost if previous == 0.0 else previous + PREFILL_COST_GAIN * (cost - previous)
        entry.stepped = end
        if end == len(entry.frames):
            self._prefills.popleft()
            logger.info("slot %d: a persona's prompt of %d frames prefilled", handle.slot, end)
            if entry.done.set_running_or_notify_cancel():
                entry.done.set_result(handle)
            else:  # its caller gave up meanwhile
                handle.release()

    def _count_overrun(self, elapsed: float) -> None:
        """A step longer than a frame: the engine is behind real time; it warns once a minute at most."""
        if elapsed <= self.frame_s or self._warming:
            return
        self.stats.overruns += 1
        now = self.time_source.now()
        if self._overrun_logged_at is None or now - self._overrun_logged_at >= OVERRUN_LOG_INTERVAL_S:
            self._overrun_logged_at = now
            logger.warning("an engine step took %.0f ms, longer than the %.0f ms frame (%d overruns so far): "
                           "the engine is overloaded and live sessions skip to live", elapsed * 1000,
                           self.frame_s * 1000, self.stats.overruns)

    def _wait(self, timeout: float | None) -> None:
        self._idle = timeout is None
        self._cond.wait(timeout)
        self._idle = False

    def _take_commands(self) -> list[tuple[Callable[[], object], concurrent.futures.Future]]:
        commands = list(self._commands)
        self._commands.clear()
        return commands

    def _take_batch(self) -> dict[int, tuple[np.ndarray, list[OracleUpdate], SlotInbox]]:
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

    def _pop_current(self, inbox: SlotInbox) -> np.ndarray | None:
        """The inbox's oldest frame of its own generation (the push checked it already: this is the last
        guard, a comparison a frame; filtering the whole inbox at every step cost 7 % of the GIL at 64
        sessions); others are dropped and counted stale."""
        while inbox.frames:
            stamped = inbox.frames.popleft()
            if stamped.generation == inbox.generation:
                return stamped.value
            self.stats.stale_dropped += 1
        return None

    def _skip_to_live(self, inbox: SlotInbox, jitter_frames: int) -> None:
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
        started = time.perf_counter()  # the step's own cost, on the real clock whatever the time source
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
            self._stepped()
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
        self._stepped()

    def _stepped(self) -> None:
        if self.after_step is not None:
            try:
                self.after_step()
            except Exception:
                logger.exception("the after-step hook failed")
