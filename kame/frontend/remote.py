"""The engine in a process of its own: an `EngineHost` serves its runners (the front-end's batch, and a GPU
speech-to-text batch where there is one) over a Unix socket to the front processes that hold the sessions
(sockets, codecs, ASR feeds, planners); there a `RemoteRunner` stands where the `EngineRunner` stood.

Why: a step's Python and the sessions' share one GIL in one process, and one event loop carries ~64 real-time
sessions (docs/scaling.md, "Host CPU"). With the engine here, a front's GIL carries its sessions only, and
several fronts share one batch on one GPU: one model, one KV cache, one step per frame for all of them.

The wire: pickled messages on `multiprocessing.connection` (AF_UNIX, an auth key). A front's writer thread
sends what its sessions pushed since its last send (frames, oracle updates) in one message; the host sends each
front one message per step with the outputs of its sessions. Slots are the host's alone: a front acquires and
releases through it, so two fronts never hold one slot, and all see one free-slot count (`Status`, sent at
each acquire and release and every `STATUS_S`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener

import numpy as np

from kame.errors import EngineError, SlotsBusy
from kame.frontend.oracle import OracleUpdate
from kame.frontend.runner import EngineRunner, RunnerStats
from kame.frontend.sampling import Sampling
from kame.frontend.slots import ErrorCallback, OutputCallback, SlotHandle, Stamped, checked_frame, release_if_acquired

logger = logging.getLogger(__name__)

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


# ---------------------------------------------------------------- the host (in the engine process)


class EngineHost:
    """Serves `runners` (started, warm) to front processes at `address` (a Unix socket path)."""

    def __init__(self, runners: Mapping[str, EngineRunner], address: str, authkey: bytes,
                 extra: dict | None = None, status_s: float = STATUS_S) -> None:
        self.runners = dict(runners)
        self.info = HostInfo({name: r.engine.batch_size for name, r in self.runners.items()},
                             {name: _default_sampling(r) for name, r in self.runners.items()}, extra or {})
        self.listener = Listener(address, family="AF_UNIX", authkey=authkey)
        self.address, self.status_s = address, status_s
        self._fronts: list[_FrontLink] = []
        self._lock = threading.Lock()
        self._steps: dict[str, list[tuple[float, int]]] = {name: [] for name in self.runners}
        self._steps_lock = threading.Lock()
        self._stopping = threading.Event()
        for name, runner in self.runners.items():
            runner.after_step = self._flusher(name)
            runner.on_step = self._step_recorder(name, runner.on_step)

    def _flusher(self, name: str) -> Callable[[], None]:
        def flush() -> None:  # on the engine thread, after each step: one message per front with outputs
            with self._lock:
                fronts = list(self._fronts)
            for front in fronts:
                front.flush_outputs(name)
        return flush

    def _step_recorder(self, name: str, chained: Callable[[float, int], None] | None) -> Callable[[float, int], None]:
        def record(seconds: float, batch: int) -> None:
            with self._steps_lock:
                self._steps[name].append((seconds, batch))
            if chained is not None:
                chained(seconds, batch)
        return record

    def serve_forever(self) -> None:
        """Accept fronts until `close` (blocking); each one gets its own reader and writer threads."""
        threading.Thread(target=self._status_loop, name="kame-host-status", daemon=True).start()
        threading.Thread(target=self._accept, name="kame-host-accept", daemon=True).start()
        self._stopping.wait()  # (an accept blocked in this thread would not wake when the listener closes)

    def _accept(self) -> None:
        for index in itertools.count():
            try:
                conn = self.listener.accept()
            except (OSError, EOFError):
                if self._stopping.is_set():
                    return
                logger.exception("engine host: a front could not connect")
                continue
            front = _FrontLink(self, conn, index)
            with self._lock:
                self._fronts.append(front)
            front.start()
            logger.info("engine host: front %d connected", index)

    def close(self) -> None:
        self._stopping.set()
        self.listener.close()
        with self._lock:
            fronts = list(self._fronts)
        for front in fronts:
            front.close()

    def forget(self, front: _FrontLink) -> None:
        with self._lock:
            if front in self._fronts:
                self._fronts.remove(front)

    def status(self, steps: bool = False) -> Status:
        taken = {}
        if steps:
            with self._steps_lock:
                taken, self._steps = self._steps, {name: [] for name in self.runners}
        return Status({name: r.free_slots for name, r in self.runners.items()},
                      {name: _copy_stats(r.stats) for name, r in self.runners.items()}, taken)

    def broadcast_status(self, steps: bool = False) -> None:
        status = self.status(steps)
        with self._lock:
            fronts = list(self._fronts)
        for front in fronts:
            front.send(status)

    def _status_loop(self) -> None:
        while not self._stopping.wait(self.status_s):
            self.broadcast_status(steps=True)


class _FrontLink:
    """The host's side of one front: reads its requests, sends it what its sessions get."""

    def __init__(self, host: EngineHost, conn: Connection, index: int) -> None:
        self.host, self.conn, self.index = host, conn, index
        self.handles: dict[tuple[str, int], SlotHandle] = {}  # (runner, slot) -> this front's acquisition
        self.outboxes: dict[str, list] = {name: [] for name in host.runners}  # filled on the engine thread
        self._queue: deque = deque()
        self._ready = threading.Condition()
        self._closed = False

    def start(self) -> None:
        self.send(self.host.info)
        threading.Thread(target=self._read, name=f"kame-host-read-{self.index}", daemon=True).start()
        threading.Thread(target=self._write, name=f"kame-host-write-{self.index}", daemon=True).start()

    def send(self, message: object) -> None:
        with self._ready:
            self._queue.append(message)
            if len(self._queue) > MAX_QUEUED:  # the front stopped reading: its oldest outputs go, never a reply
                _drop_oldest(self._queue, Outputs)
            self._ready.notify()

    def flush_outputs(self, name: str) -> None:
        box = self.outboxes[name]
        if box:
            self.outboxes[name] = []
            self.send(Outputs(name, box))

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify()
        self.conn.close()

    # ------------------------------------------------------------ requests

    def _read(self) -> None:
        try:
            while True:
                self._handle(self.conn.recv())
        except (EOFError, OSError):
            pass
        except Exception:
            logger.exception("engine host: front %d sent what it cannot read", self.index)
        finally:
            self._gone()

    def _handle(self, message: object) -> None:
        if isinstance(message, Pushes):
            runner = self.host.runners[message.runner]
            for slot, generation, frame in message.frames:
                runner.accept_frame(slot, Stamped(generation, frame))
            for slot, generation, update in message.oracles:
                runner.accept_oracle(slot, Stamped(generation, update))
        elif isinstance(message, Acquire):
            self._acquire(message)
        elif isinstance(message, Release):
            self._release(message)
        else:
            raise TypeError(f"unknown message {type(message).__name__}")

    def _acquire(self, request: Acquire) -> None:
        box_name, holder = request.runner, []

        def on_output(output) -> None:  # engine thread
            handle = holder[0]
            self.outboxes[box_name].append((handle.generation, output, handle.dropped_frames))

        def on_error(exc: BaseException) -> None:  # engine thread
            handle = holder[0]
            self.send(SlotFailed(box_name, handle.slot, handle.generation, str(exc)))

        def done(future: concurrent.futures.Future) -> None:
            try:
                handle = future.result()
            except SlotsBusy as exc:
                self.send(Refused(request.request, True, str(exc)))
                return
            except Exception as exc:
                self.send(Refused(request.request, False, str(exc)))
                return
            holder.append(handle)
            if self._closed:  # the front went while its slot was being reset
                handle.release()
                return
            self.handles[(box_name, handle.slot)] = handle
            self.host.broadcast_status()  # first: a front that hears of its slot has heard the count
            self.send(Acquired(request.request, handle.slot, handle.generation))

        runner = self.host.runners[request.runner]
        runner.acquire_future(on_output, on_error, request.live, request.sampling).add_done_callback(done)

    def _release(self, request: Release) -> None:
        handle = self.handles.get((request.runner, request.slot))
        if handle is None or handle.generation != request.generation:
            self.send(Released(request.request))
            return
        del self.handles[(request.runner, request.slot)]

        def done(_: concurrent.futures.Future) -> None:
            self.host.broadcast_status()
            self.send(Released(request.request))
        handle.release().add_done_callback(done)

    def _gone(self) -> None:
        """The front's connection ended: its slots go back (its sessions are gone with it)."""
        self._closed = True
        handles, self.handles = list(self.handles.values()), {}
        for handle in handles:
            handle.release()
        if handles:
            logger.warning("engine host: front %d went away holding %d slots; released", self.index, len(handles))
        self.host.forget(self)
        self.close()

    # ------------------------------------------------------------ sending

    def _write(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if self._closed:
                    return
                messages = list(self._queue)
                self._queue.clear()
            try:
                for message in messages:
                    self.conn.send(message)
            except (OSError, ValueError):
                return  # the reader sees the end too, and releases


def _drop_oldest(queue: deque, kind: type) -> None:
    """Remove the oldest item of `kind` (outputs, or pushed frames and updates): what a stalled peer can lose."""
    for index, item in enumerate(queue):
        if isinstance(item, kind):
            del queue[index]
            return


def _default_sampling(runner: EngineRunner) -> Sampling | None:
    sampler = getattr(runner.engine, "sampler", None)
    return None if sampler is None else sampler.default


def _copy_stats(stats: RunnerStats) -> RunnerStats:
    return RunnerStats(stats.steps, stats.frames_stepped, stats.stale_dropped, stats.skipped_frames, stats.overruns)


# ---------------------------------------------------------------- the front's side


class RemoteEngine:
    """A front process's connection to the engine host: its runners by name (`runner(name)`)."""

    def __init__(self, address: str, authkey: bytes) -> None:
        try:
            self.conn = Client(address, family="AF_UNIX", authkey=authkey)
        except (OSError, EOFError) as exc:
            raise EngineError(f"the engine process at {address} does not answer: {exc}") from exc
        self.info: HostInfo = self.conn.recv()
        self.runners = {name: RemoteRunner(self, name, slots, self.info.sampling.get(name),
                                           self.info.extra.get("device", "cpu"))
                        for name, slots in self.info.runners.items()}
        self._requests: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count(1)
        self._queue: deque = deque()
        self._ready = threading.Condition()
        self._lock = threading.Lock()
        self.alive = True
        self._closing = None  # False once closed on purpose
        self._reader = threading.Thread(target=self._read, name="kame-remote-read", daemon=True)
        self._writer = threading.Thread(target=self._write, name="kame-remote-write", daemon=True)
        self._reader.start()
        self._writer.start()

    def runner(self, name: str) -> RemoteRunner:
        return self.runners[name]

    def close(self) -> None:
        """Close the connection on purpose (the host releases what this front still holds; its handles
        are not told: their sessions are closing too)."""
        with self._ready:
            self._closing = self.alive = False
            self._ready.notify()
        self.conn.close()

    # ------------------------------------------------------------ requests

    def request(self, make: Callable[[int], object]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            future.set_exception(EngineError("the engine process is gone"))
            return future
        with self._lock:
            request = next(self._ids)
            self._requests[request] = future
        self.enqueue(make(request))
        return future

    def enqueue(self, item: object) -> None:
        """A message, or ("frame" | "oracle", runner, slot, generation, value): sent in order, pushes of a
        row gathered into one message."""
        with self._ready:
            self._queue.append(item)
            if len(self._queue) > MAX_QUEUED:  # the host stopped reading: the oldest frame goes, never a request
                _drop_oldest(self._queue, tuple)
            if len(self._queue) == 1:
                self._ready.notify()

    def _write(self) -> None:
        while True:
            with self._ready:
                while not self._queue and self.alive:
                    self._ready.wait()
                if not self.alive:
                    return
                items = list(self._queue)
                self._queue.clear()
            try:
                for message in _gather(items):
                    self.conn.send(message)
            except (OSError, ValueError):
                return

    # ------------------------------------------------------------ what the host sends

    def _read(self) -> None:
        try:
            while True:
                self._dispatch(self.conn.recv())
        except (EOFError, OSError):
            pass
        except Exception:
            if self._closing is None:  # (a connection closed under the reader fails in odd ways)
                logger.exception("the engine process sent what this front cannot read")
        finally:
            self._lost()

    def _dispatch(self, message: object) -> None:
        if isinstance(message, Outputs):
            self.runners[message.runner].deliver(message.items)
        elif isinstance(message, Status):
            for name, runner in self.runners.items():
                runner.update(message.free_slots[name], message.stats[name], message.steps.get(name, ()))
        elif isinstance(message, SlotFailed):
            self.runners[message.runner].failed(message.slot, message.generation, message.message)
        elif isinstance(message, Acquired | Refused | Released):
            with self._lock:
                future = self._requests.pop(message.request, None)
            if future is not None and not future.done():
                future.set_result(message)
        else:
            logger.warning("engine process: an unknown message %s", type(message).__name__)

    def _lost(self) -> None:
        """The host is gone: every waiting request and every session's slot fails; no slot is free."""
        was_alive, self.alive = self.alive, False
        with self._ready:
            self._ready.notify()
        with self._lock:
            pending, self._requests = list(self._requests.values()), {}
        for future in pending:
            if not future.done():
                future.set_exception(EngineError("the engine process is gone"))
        if self._closing is not None:
            return  # closed on purpose
        for runner in self.runners.values():
            runner.lost()
        if was_alive:
            logger.error("the engine process closed its connection: this front's sessions end")


def _gather(items: list) -> list:
    """Consecutive frame and oracle pushes of one runner become one `Pushes`; other messages keep their
    place (a release after its session's last frames)."""
    messages: list = []
    current: Pushes | None = None
    for item in items:
        if isinstance(item, tuple):
            kind, runner, slot, generation, value = item
            if current is None or current.runner != runner:
                current = Pushes(runner, [], [])
                messages.append(current)
            (current.frames if kind == "frame" else current.oracles).append((slot, generation, value))
        else:
            messages.append(item)
            current = None
    return messages


class RemoteRunner:
    """An `EngineRunner` of the engine host, as the sessions of this front see it: `acquire_async`,
    `free_slots`, `stats`; its handles push frames and oracle updates and release. `on_step` (seconds,
    batch) is called for each step the host reports (on a thread of this front)."""

    def __init__(self, remote: RemoteEngine, name: str, slots: int, sampling: Sampling | None,
                 device: str = "cpu") -> None:
        self.remote, self.name = remote, name
        self.engine = _RemoteBatch(slots, sampling, device)
        self.free_slots = slots
        self.stats = RunnerStats()
        self.on_step: Callable[[float, int], None] | None = None
        self._handles: dict[int, RemoteSlotHandle] = {}  # slot -> this front's acquisition

    @property
    def steps(self) -> int:
        return self.stats.steps

    def acquire_future(self, on_output: OutputCallback, on_error: ErrorCallback | None = None,
                       live: bool = True, sampling: Sampling | None = None) -> concurrent.futures.Future:
        reply = self.remote.request(lambda request: Acquire(request, self.name, live, sampling))
        result: concurrent.futures.Future = concurrent.futures.Future()

        def done(future: concurrent.futures.Future) -> None:
            try:
                answer = future.result()
            except BaseException as exc:
                result.set_exception(exc)
                return
            if isinstance(answer, Refused):
                result.set_exception((SlotsBusy if answer.busy else EngineError)(answer.message))
                return
            handle = RemoteSlotHandle(self, answer.slot, answer.generation, on_output, on_error)
            self._handles[answer.slot] = handle
            if not result.set_running_or_notify_cancel():
                handle.release()  # the caller is gone: the slot goes back
                return
            result.set_result(handle)
        reply.add_done_callback(done)
        return result

    async def acquire_async(self, on_output: OutputCallback, on_error: ErrorCallback | None = None,
                            live: bool = True, sampling: Sampling | None = None) -> RemoteSlotHandle:
        future = self.acquire_future(on_output, on_error, live, sampling)
        try:
            return await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            future.add_done_callback(release_if_acquired)
            raise

    def acquire(self, on_output: OutputCallback, on_error: ErrorCallback | None = None,
                timeout: float | None = 30.0, live: bool = True, sampling: Sampling | None = None):
        return self.acquire_future(on_output, on_error, live, sampling).result(timeout)

    def warm_up(self, frames: int = 3, timeout_s: float = 120.0) -> int:
        """The host warmed its engine before it served: nothing to do here."""
        return 0

    def stop(self, timeout: float = 5.0) -> None:
        """The connection is the `RemoteEngine`'s to close."""

    # ------------------------------------------------------------ from the reader thread

    def deliver(self, items: list[tuple[int, object, int]]) -> None:
        for generation, output, dropped in items:
            handle = self._handles.get(output.slot)
            if handle is None or handle.generation != generation:
                continue  # released meanwhile: nobody waits for it
            handle.dropped = dropped
            try:
                handle.on_output(output)
            except Exception:
                logger.exception("output callback of remote slot %d failed", output.slot)

    def failed(self, slot: int, generation: int, message: str) -> None:
        handle = self._handles.get(slot)
        if handle is not None and handle.generation == generation and handle.on_error is not None:
            handle.on_error(EngineError(message))

    def update(self, free_slots: int, stats: RunnerStats, steps) -> None:
        self.free_slots, self.stats = free_slots, stats
        if self.on_step is not None:
            for seconds, batch in steps:
                self.on_step(seconds, batch)

    def lost(self) -> None:
        self.free_slots = 0
        handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            if handle.on_error is not None and not handle.closed:
                handle.on_error(EngineError("the engine process is gone"))

    def forget(self, handle: RemoteSlotHandle) -> None:
        if self._handles.get(handle.slot) is handle:
            del self._handles[handle.slot]


@dataclass(frozen=True)
class _RemoteBatch:
    """What a session reads of the engine: its slot count, a session's default sampling, its device."""

    batch_size: int
    default_sampling: Sampling | None
    device: str = "cpu"

    @property
    def sampler(self) -> _Defaults:
        return _Defaults(self.default_sampling)


@dataclass(frozen=True)
class _Defaults:
    default: Sampling | None


class RemoteSlotHandle:
    """A session's hold on a slot of the host's runner: like `SlotHandle`, its pushes never block (they are
    queued for this front's writer thread), and a released handle refuses pushes silently."""

    def __init__(self, runner: RemoteRunner, slot: int, generation: int, on_output: OutputCallback,
                 on_error: ErrorCallback | None) -> None:
        self.runner, self.slot, self.generation = runner, slot, generation
        self.on_output, self.on_error = on_output, on_error
        self.closed = False
        self.dropped = 0
        self._released: concurrent.futures.Future | None = None

    @property
    def dropped_frames(self) -> int:
        """Frames of this acquisition the host never stepped (as of its latest output)."""
        return self.dropped

    def push_frame(self, pcm: np.ndarray) -> None:
        if self.closed:
            return
        self.runner.remote.enqueue(("frame", self.runner.name, self.slot, self.generation, checked_frame(pcm)))

    def push_oracle(self, update: OracleUpdate) -> None:
        if not self.closed:
            self.runner.remote.enqueue(("oracle", self.runner.name, self.slot, self.generation, update))

    def release(self) -> concurrent.futures.Future:
        """Give the slot back; the future is done once the host has freed it."""
        if not self.closed:
            self.closed = True
            self.runner.forget(self)
            runner = self.runner
            self._released = runner.remote.request(
                lambda request: Release(request, runner.name, self.slot, self.generation))
        return self._released
