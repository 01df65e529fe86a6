"""The suite on several pytest-xdist workers (README's `python -m pytest -n auto`) without weakening the
tests that promise real time.

A test marked `realtime` asserts what holds only at real-time pace: a frame out for each frame in, few
frames dropped, an answer in place before the user stops, a wall-clock bound. Beside a second busy
worker those fail (docs/benchmarks.md, "The test suite on two workers"), so:

- each worker runs a test inside a lock shared by all workers: shared for ordinary tests and for a
  `realtime` test's set-up and tear-down, exclusive for a `realtime` test's own run (its call), behind
  a turnstile so that a waiting `realtime` test waits only for the tests the other workers are
  running, and they start nothing new until it is done;
- a test whose real-time part is short beside the rest of it (a server that loads models first)
  takes the machine for that part only, `with alone():` (a fixture);
- work is handed out a file at a time (a module's fixtures are set up once), but a file's `realtime`
  tests are a unit of their own: the slowest files first, then the rest in collection order, then the
  `realtime` units, so that the exclusive stretches come together at the end of the run, where
  nothing long runs beside them to wait for (a file split so sets its module fixtures up
  twice, unless one worker runs its two units one after the other).

Run serially (no `-n`), none of this does anything.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# The slowest files of the serial suite, slowest first (docs/benchmarks.md): each goes to a worker as
# soon as it asks for work, so that none of them is the long tail of the run. A file missing here only
# runs later; a stale entry costs nothing. (Not test_ray.py: a Ray instance's own processes slow the
# other worker down, least beside the lighter files of the middle of the run.)
SLOWEST_FIRST = (
    "tests/test_training_e2e.py",
    "tests/test_training.py",
    "tests/test_recipe.py",
    "tests/test_eval.py",
    "tests/test_eval_robustness.py",
    "tests/test_first_run.py",
    "tests/test_tools_e2e.py",
    "tests/test_embedded_llm.py",
    "tests/test_training_data.py",
    "tests/test_hub_layouts.py",
    "tests/test_aec.py",
)


_TURNSTILE = pytest.StashKey["Turnstile"]()
_REALTIME_IDS = "realtime-tests"  # in the lock's folder: the ids of the `realtime` tests, a line each
_FOLDER = pytest.StashKey[Path]()


class Turnstile:
    """A readers-writer lock between processes, writers first: two `flock`ed files in one folder."""

    def __init__(self, folder: Path) -> None:
        self._gate = open(folder / "gate", "a+b")  # noqa: SIM115 (held for the worker's life)
        self._room = open(folder / "room", "a+b")  # noqa: SIM115

    @contextmanager
    def alone(self, then: int = fcntl.LOCK_UN) -> Iterator[None]:
        """The machine to this process; `then`: what it keeps of the room before the gate opens."""
        fcntl.flock(self._gate, fcntl.LOCK_EX)  # no one starts a test from here on ...
        try:
            fcntl.flock(self._room, fcntl.LOCK_EX)  # ... and those running finish
            try:
                yield
            finally:
                fcntl.flock(self._room, then)
        finally:
            fcntl.flock(self._gate, fcntl.LOCK_UN)

    @contextmanager
    def shared(self) -> Iterator[None]:
        fcntl.flock(self._gate, fcntl.LOCK_EX)  # wait behind a realtime test that waits
        fcntl.flock(self._gate, fcntl.LOCK_UN)
        fcntl.flock(self._room, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(self._room, fcntl.LOCK_UN)

    @contextmanager
    def alone_within_shared(self) -> Iterator[None]:
        """Inside `shared`: the machine to this process for a while, then shared again (before the
        gate opens). The shared lock goes first, so two workers asking at once do not wait for each
        other forever."""
        fcntl.flock(self._room, fcntl.LOCK_UN)
        with self.alone(then=fcntl.LOCK_SH):
            yield

    def close(self) -> None:
        self._gate.close()
        self._room.close()


def configure(config: pytest.Config) -> None:
    """Each worker opens the lock's folder, which the controller made (`configure_node`)."""
    if hasattr(config, "workerinput") and config.workerinput.get("kame_turnstile"):
        config.stash[_TURNSTILE] = Turnstile(Path(config.workerinput["kame_turnstile"]))


def unconfigure(config: pytest.Config) -> None:
    turnstile = config.stash.get(_TURNSTILE, None)
    if turnstile is not None:
        turnstile.close()
    folder = config.stash.get(_FOLDER, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def configure_node(node) -> None:
    """On the controller, as each worker starts: the lock's folder, made for the first one."""
    if _FOLDER not in node.config.stash:
        node.config.stash[_FOLDER] = Path(tempfile.mkdtemp(prefix="kame-pytest-workers-"))
    node.workerinput["kame_turnstile"] = str(node.config.stash[_FOLDER])


def order(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a worker: the slowest files first, the `realtime` tests last (every worker sorts its
    collection the same way, which xdist checks); the `realtime` tests' ids are left in the lock's
    folder for the controller's scheduler (`make_scheduler`)."""
    if not hasattr(config, "workerinput"):
        return
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(item.nodeid.split("::", 1)[0], len(first_seen))
    realtime = {item.nodeid for item in items if item.get_closest_marker("realtime")}
    if config.workerinput.get("kame_turnstile"):
        _write_realtime(Path(config.workerinput["kame_turnstile"]), realtime)

    def rank(item: pytest.Item) -> tuple[int, int]:
        path = item.nodeid.split("::", 1)[0]
        if item.nodeid in realtime:
            return 2, first_seen[path]
        if path in SLOWEST_FIRST:
            return 0, SLOWEST_FIRST.index(path)
        return 1, first_seen[path]

    items.sort(key=rank)  # stable: a file's own tests keep their order


def _write_realtime(folder: Path, realtime: set[str]) -> None:
    """Every worker writes the same ids; each replaces the file whole, so a reader sees one of them."""
    partial = folder / f"{_REALTIME_IDS}.{os.getpid()}"
    partial.write_text("".join(f"{nodeid}\n" for nodeid in sorted(realtime)))
    os.replace(partial, folder / _REALTIME_IDS)


def scope(nodeid: str, realtime: set[str] | frozenset[str]) -> str:
    """The unit of work a test is handed out in: its file, or its file's `realtime` tests."""
    path = nodeid.split("::", 1)[0]
    return f"{path}::realtime" if nodeid in realtime else path


@contextmanager
def running(item: pytest.Item) -> Iterator[None]:
    """Around a whole test (set-up, call, tear-down): the machine shared."""
    turnstile = item.config.stash.get(_TURNSTILE, None)
    if turnstile is None:
        yield
    else:
        with turnstile.shared():
            yield


@contextmanager
def calling(item: pytest.Item) -> Iterator[None]:
    """Around a test's call, inside `running`: a `realtime` test's call has the machine to itself."""
    turnstile = item.config.stash.get(_TURNSTILE, None)
    if turnstile is None or not item.get_closest_marker("realtime"):
        yield
    else:
        with turnstile.alone_within_shared():
            yield


@contextmanager
def alone(item: pytest.Item) -> Iterator[None]:
    """The real-time part of a test that is not `realtime` as a whole (the rest of it is long and
    needs no quiet machine): `with alone(): ...` through the fixture of that name."""
    turnstile = item.config.stash.get(_TURNSTILE, None)
    if turnstile is None or item.get_closest_marker("realtime"):
        yield
    else:
        with turnstile.alone_within_shared():
            yield


def make_scheduler(config: pytest.Config, log):
    """A file at a time, its `realtime` tests apart (`scope`), in the order the workers sorted (xdist's
    own `loadfile` would re-sort the files by their number of tests)."""
    if config.getoption("dist") != "load":
        return None  # an explicit --dist is the caller's choice
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        realtime: frozenset[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.realtime is None:  # first asked once every worker has sent its collection
                written = config.stash[_FOLDER] / _REALTIME_IDS
                self.realtime = frozenset(written.read_text().split()) if written.exists() else frozenset()
            return scope(nodeid, self.realtime)

    config.option.loadscopereorder = False
    return Scheduling(config, log)


def auto_workers() -> int:
    """`-n auto`: a worker per core, at most 4 (each holds its own models and servers)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))
