"""The lock that lets `realtime` tests run alone on several pytest-xdist workers (tests/workers.py)."""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from pathlib import Path

import pytest

from .workers import Turnstile


def _hold(folder: str, alone: bool | str, start_at: float, hold_s: float, out) -> None:
    """Hold the lock: alone (True), shared (False), or shared and then alone for a while inside it
    ("inside"; the span reported is the part alone)."""
    turnstile = Turnstile(Path(folder))
    time.sleep(max(0.0, start_at - time.time()))
    with contextlib.ExitStack() as held:
        if alone == "inside":
            held.enter_context(turnstile.shared())
            time.sleep(0.2)
            held.enter_context(turnstile.alone_within_shared())
        else:
            held.enter_context(turnstile.alone() if alone else turnstile.shared())
        began = time.time()
        time.sleep(hold_s)
        out.put((alone, began, time.time()))
    turnstile.close()


def _run(folder: Path, plan: list[tuple[bool | str, float, float]]) -> list[tuple[bool | str, float, float]]:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    zero = time.time() + 1.0  # every process is up by then
    processes = [context.Process(target=_hold, args=(str(folder), alone, zero + at, hold, out))
                 for alone, at, hold in plan]
    for process in processes:
        process.start()
    spans = [out.get(timeout=30) for _ in processes]
    for process in processes:
        process.join(timeout=30)
    return [(alone, began - zero, ended - zero) for alone, began, ended in spans]


def overlaps(a: tuple[bool | str, float, float], b: tuple[bool | str, float, float]) -> bool:
    return a[1] < b[2] and b[1] < a[2]


@pytest.mark.timeout(120)
def test_a_test_alone_overlaps_none_and_others_wait_behind_it(tmp_path):
    # two ordinary tests run together; one marked realtime asks while they run, a third ordinary one
    # asks after it: the realtime test waits for the two, and the third waits for the realtime test
    plan = [(False, 0.0, 1.0), (False, 0.0, 1.0), (True, 0.3, 0.8), (False, 0.6, 0.3)]
    spans = _run(tmp_path, plan)
    alone = [s for s in spans if s[0]]
    shared = sorted((s for s in spans if not s[0]), key=lambda s: s[1])
    assert len(alone) == 1 and len(shared) == 3
    assert overlaps(shared[0], shared[1])  # ordinary tests share the machine
    assert not any(overlaps(alone[0], s) for s in shared), spans
    assert shared[2][1] >= alone[0][2]  # the late one was not let in past the waiting realtime test


@pytest.mark.timeout(120)
def test_two_tests_taking_the_machine_inside_a_shared_hold_take_turns(tmp_path):
    # both hold the shared lock when they ask: each gives it up first, so neither waits for the other
    # forever, and their parts alone do not overlap each other or a realtime test
    spans = _run(tmp_path, [("inside", 0.0, 0.6), ("inside", 0.0, 0.6), (True, 0.1, 0.4)])
    assert len(spans) == 3
    assert not any(overlaps(a, b) for i, a in enumerate(spans) for b in spans[i + 1:]), spans
