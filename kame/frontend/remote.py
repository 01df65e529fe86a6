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

This module is the front's side; the host's is kame/frontend/engine_host.py, the messages between them
kame/frontend/remote_wire.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Client

import numpy as np

from kame.errors import EngineError, SessionError, SlotsBusy
from kame.frontend.oracle import OracleUpdate
from kame.frontend.remote_wire import (
    MAX_QUEUED,
    Acquire,
    Acquired,
    HostInfo,
    Outputs,
    Pushes,
    Refused,
    Release,
    Released,
    SlotFailed,
    Status,
    drop_oldest,
)
from kame.frontend.runner import RunnerStats
from kame.frontend.sampling import Sampling
from kame.frontend.slots import ErrorCallback, OutputCallback, checked_frame, release_if_acquired

logger = logging.getLogger(__name__)


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
                drop_oldest(self._queue, tuple)
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
                            live: bool = True, sampling: Sampling | None = None,
                            prompt: Sequence = ()) -> RemoteSlotHandle:
        if prompt:
            raise SessionError("a persona's prompt is not prefilled over a remote engine yet: serve persona "
                               "sessions from one process (kame serve without --fronts)")
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
