"""The same benchmarks of this tree under two Python environments, alternated in one run: what a
dependency upgrade (torch 2.9.1 -> 2.15.0, docs/benchmarks-history.md, "torch 2.9.1 against 2.15.0") did to
the engine step and to the server under load, with this VM's drift within a sitting shown by the rounds.

    python scripts/bench_envs.py torch-2.9.1=/tmp/venv-torch291/bin/python torch-2.15.0=.venv/bin/python

Each round runs, for each environment in turn: `kame bench frontend` (the tiny front-end on the CPU,
one torch thread: ms per frame by batch size), then `kame serve --frontend tiny --asr none` under
`kame bench load` (round trip, engine step and server CPU by session count). One load generator
for every server: the last environment's. The tree is this one, by PYTHONPATH, so only the
environment differs. An environment that is another one plus a different torch: a venv holding only
that torch, and a `.pth` file in it that runs `site.addsitedir(OTHER_SITE_PACKAGES)` (its own torch
comes first on the path).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_env(python: str, args: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "KAME_MAX_CONNECTIONS_PER_IP": "64"}
    return subprocess.run([python, "-m", "kame.cli", *args], cwd=ROOT, env=env, check=True, **kwargs)


def torch_version(python: str) -> str:
    return subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                          text=True, check=True).stdout.strip()


def engine_step(python: str, out: Path, batches: str, frames: int) -> dict:
    run_env(python, ["bench", "frontend", "--frontend", "tiny", "--device", "cpu", "--batch-sizes", batches,
                     "--frames", str(frames), "--json-out", str(out)], capture_output=True)
    return {row["batch"]: row for row in json.loads(out.read_text())["rows"]}


def load(python: str, client: str, out: Path, levels: str, seconds: int, port: int) -> dict:
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "KAME_MAX_CONNECTIONS_PER_IP": "64"}
    with open(out.with_suffix(".log"), "w") as log:
        server = subprocess.Popen([python, "-m", "kame.cli", "serve", "--frontend", "tiny", "--device", "cpu",
                                   "--asr", "none", "--llm", "local", "--max-sessions", "16", "--port", str(port)],
                                  cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"the server under {python} did not start: {out.with_suffix('.log')}")
                time.sleep(0.5)
        run_env(client, ["bench", "load", "--url", f"ws://127.0.0.1:{port}/api/chat", "--levels", levels,
                         "--seconds", str(seconds), "--server-pid", str(server.pid), "--json-out", str(out)],
                capture_output=True)
    finally:
        server.send_signal(2)
        server.wait(60)
    return {row["sessions"]: row for row in json.loads(out.read_text())["levels"]}


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 2) if values else None


def report(names: list[str], versions: dict, steps: dict, loads: dict) -> None:
    print("Engine step (`kame bench frontend --frontend tiny --device cpu`, one torch thread), ms per frame, "
          "median of the rounds (each round's own in brackets):\n")
    print("| batch | " + " | ".join(f"{n} (torch {versions[n]})" for n in names) + " | ratio |")
    print("|---:|" + "---:|" * (len(names) + 1))
    for batch in sorted(steps[names[0]][0]):
        cells = [(median([r[batch]["frame_ms"] for r in steps[n]]), [r[batch]["frame_ms"] for r in steps[n]])
                 for n in names]
        ratio = cells[-1][0] / cells[0][0] if cells[0][0] else float("nan")
        print(f"| {batch} | " + " | ".join(f"{m} ({', '.join(map(str, each))})" for m, each in cells)
              + f" | {ratio:.2f} |")
    print("\nThe server under load (`kame serve --frontend tiny --asr none`, `kame bench load`), median of the "
          "rounds:\n")
    print("| sessions | env | round trip p50 / p99 ms | engine step ms | server CPU cores | late frames |")
    print("|---:|---|---|---:|---:|---:|")
    for level in sorted(loads[names[0]][0]):
        for n in names:
            rows = [r[level] for r in loads[n]]
            print(f"| {level} | {n} | {median([r['round_trip_ms']['p50'] for r in rows])} / "
                  f"{median([r['round_trip_ms']['p99'] for r in rows])} | "
                  f"{median([r['engine_step_ms'] for r in rows])} | {median([r['server_cpu_cores'] for r in rows])} | "
                  f"{median([r['frames_late'] for r in rows])} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("envs", nargs=2, metavar="NAME=PYTHON", help="two environments' interpreters")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--frames", type=int, default=50)
    parser.add_argument("--levels", default="1,4,8")
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--port", type=int, default=18991)
    args = parser.parse_args()
    envs = dict(spec.split("=", 1) for spec in args.envs)
    names = list(envs)
    versions = {n: torch_version(p) for n, p in envs.items()}
    client = envs[names[-1]]
    steps: dict = {n: [] for n in names}
    loads: dict = {n: [] for n in names}
    work = Path(tempfile.mkdtemp(prefix="bench-envs-"))
    for round_ in range(1, args.rounds + 1):
        for n in names:
            print(f"round {round_}: {n} (torch {versions[n]})", file=sys.stderr, flush=True)
            steps[n].append(engine_step(envs[n], work / f"step-{n}-{round_}.json", args.batches, args.frames))
            loads[n].append(load(envs[n], client, work / f"load-{n}-{round_}.json", args.levels, args.seconds,
                                 args.port))
    report(names, versions, steps, loads)
    print(f"\n(raw results: {work})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
