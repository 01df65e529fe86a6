"""The lock that lets `realtime` tests run alone on several pytest-xdist workers (tests/workers.py)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
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


# ------------------------------------------------------------------ the scheduling, on real xdist workers

_SUITE_CONFTEST = '''
import json, os, time
import pytest
from tests.conftest import (pytest_configure, pytest_configure_node, pytest_runtest_call,  # noqa: F401
                            pytest_runtest_protocol, pytest_unconfigure, pytest_xdist_make_scheduler)
from tests.workers import order

def pytest_collection_modifyitems(config, items):
    order(config, items)

def note(name, began):
    with open(os.environ["SPANS"], "a") as out:
        out.write(json.dumps([name, os.environ["PYTEST_XDIST_WORKER"], began, time.time()]) + "\\n")

@pytest.fixture
def slow_setup():
    began = time.time()
    time.sleep(0.6)
    note("setup", began)
'''

_SUITE_A = '''
import time
import pytest
from conftest import note

def test_a1():
    began = time.time(); time.sleep(0.1); note("a1", began)

@pytest.mark.realtime
def test_a_alone(slow_setup):
    began = time.time(); time.sleep(0.5); note("alone", began)

def test_a2():
    began = time.time(); time.sleep(0.1); note("a2", began)
'''

_SUITE_C = '''
import time
import pytest
from conftest import note

@pytest.mark.parametrize("n", range(3))
def test_c(n):
    began = time.time(); time.sleep(0.3); note(f"c{n}", began)
'''


_SUITE_B = '''
import time
import pytest
from conftest import note

@pytest.mark.parametrize("n", range(8))
def test_b(n):
    began = time.time(); time.sleep(0.4); note(f"b{n}", began)
'''


@pytest.mark.timeout(180)
def test_a_files_realtime_tests_go_out_last_and_only_their_calls_are_alone(tmp_path):
    """Two workers: a file's `realtime` test is a unit of its own, handed out after the ordinary ones
    (so after its own file's later test, and after test_c.py, which goes to the same worker once
    test_a.py's two ordinary tests are all it has left); its set-up runs beside the other worker's
    tests, its call beside none of them."""
    import json
    import subprocess
    import sys

    files = {"conftest.py": _SUITE_CONFTEST, "test_a.py": _SUITE_A, "test_b.py": _SUITE_B, "test_c.py": _SUITE_C}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    spans_file = tmp_path / "spans.jsonl"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider", "-W", "ignore", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=150,
        env={**os.environ, "SPANS": str(spans_file), "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    spans = {name: (worker, began, ended) for name, worker, began, ended in map(json.loads, spans_file.open())}
    assert len(spans) == 15
    alone, setup = spans["alone"], spans["setup"]
    others = {name: span for name, span in spans.items() if name[0] in "abc" and name != "alone"}
    beside = [span for span in others.values() if span[0] != alone[0]]
    assert beside, "the other worker ran the b tests"
    assert spans["a2"][2] <= alone[1]  # the realtime test after its file's later test ...
    assert all(spans[f"c{n}"][2] <= alone[1] for n in range(3)), spans  # ... and after the next file
    assert not any(overlaps(alone, span) for span in others.values()), spans  # its call alone ...
    assert any(overlaps(setup, span) for span in beside), spans  # ... its set-up not
