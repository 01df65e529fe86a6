"""The engine process's side of kame/frontend/remote.py: an `EngineHost` serves its warm runners to the front
processes over a Unix socket, one reader and one writer thread per front, and owns every slot."""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection, Listener

from kame.errors import SlotsBusy
from kame.frontend.remote_wire import (
    MAX_QUEUED,
    STATUS_S,
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
from kame.frontend.runner import EngineRunner, RunnerStats
from kame.frontend.sampling import Sampling
from kame.frontend.slots import SlotHandle, Stamped

logger = logging.getLogger(__name__)


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
                drop_oldest(self._queue, Outputs)
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


def _default_sampling(runner: EngineRunner) -> Sampling | None:
    sampler = getattr(runner.engine, "sampler", None)
    return None if sampler is None else sampler.default


def _copy_stats(stats: RunnerStats) -> RunnerStats:
    return RunnerStats(stats.steps, stats.frames_stepped, stats.stale_dropped, stats.skipped_frames, stats.overruns)
