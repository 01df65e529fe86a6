"""What Ray Serve's proxy costs per audio frame: `kame bench load`'s sessions through `kame serve
--ray` (one replica) and against a plain `kame serve` with the same settings, level by level,
side by side in one run; with the proxy's and the servers' CPU per session.

    python scripts/bench_ray.py --levels 1,4,8 --seconds 10

On a CPU with tiny-copy (the default) it shows the proxy's share of a frame's round trip; on a GPU
machine pass --frontend and --device cuda. Prints a markdown table; --json-out keeps the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from client.bench import wait_for_free_slots  # noqa: E402
from client.loadgen import load_level, percentile_ms  # noqa: E402


def cpu_s(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def ray_processes(kind: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(kind in part for part in process.info["cmdline"] or []):
            found.append(process)
    return found


def level(url: str, sessions: int, seconds: float, watched: list[psutil.Process]) -> dict:
    wait_for_free_slots(url, sessions)
    before, started = cpu_s(watched), time.monotonic()
    run = asyncio.run(load_level(url, sessions, seconds))
    wall = time.monotonic() - started
    cores = (cpu_s(watched) - before) / wall
    return {"sessions": sessions, "p50_ms": percentile_ms(run.round_trips, 50),
            "p99_ms": percentile_ms(run.round_trips, 99), "cores": round(cores, 3),
            "cores_per_session": round(cores / sessions, 3), "frames": run.frames_sent,
            "not_back": run.frames_sent - run.frames_received}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,4,8")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--frontend", default="tiny-copy")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    slots = str(max(levels))
    common = ["--frontend", args.frontend, "--device", args.device, "--asr", "none", "--llm", "local",
              "--max-sessions", slots]
    kame = str(Path(sys.executable).parent / "kame")
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.STDOUT}
    plain = subprocess.Popen([kame, "serve", *common], env=os.environ | {"KAME_PORT": "18711"}, **quiet)
    rayed = subprocess.Popen([kame, "serve", "--ray", "--replicas", "1", *common],
                             env=os.environ | {"KAME_PORT": "18712"}, **quiet)
    urls = {"plain": "ws://127.0.0.1:18711/api/chat", "ray proxy": "ws://127.0.0.1:18712/api/chat"}
    try:
        for url in urls.values():
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                try:
                    wait_for_free_slots(url, 1, limit_s=1)
                    break
                except OSError:
                    time.sleep(1)
        watched = {"plain": [psutil.Process(plain.pid)], "ray proxy": ray_processes("ProxyActor")}
        replica = ray_processes("ServeReplica")
        rows = []
        for sessions in levels:
            for name, url in urls.items():
                before = cpu_s(replica)
                row = level(url, sessions, args.seconds, watched[name]) | {"path": name}
                if name == "ray proxy":
                    row["replica_cores"] = round((cpu_s(replica) - before) / args.seconds, 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for process in (plain, rayed):
            process.terminate()
        for process in (plain, rayed):
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
    print("\n| path | sessions | round trip p50 / p99 ms | CPU cores (server or proxy) | per session | "
          "replica cores |")
    print("|---|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['path']} | {r['sessions']} | {r['p50_ms']} / {r['p99_ms']} | {r['cores']} | "
              f"{r['cores_per_session']} | {r.get('replica_cores', '')} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
