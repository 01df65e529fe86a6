"""What a session costs on a server with many slots: the engine step and the round trip of a few sessions
on servers of different sizes, side by side in one run (docs/benchmarks-history.md, "Capacity").

    python scripts/bench_capacity.py engine [--frontend tiny] [--device cpu] [--slots 1,16] [--sessions 1]
                                            [--frames 200] [--rounds 3] [--json-out FILE]
    python scripts/bench_capacity.py server [--frontend tiny] [--device cpu] [--slots 1,16] [--levels 1]
                                            [--seconds 10] [--rounds 2] [--processes 1] [--json-out FILE]

`engine`: the batched engine alone, in this process: for each slot count, an engine of that many slots with
`--sessions` of them stepping (and, for each count above the sessions, the same engine stepping its whole
batch: `compact=False`, what every step cost before the rows); rounds alternate the configurations.
`server`: `kame serve --max-sessions S --asr none --llm local` for each S (and S with engine_compact off),
then `kame bench load --levels L` against it; the round trip p50/p99, the engine step (the server's own
/metrics) and the frames back. The figure that matters is the ratio to the 1-slot configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def engine_configs(slots: list[int], sessions: list[int]) -> list[tuple[str, int, int, bool]]:
    """(name, slots, sessions, compact): each session count that fits each slot count; and, for the first
    session count on a larger server, the whole batch stepped (`compact=False`: what a step cost before)."""
    configs = []
    for count in slots:
        for index, n in enumerate(n for n in sessions if n <= count):
            configs.append((f"{n} of {count} slots", count, n, True))
            if index == 0 and count > n:
                configs.append((f"{n} of {count} slots, whole batch", count, n, False))
    return configs


def engine_round(frontend, slots: int, compact: bool, sessions: int, frames: int, warmup: int,
                 kv_cache: str = "model") -> list[float]:
    """Per-step seconds of `sessions` slots stepping on an engine of `slots`."""
    import numpy as np
    import torch

    from kame.frontend.engine import FRAME_SIZE, BatchedEngine
    from kame.frontend.oracle import OracleUpdate

    rng = np.random.default_rng(0)
    from kame.frontend.kv_cache import choose_kv_cache

    engine = BatchedEngine(frontend, slots, compact=compact, kv_cache=choose_kv_cache(kv_cache, frontend.lm, slots)[0])
    try:
        acquired = [engine.acquire() for _ in range(sessions)]
        for slot in acquired:
            engine.push_oracle(slot, OracleUpdate.reset(0, tuple(range(10, 40))))
        times = []
        for index in range(warmup + frames):
            batch = {slot: (rng.standard_normal(FRAME_SIZE) * 0.05).astype(np.float32) for slot in acquired}
            started = time.perf_counter()
            engine.step(batch)
            if frontend.device.type == "cuda":
                torch.cuda.synchronize()
            if index >= warmup:
                times.append(time.perf_counter() - started)
        return times
    finally:
        engine.close()


def run_engine(args: argparse.Namespace) -> dict:
    from kame.frontend.loader import load_frontend

    torch.set_num_threads(args.threads)
    frontend = load_frontend(args.frontend, args.device)
    configs = engine_configs(args.slots, args.sessions)
    runs: dict[str, list[float]] = {name: [] for name, *_ in configs}
    ends: dict[str, tuple[float, float]] = {}  # the last round's first and last tenth of the frames
    peaks: dict[str, float | None] = {}
    cuda = frontend.device.type == "cuda"
    for round_ in range(args.rounds):
        for name, slots, sessions, compact in configs:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times = engine_round(frontend, slots, compact, sessions, args.frames, args.warmup, args.kv_cache)
            tenth = max(1, len(times) // 10)
            runs[name].append(1000 * statistics.median(times))
            ends[name] = (1000 * statistics.median(times[:tenth]), 1000 * statistics.median(times[-tenth:]))
            peaks[name] = round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None
            print(f"round {round_ + 1}: {name}: {runs[name][-1]:.2f} ms", file=sys.stderr, flush=True)
    base = statistics.median(runs[configs[0][0]])
    rows = [{"config": name, "slots": slots, "compact": compact, "sessions": sessions,
             "step_ms_rounds": [round(v, 3) for v in runs[name]], "step_ms": round(statistics.median(runs[name]), 3),
             "vs_first": round(statistics.median(runs[name]) / base, 3),
             "first_tenth_ms": round(ends[name][0], 3), "last_tenth_ms": round(ends[name][1], 3),
             "peak_memory_gib": peaks[name]} for name, slots, sessions, compact in configs]
    return {"part": "engine", "frontend": args.frontend, "device": str(frontend.device), "frames": args.frames,
            "rounds": args.rounds, "torch_threads": args.threads, "kv_cache": args.kv_cache, "rows": rows}


def engine_markdown(result: dict) -> str:
    lines = [f"engine alone: `{result['frontend']}` on {result['device']} ({result['kv_cache']} KV cache), median "
             f"step of {result['frames']} frames, median of {result['rounds']} rounds (alternated)", "",
             "| configuration | step ms (each round) | step ms | vs the first | first / last tenth ms | peak GiB |",
             "|---|---|---:|---:|---|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['config']} | {', '.join(map(str, r['step_ms_rounds']))} | {r['step_ms']} | "
                     f"{r['vs_first']} | {r['first_tenth_ms']} / {r['last_tenth_ms']} | {r['peak_memory_gib']} |")
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(args: argparse.Namespace, slots: int, compact: bool, port: int, log: Path) -> subprocess.Popen:
    env = os.environ | {"KAME_MAX_CONNECTIONS_PER_IP": str(4 * max(slots, max(args.levels))),
                        "KAME_ENGINE_COMPACT": "true" if compact else "false"}
    command = [sys.executable, "-m", "kame.cli", "serve", "--frontend", args.frontend, "--device", args.device,
               "--asr", "none", "--llm", "local", "--max-sessions", str(slots), "--port", str(port),
               "--kv-cache", args.kv_cache] + (["--fronts", str(args.fronts)] if args.fronts else [])
    server = subprocess.Popen(command, env=env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + args.ready_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited: see {log}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2).read()
            return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit(f"the server was not ready in {args.ready_s} s: see {log}")


def server_round(args: argparse.Namespace, slots: int, compact: bool, work: Path, name: str) -> list[dict]:
    port = free_port()
    server = serve(args, slots, compact, port, work / f"{name}.log")
    try:
        out = work / f"{name}.json"
        subprocess.run([sys.executable, "-m", "kame.cli", "bench", "load", "--url", f"ws://127.0.0.1:{port}/api/chat",
                        "--levels", ",".join(map(str, args.levels)), "--seconds", str(args.seconds),
                        "--processes", str(args.processes), "--json-out", str(out)],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["levels"]
    finally:
        server.terminate()
        server.wait(30)


def run_server(args: argparse.Namespace) -> dict:
    configs = [(name, slots, compact) for name, slots, _, compact in engine_configs(args.slots, [max(args.levels)])]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, slots, compact in configs:
                for level in server_round(args, slots, compact, Path(tmp), f"{slots}-{compact}-{round_}"):
                    sent = level["frames_sent"]
                    rows.append({"config": name, "slots": slots, "compact": compact, "round": round_ + 1,
                                 "sessions": level["sessions"], "round_trip_ms": level["round_trip_ms"],
                                 "engine_step_ms": level["engine_step_ms"], "batch_mean": level["batch_mean"],
                                 "frames_back": round(1 - level["frames_dropped"] / sent, 4) if sent else None,
                                 "server_cpu_cores": level["server_cpu_cores"]})
                    print(f"round {round_ + 1}: {name}: {level['sessions']} sessions: p50 "
                          f"{level['round_trip_ms']['p50']} ms, step {level['engine_step_ms']} ms",
                          file=sys.stderr, flush=True)
    return {"part": "server", "frontend": args.frontend, "device": args.device, "seconds": args.seconds,
            "rounds": args.rounds, "rows": rows}


def server_markdown(result: dict) -> str:
    lines = [f"whole server: `{result['frontend']}` on {result['device']}, --asr none, {result['seconds']} s a level, "
             f"{result['rounds']} round(s) alternated", "",
             "| configuration | sessions | round | round trip p50 / p99 ms | engine step ms | mean batch | "
             "frames back | server cores |", "|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        rt = r["round_trip_ms"]
        lines.append(f"| {r['config']} | {r['sessions']} | {r['round']} | {rt['p50']} / {rt['p99']} | "
                     f"{r['engine_step_ms']} | {r['batch_mean']} | {r['frames_back']} | {r['server_cpu_cores']} |")
    lines += ["", "median of the rounds, and against the first configuration:", "",
              "| configuration | sessions | round trip p50 ms | vs the first | engine step ms | vs the first |",
              "|---|---:|---:|---:|---:|---:|"]
    medians = {}
    for r in result["rows"]:
        medians.setdefault((r["config"], r["sessions"]), []).append(r)
    first = None
    for (config, sessions), runs in medians.items():
        p50 = statistics.median(r["round_trip_ms"]["p50"] or float("nan") for r in runs)
        step = statistics.median(r["engine_step_ms"] or float("nan") for r in runs)
        first = first or (p50, step)
        lines.append(f"| {config} | {sessions} | {p50:.2f} | {p50 / first[0]:.2f} | {step:.2f} | "
                     f"{step / first[1]:.2f} |")
    return "\n".join(lines)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["engine", "server"])
    parser.add_argument("--frontend", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--slots", type=ints, default=[1, 16], help="slot counts; the first is the reference")
    parser.add_argument("--sessions", type=ints, default=[1], help="engine: the sessions stepping (a list)")
    parser.add_argument("--kv-cache", default="model", choices=["model", "int8", "auto"],
                        help="the KV cache (engine: model or int8; server: as --kv-cache)")
    parser.add_argument("--fronts", type=int, default=0, help="server: kame serve --fronts")
    parser.add_argument("--frames", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="engine: torch threads (the server's default on a CPU)")
    parser.add_argument("--levels", type=ints, default=[1], help="server: sessions of the load")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--processes", type=int, default=1, help="server: load generator processes")
    parser.add_argument("--ready-s", type=float, default=600.0, help="server: how long a start may take")
    parser.add_argument("--rounds", type=int, default=None, help="default: 3 (engine), 2 (server)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    args.rounds = args.rounds or (3 if args.part == "engine" else 2)
    result = run_engine(args) if args.part == "engine" else run_server(args)
    print(engine_markdown(result) if args.part == "engine" else server_markdown(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
