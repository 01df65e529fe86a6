"""The host side of the server: its CPU per session and its event loop's lag at 8-64 real-time sessions,
with a front-end that computes nothing, so that what is measured is the rest (websocket I/O, Opus,
the ASR feed, the planners, the session code).

    python scripts/bench_host.py [--levels 8,16,32,64] [--seconds 10] [--asr none,whisper]
                                 [--profile 64] [--profile-seconds 8] [--server-tree DIR] [--json-out FILE]

For each ASR: `kame serve --frontend null --asr ASR --max-sessions MAX` in a process of its own, then
`kame bench load` at each level in others (one per 16 sessions: a load generator's Opus holds its GIL
too; each session speaks tests/fixtures/question.wav and a 1 s pause, looped, so that the ASR has
speech to decode). With `--profile N`, the level N is run once
more with py-spy (`pip install py-spy`) sampling whichever thread of the server holds the GIL (its
own idle detection does not work on this VM; the GIL holder is running Python by definition), and
the top functions by own samples are printed: where the Python side's time goes.

CPU: the server process (its /metrics), and with its children (the codec processes; the load
generator is not one of them), per 16 sessions from the latter. Keeping real time, per level: every
frame came back (out / in >= 0.99) and the round trip's p99 is under two frames (160 ms). The load
generator shares this machine: its own CPU is reported beside the server's.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from client.bench import tree_cpu_s

ROOT = Path(__file__).resolve().parents[1]
SPEECH = ROOT / "tests" / "fixtures" / "question.wav"
RATE = 100  # py-spy samples a second


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def python_path(tree: Path) -> dict:
    """PYTHONPATH with `tree` first, ahead of what was there (a GPU image's packages may live on it:
    scripts/gpu_bench.sh)."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, (str(tree), os.environ.get("PYTHONPATH"))))}


def start_server(asr: str, max_sessions: int, port: int, log: Path, tree: Path = ROOT,
                 fronts: int = 0) -> subprocess.Popen:
    env = os.environ | {"KAME_MAX_CONNECTIONS_PER_IP": str(4 * max_sessions)} | python_path(tree)
    server = subprocess.Popen(
        [sys.executable, "-m", "kame.cli", "serve", "--frontend", "null", "--device", "cpu", "--asr", asr,
         "--llm", "local", "--max-sessions", str(max_sessions), "--port", str(port)]
        + (["--fronts", str(fronts)] if fronts else []),
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
        cwd=tree)  # `python -m` puts the working directory first on the path, ahead of PYTHONPATH
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"the server exited:\n{log.read_text()}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
            return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    sys.exit(f"the server did not get ready in 180 s:\n{log.read_text()}")


def stop_server(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGINT)
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()


def load(port: int, sessions: int, seconds: float, out: Path) -> dict:
    """One level of `kame bench load`, in processes of its own (one per 16 sessions)."""
    command = [sys.executable, "-m", "kame.cli", "bench", "load", "--url", f"ws://127.0.0.1:{port}/api/chat",
               "--levels", str(sessions), "--seconds", str(seconds), "--input", str(SPEECH),
               "--processes", str(max(1, -(-sessions // 16))), "--json-out", str(out)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=os.environ | python_path(ROOT))
    return json.loads(out.read_text())["levels"][0]


def profiled_pid(server: subprocess.Popen, log: Path) -> int:
    """The process whose GIL carries the sessions: the server, or (with --fronts) its front 0."""
    found = re.search(r"front 0 of \d+: its own loopback port \d+, pid (\d+)", log.read_text())
    return int(found.group(1)) if found else server.pid


def profile(server: subprocess.Popen, port: int, sessions: int, seconds: float, work: Path,
            pid: int | None = None) -> dict:
    """py-spy's samples of the server's GIL holder while `sessions` run: the top functions by own time."""
    if shutil.which("py-spy") is None:
        sys.exit("--profile needs py-spy: pip install py-spy")
    raw = work / "profile.txt"
    # the last level's sessions may still hold their slots (an ASR's last decode): not that, but the load
    from client.bench import wait_for_free_slots

    wait_for_free_slots(f"ws://127.0.0.1:{port}/api/chat", sessions, limit_s=60)
    spy = subprocess.Popen(["py-spy", "record", "--pid", str(pid or server.pid), "--duration", str(int(seconds)),
                            "--rate", str(RATE), "--format", "raw", "--output", str(raw),
                            "--threads", "--nolineno", "--gil"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attached before the sessions start
    load(port, sessions, seconds + 2, work / "profiled.json")
    spy.wait(60)
    text = raw.read_text()
    held = sum(int(line.rpartition(" ")[2]) for line in text.splitlines() if line.rpartition(" ")[2].isdigit())
    return {"gil_held": round(held / (RATE * int(seconds)), 3), "top": top_functions(text)}


def top_functions(raw: str, count: int = 15) -> list[tuple[str, float, float]]:
    """(function, own share, inclusive share) of py-spy's raw (collapsed) stacks, busiest first; the
    shares are of all samples (of the GIL holder, with --gil)."""
    own: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, samples = line.rpartition(" ")
        if not stack or not samples.isdigit():
            continue
        frames = stack.split(";")[1:]  # the first is the thread
        if not frames:
            continue
        n = int(samples)
        total += n
        own[_short(frames[-1])] += n
        for name in {_short(frame) for frame in frames}:
            inclusive[name] += n
    return [(name, n / total, inclusive[name] / total) for name, n in own.most_common(count)] if total else []


def _short(frame: str) -> str:
    """`func (path/to/file.py:12)` -> `func (file.py)`."""
    name, _, where = frame.partition(" (")
    return f"{name} ({Path(where.rstrip(')').split(':')[0]).name})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="8,16,32,64")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--asr", default="none,whisper", help="comma list of ASR engines to run the levels with")
    parser.add_argument("--profile", type=int, default=None, help="the level to profile (py-spy), with each ASR")
    parser.add_argument("--profile-seconds", type=float, default=8.0)
    parser.add_argument("--server-tree", default=str(ROOT),
                        help="the source tree the server runs from (a worktree of an older commit, to compare; "
                             "the load generator is always this tree's)")
    parser.add_argument("--fronts", default="0",
                        help="comma list of `kame serve --fronts` values to compare (0: one process, the default)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    levels = [int(level) for level in args.levels.split(",")]
    rows, profiles = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for asr, fronts in itertools.product(args.asr.split(","), [int(f) for f in args.fronts.split(",")]):
            port, log, name = free_port(), work / f"server-{asr}-{fronts}.log", f"{asr}, fronts {fronts}"
            server = start_server(asr, max(levels), port, log, Path(args.server_tree), fronts)
            try:
                for sessions in levels:
                    cpu, started = tree_cpu_s(server.pid), time.monotonic()
                    r = load(port, sessions, args.seconds, work / f"{asr}-{fronts}-{sessions}.json")
                    all_cores = (tree_cpu_s(server.pid) - cpu) / (time.monotonic() - started)
                    out_in = 1 - r["frames_dropped"] / r["frames_sent"] if r["frames_sent"] else 0.0
                    p99 = r["round_trip_ms"]["p99"]
                    real_time = out_in >= 0.99 and p99 is not None and p99 < 160
                    rows.append({"asr": asr, "fronts": fronts, "sessions": sessions,
                                 "server_cpu_cores": r["server_cpu_cores"],
                                 "with_children_cores": round(all_cores, 2),
                                 "cores_per_16": round(16 * all_cores / sessions, 2),
                                 "client_cpu_cores": r.get("client_cpu_cores"), "loop_lag_ms": r.get("loop_lag_ms"),
                                 "round_trip_ms": r["round_trip_ms"], "out_in": round(out_in, 3),
                                 "refused": r["refused"], "real_time": real_time})
                    print(json.dumps(rows[-1]), flush=True)
                if args.profile:
                    profiles[name] = profile(server, port, args.profile, args.profile_seconds, work,
                                             profiled_pid(server, log))
            finally:
                stop_server(server)
    print()
    print("| ASR | fronts | sessions | server (front) process cores | with its children | per 16 sessions | "
          "load generator cores | loop lag mean / p99 ms | round trip p50 / p99 ms | out / in | real time |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---|---:|---|")
    for r in rows:
        lag, rt = r["loop_lag_ms"] or {}, r["round_trip_ms"]
        print(f"| {r['asr']} | {r['fronts']} | {r['sessions']} | {r['server_cpu_cores']} | "
              f"{r['with_children_cores']} | {r['cores_per_16']} | "
              f"{r['client_cpu_cores']} | {lag.get('mean')} / <= {lag.get('p99_under')} | {rt['p50']} / {rt['p99']} | "
              f"{r['out_in']} | {'yes' if r['real_time'] else 'no'} |")
    for name, found in profiles.items():
        print(f"\nprofile, ASR {name}, {args.profile} sessions (py-spy, the GIL holder's samples): the GIL was held "
              f"in {100 * found['gil_held']:.0f} % of the samples")
        print("| function | own | inclusive |")
        print("|---|---:|---:|")
        for name, share, inclusive in found["top"]:
            print(f"| `{name}` | {100 * share:.1f} % | {100 * inclusive:.1f} % |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rows": rows, "profiles": profiles}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
