"""The engine in a process of its own (kame/frontend/remote.py, engine_host.py): a real host process on a
Unix socket, fronts in this process; sessions through it equal the engine alone, slots are the host's (never
two holders), a front that goes gives its slots back, and a host that dies fails its sessions instead of
hanging them."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import secrets
import signal
import threading

import numpy as np
import pytest

from kame.errors import EngineError, SlotsBusy
from kame.frontend.oracle import OracleUpdate
from kame.frontend.remote import RemoteEngine, _gather

from .conftest import noise_frames
from .test_engine import assert_same, run_alone

SLOTS = 3


def _host_main(address: str, authkey: bytes, ready) -> None:
    import torch

    from kame.frontend.engine import BatchedEngine, GenerationConfig
    from kame.frontend.engine_host import EngineHost
    from kame.frontend.loader import load_frontend
    from kame.frontend.runner import EngineRunner

    torch.set_num_threads(1)
    engine = BatchedEngine(load_frontend("tiny", "cpu"), SLOTS, gen=GenerationConfig(use_sampling=False))
    runner = EngineRunner(engine, clock="eager", batch_window_s=0.0, jitter_frames=None).start()
    host = EngineHost({"engine": runner}, address, authkey, extra={"source": "tiny"}, status_s=0.1)
    ready.set()
    host.serve_forever()


@pytest.fixture
def host(tmp_path):
    """(address, authkey, process): an engine host on the tiny model, in a process of its own."""
    context = multiprocessing.get_context("spawn")
    address, authkey = str(tmp_path / "engine.sock"), secrets.token_bytes(16)
    ready = context.Event()
    process = context.Process(target=_host_main, args=(address, authkey, ready), daemon=True)
    process.start()
    assert ready.wait(120), "the engine host did not start"
    yield address, authkey, process
    process.kill()
    process.join(10)


class _Collector:
    """A session's side: outputs in order, errors, and an event when `count` outputs came."""

    def __init__(self, count: int = 0) -> None:
        self.outputs, self.errors, self.count = [], [], count
        self.done = threading.Event()

    def on_output(self, output) -> None:
        self.outputs.append(output)
        if len(self.outputs) >= self.count:
            self.done.set()

    def on_error(self, exc) -> None:
        self.errors.append(exc)
        self.done.set()


def _speak(handle, collector, frames, oracle_at) -> None:
    """Push one frame at a time and wait for its output (self-paced, as a file client)."""
    for index, frame in enumerate(frames):
        if index in oracle_at:
            handle.push_oracle(oracle_at[index])
        collector.count, _ = index + 1, collector.done.clear()
        handle.push_frame(frame)
        assert collector.done.wait(30), f"frame {index} did not come back"


@pytest.mark.slow
def test_sessions_through_the_host_equal_the_engine_alone(host, tiny, rng):
    address, authkey, _ = host
    remote = RemoteEngine(address, authkey)
    try:
        runner = remote.runner("engine")
        assert (runner.engine.batch_size, remote.info.extra["source"]) == (SLOTS, "tiny")
        frames = {"a": noise_frames(rng, 10), "b": noise_frames(rng, 10, scale=0.3)}
        oracles = {"a": {1: OracleUpdate.reset(0, (10, 11, 12))}, "b": {3: OracleUpdate.reset(0, (40, 41))}}
        got, handles, threads = {}, [], []
        for name in "ab":
            collector = got[name] = _Collector()
            handles.append(runner.acquire(collector.on_output, collector.on_error, live=False))
            threads.append(threading.Thread(target=_speak, args=(handles[-1], collector, frames[name],
                                                                 oracles[name])))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        concurrent.futures.wait([handle.release() for handle in handles], 30)
        assert runner.free_slots == SLOTS
    finally:
        remote.close()
    for name in "ab":
        assert not got[name].errors
        assert_same(got[name].outputs, run_alone(tiny, frames[name], oracles[name]))


@pytest.mark.slow
def test_two_fronts_never_hold_one_slot(host):
    """Two fronts ask for more slots than there are, at once: exactly SLOTS are granted, the rest refused
    busy; once one front gives its slots back, the other gets them."""
    address, authkey, _ = host
    fronts = [RemoteEngine(address, authkey), RemoteEngine(address, authkey)]
    try:
        futures = [front.runner("engine").acquire_future(lambda out: None) for front in fronts for _ in range(SLOTS)]
        granted, refused = [], 0
        for future in futures:
            try:
                granted.append(future.result(30))
            except SlotsBusy:
                refused += 1
        assert len(granted) == SLOTS and refused == SLOTS
        assert len({handle.slot for handle in granted}) == SLOTS
        mine = [handle for handle in granted if handle.runner.remote is fronts[0]]
        concurrent.futures.wait([handle.release() for handle in mine], 30)
        again = [fronts[1].runner("engine").acquire(lambda out: None) for _ in mine]
        assert sorted(handle.slot for handle in again) == sorted(handle.slot for handle in mine)
    finally:
        for front in fronts:
            front.close()


@pytest.mark.slow
def test_a_front_that_goes_gives_its_slots_back(host):
    address, authkey, _ = host
    leaving, staying = RemoteEngine(address, authkey), RemoteEngine(address, authkey)
    try:
        for _ in range(SLOTS):
            leaving.runner("engine").acquire(lambda out: None)
        runner = staying.runner("engine")
        with pytest.raises(SlotsBusy):
            runner.acquire(lambda out: None)
        leaving.close()  # its process ends, say: the host releases what it held
        handles = [runner.acquire(lambda out: None, timeout=30) for _ in _retry_until_free(runner, SLOTS)]
        assert len(handles) == SLOTS
    finally:
        staying.close()


def _retry_until_free(runner, wanted: int, timeout_s: float = 30.0):
    """Wait (on the host's status) until `wanted` slots are free; yields `wanted` times."""
    deadline = threading.Event()
    timer = threading.Timer(timeout_s, deadline.set)
    timer.start()
    try:
        while runner.free_slots < wanted and not deadline.wait(0.05):
            pass
    finally:
        timer.cancel()
    assert runner.free_slots >= wanted, f"only {runner.free_slots} slots free"
    return range(wanted)


@pytest.mark.slow
def test_a_dead_host_fails_its_sessions_and_new_ones(host):
    address, authkey, process = host
    remote = RemoteEngine(address, authkey)
    try:
        collector = _Collector(count=1)
        handle = remote.runner("engine").acquire(collector.on_output, collector.on_error)
        os.kill(process.pid, signal.SIGKILL)
        assert collector.done.wait(30) and isinstance(collector.errors[0], EngineError)
        with pytest.raises(EngineError, match="gone"):
            remote.runner("engine").acquire(lambda out: None, timeout=5)
        assert remote.runner("engine").free_slots == 0
        handle.push_frame(np.zeros(1920, np.float32))  # nothing raises: the session ends through its error
        with pytest.raises(EngineError):
            handle.release().result(5)
    finally:
        remote.close()


def test_pushes_are_gathered_in_order():
    frame = np.zeros(1920, np.float32)
    update = OracleUpdate.reset(0, (1,))
    release = object()
    items = [("frame", "engine", 0, 1, frame), ("oracle", "engine", 0, 1, update), ("frame", "engine", 1, 2, frame),
             release, ("frame", "engine", 0, 1, frame), ("frame", "asr", 0, 5, frame)]
    messages = _gather(items)
    assert [getattr(m, "runner", m) for m in messages] == ["engine", release, "engine", "asr"]
    assert [(s, g) for s, g, _ in messages[0].frames] == [(0, 1), (1, 2)]
    assert [(s, g) for s, g, _ in messages[0].oracles] == [(0, 1)]
    assert len(messages[2].frames) == 1 and len(messages[3].frames) == 1


def test_a_wrong_frame_is_refused_in_the_front(host):
    address, authkey, _ = host
    remote = RemoteEngine(address, authkey)
    try:
        handle = remote.runner("engine").acquire(lambda out: None)
        with pytest.raises(EngineError, match="1920 samples"):
            handle.push_frame(np.zeros(100, np.float32))
        with pytest.raises(EngineError, match="NaN"):
            handle.push_frame(np.full(1920, np.nan, np.float32))
    finally:
        remote.close()


def test_a_stalled_peer_loses_its_oldest_frames_never_a_request():
    from collections import deque

    from kame.frontend.remote_wire import MAX_QUEUED, Release, drop_oldest

    queue = deque([Release(1, "engine", 0, 1)] + [("frame", "engine", 0, 1, index) for index in range(MAX_QUEUED)])
    drop_oldest(queue, tuple)
    assert isinstance(queue[0], Release) and queue[1][4] == 1 and len(queue) == MAX_QUEUED
