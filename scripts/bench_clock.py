"""Frame-clock benchmark: real-time sessions out of phase on the tiny-copy front-end, tick vs eager clock.

    python scripts/bench_clock.py [--sessions 8] [--spread-ms 10] [--seconds 5]

Each session pushes one frame every 80 ms on an absolute schedule, session i offset by i x spread.
Rows: N sessions, 1 session, and an overload where every step is padded with an artificial sleep
to 1.5 x the frame (the compute stays real; the sleep costs no CPU). The engine has N slots in every
row (a server's batch size is fixed) and one intra-op thread, as the server runs it on a CPU.
Latency: a frame pushed (on the event loop) -> its output received back on the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kame.frontend.engine import FRAME_SIZE, BatchedEngine
from kame.frontend.loader import Frontend, load_frontend
from kame.frontend.runner import EngineRunner

FRAME_S = 0.08
MARK = 1e-4  # sample 0 of a pushed frame is its index x MARK, so every output maps back to its input


@dataclass
class Row:
    scenario: str
    clock: str
    sessions: int
    seconds: float
    steps: int = 0
    frames_stepped: int = 0
    cpu_s: float = 0.0  # engine thread CPU time inside engine.step
    overruns: int = 0
    skipped: int = 0
    latencies: list[float] = field(default_factory=list)

    def cells(self) -> list[str]:
        lat = sorted(self.latencies) or [float("nan")]
        p95 = lat[min(len(lat) - 1, int(0.95 * len(lat)))]
        return [self.scenario, self.clock, str(self.sessions), f"{self.steps / self.seconds:.1f}",
                f"{self.frames_stepped / max(1, self.steps):.2f}", f"{self.cpu_s / self.seconds:.3f}",
                f"{statistics.median(lat) * 1000:.1f}", f"{p95 * 1000:.1f}", f"{lat[-1] * 1000:.1f}",
                str(self.overruns), str(self.skipped)]


class InstrumentedStep:
    """Wraps `engine.step` (engine thread): CPU time, optional padding, and which input each slot stepped."""

    def __init__(self, engine: BatchedEngine, pad_to_s: float | None) -> None:
        self.original, self.pad_to_s = engine.step, pad_to_s
        self.cpu_s = 0.0
        self.stepped: dict[int, int] = {}  # slot -> index of the frame it stepped last
        engine.step = self  # type: ignore[method-assign]

    def __call__(self, frames, timings=None):
        self.stepped = {slot: round(float(frame[0]) / MARK) for slot, frame in frames.items()}
        started, cpu = time.perf_counter(), time.thread_time()
        outputs = self.original(frames, timings)
        self.cpu_s += time.thread_time() - cpu
        if self.pad_to_s is not None:
            time.sleep(max(0.0, self.pad_to_s - (time.perf_counter() - started)))
        return outputs


async def run_sessions(runner: EngineRunner, step: InstrumentedStep, row: Row, spread_s: float) -> None:
    loop = asyncio.get_running_loop()
    frames = round(row.seconds / FRAME_S)
    pushed = [dict() for _ in range(row.sessions)]  # per session: frame index -> push time
    pushing, drained = True, asyncio.Event()

    def all_back() -> bool:  # every frame pushed came back or was dropped
        return sum(map(len, pushed)) == sum(handle.dropped_frames for handle in handles)

    def receiver(index: int):
        def received(frame: int) -> None:
            row.latencies.append(time.monotonic() - pushed[index].pop(frame))
            if not pushing and all_back():
                drained.set()
        return lambda out: loop.call_soon_threadsafe(received, step.stepped[out.slot])

    handles = [await runner.acquire_async(receiver(i)) for i in range(row.sessions)]
    start = loop.time() + 0.05

    async def session(index: int) -> None:
        for k in range(frames):
            await asyncio.sleep(max(0.0, start + index * spread_s + k * FRAME_S - loop.time()))
            frame = np.zeros(FRAME_SIZE, dtype=np.float32)
            frame[0] = k * MARK
            pushed[index][k] = time.monotonic()
            handles[index].push_frame(frame)

    async with asyncio.TaskGroup() as group:
        for index in range(row.sessions):
            group.create_task(session(index), name=f"session-{index}")
    pushing = False
    if not all_back():
        backlog_s = runner.max_pending_frames * (step.pad_to_s or FRAME_S)
        try:
            await asyncio.wait_for(drained.wait(), backlog_s + 1.0)
        except TimeoutError:
            print(f"{row.scenario}/{row.clock}: {sum(map(len, pushed))} frames never came back", file=sys.stderr)
    for handle in handles:
        handle.release()
    await asyncio.to_thread(runner.stop)  # no output may reach this loop once it is closed


def measure(frontend: Frontend, slots: int, row: Row, spread_s: float, pad_to_s: float | None = None) -> Row:
    engine = BatchedEngine(frontend, slots)
    step = InstrumentedStep(engine, pad_to_s)
    try:
        with EngineRunner(engine, clock=row.clock, torch_threads=1) as runner:
            runner.warm_up()
            before, cpu = runner.stats.steps, step.cpu_s
            stepped = runner.stats.frames_stepped
            asyncio.run(run_sessions(runner, step, row, spread_s))
            row.steps, row.frames_stepped = runner.stats.steps - before, runner.stats.frames_stepped - stepped
            row.cpu_s, row.overruns, row.skipped = step.cpu_s - cpu, runner.stats.overruns, runner.stats.skipped_frames
    finally:
        engine.close()
    return row


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def print_table(rows: list[Row]) -> None:
    head = ["scenario", "clock", "sess", "steps/s", "batch", "cpu s/s", "p50 ms", "p95 ms", "max ms",
            "overruns", "skipped"]
    table = [head] + [row.cells() for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    for line in table:
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)))
    print()
    print("tick / eager            steps/s   cpu s/s   p50 latency")
    for tick, eager in zip(rows[::2], rows[1::2], strict=True):
        lat_t, lat_e = statistics.median(tick.latencies), statistics.median(eager.latencies)
        print(f"{tick.scenario:<22}  {ratio(tick.steps, eager.steps):>7}   {ratio(tick.cpu_s, eager.cpu_s):>7}"
              f"   {ratio(lat_t, lat_e):>11}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--spread-ms", type=float, default=10.0, help="phase offset between sessions")
    parser.add_argument("--seconds", type=float, default=5.0, help="audio per session and row")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    frontend = load_frontend("tiny-copy", "cpu")
    spread, n = args.spread_ms / 1000, args.sessions
    rows = []
    for scenario, sessions, pad in ((f"{n} sessions", n, None), ("1 session", 1, None),
                                    (f"overload {n} x 1.5f", n, 1.5 * FRAME_S)):
        for clock in ("tick", "eager"):
            rows.append(measure(frontend, n, Row(scenario, clock, sessions, args.seconds), spread, pad))
    print(f"tiny-copy on CPU, {n} slots, 1 engine thread, {args.seconds:g} s per row, sessions "
          f"{args.spread_ms:g} ms apart; overload = every step padded with a sleep to {1.5 * FRAME_S * 1000:.0f} ms")
    print()
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
