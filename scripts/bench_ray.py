"""Ray Serve, measured: what its proxy costs per audio frame, and where a burst of sessions lands.

    python scripts/bench_ray.py --levels 1,4,8 --seconds 10
    python scripts/bench_ray.py --bursts 20 --replicas 2,3 --times 2,3 --hog 1

The first: `kame bench load`'s sessions through `kame serve --ray` (one replica) and against a plain
`kame serve` with the same settings, level by level, side by side in one run; with the proxy's and the
servers' CPU per session. On a CPU with tiny-copy (the default) it shows the proxy's share of a frame's
round trip; on a GPU machine pass --frontend and --device cuda.

The second (--bursts N): a local Ray instance with 2, then 3 replicas of --slots slots each, and N
bursts of --times times every slot opened at once, each burst's sessions held until all have their
answer, then closed. A burst's "refused with room" is the sessions refused busy while a slot was left
free (never more than the free slots); each refusal's time is from opening to the 503. --hog N runs
Debian's `stress-ng --cpu N` beside it (a loaded machine).

Each prints a markdown table; --json-out keeps the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from client.bench import wait_for_free_slots  # noqa: E402
from client.client import EventMessage, KameClient, ServerBusy  # noqa: E402
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
    bursts = parser.add_argument_group("bursts", "where a burst of sessions lands (--bursts N)")
    bursts.add_argument("--bursts", type=int, default=0, help="bursts for each replica count and size")
    bursts.add_argument("--replicas", default="2,3", help="replica counts, one after the other")
    bursts.add_argument("--slots", type=int, default=2, help="sessions a replica holds")
    bursts.add_argument("--times", default="2,3", help="a burst's sessions, in times every slot")
    bursts.add_argument("--hog", type=int, default=0, help="stress-ng --cpu N beside it (0: none)")
    args = parser.parse_args()
    if args.bursts:
        return burst_bench(args)
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


async def open_session(url: str) -> dict:
    """One session of a burst: landed (with the replica its ready event names) or refused, and when."""
    started = time.monotonic()
    try:
        client = await KameClient.connect(url, events=True, open_timeout=60)
    except ServerBusy:
        return {"outcome": "refused", "s": time.monotonic() - started}
    except Exception as exc:  # anything but the app's 503: the bench's table says how many
        return {"outcome": "error", "s": time.monotonic() - started, "error": repr(exc)}
    replica = None
    try:
        async with asyncio.timeout(60):
            async for message in client:
                if isinstance(message, EventMessage) and message.event.type == "ready":
                    replica = message.event.replica
                    break
    except TimeoutError:
        pass
    return {"outcome": "landed", "s": time.monotonic() - started, "replica": replica, "client": client}


def health(base: str) -> dict:
    """/healthz through the proxy, whatever its status (503 while a replica warms)."""
    try:
        return json.loads(urllib.request.urlopen(f"{base}/healthz", timeout=10).read())
    except urllib.error.HTTPError as error:
        return json.loads(error.read())


def wait_until_empty(base: str, replicas: int, slots: int, limit_s: float = 60.0) -> None:
    """The cluster ready with `replicas` warm (Serve's RUNNING: routable), each reporting every slot free
    and no session (a replica reports each second, and once warming, before it is routable)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        report = health(base)
        listed = report.get("replicas") or []
        if report.get("status") == "ready" and report.get("warm_replicas") == replicas and len(listed) == replicas \
                and all(r["free_slots"] == slots and r["sessions"] == 0 for r in listed):
            return
        time.sleep(0.2)
    raise RuntimeError(f"the cluster was not ready and empty in {limit_s} s: {health(base)}")


async def one_burst(url: str, sessions: int, total_slots: int) -> dict:
    opened = await asyncio.gather(*(open_session(url) for _ in range(sessions)))
    landed = [o for o in opened if o["outcome"] == "landed"]
    refused = [o for o in opened if o["outcome"] == "refused"]
    for o in landed:
        await o.pop("client").close()
    return {"landed": len(landed), "refused": len(refused),
            "with_room": min(len(refused), total_slots - len(landed)),
            "errors": [o["error"] for o in opened if o["outcome"] == "error"],
            "no_ready": sum(1 for o in landed if o["replica"] is None),
            "per_replica": sorted(Counter(o["replica"] for o in landed).values()),
            "refused_s": [round(o["s"], 3) for o in refused]}


def burst_bench(args: argparse.Namespace) -> int:
    """A local Ray instance, scaled from one replica count to the next, N bursts at each size."""
    from server import ray_serve
    from server.settings import load_settings

    counts, times = [int(x) for x in args.replicas.split(",")], [int(x) for x in args.times.split(",")]
    port = 18713
    settings = load_settings(None, frontend=args.frontend, device=args.device, asr="none", llm="local",
                             max_sessions=args.slots, port=port, engine_threads=1)
    url, base = f"ws://127.0.0.1:{port}/api/chat", f"http://127.0.0.1:{port}"
    hog = None
    if args.hog:
        if shutil.which("stress-ng") is None:
            raise SystemExit("--hog needs Debian's stress-ng: apt-get install stress-ng")
        hog = subprocess.Popen(["stress-ng", "--cpu", str(args.hog), "--quiet"])
    rows = []
    try:
        ray_serve.start(settings, ray_serve.RayOptions(replicas=counts[0], local_cpus=2 * max(counts),
                                                       num_cpus=0.5), cuda=False)
        for replicas in counts:
            ray_serve.scale(replicas)
            wait_until_empty(base, replicas, args.slots, limit_s=300)
            for factor in times:
                sessions = factor * replicas * args.slots
                for index in range(args.bursts):
                    burst = asyncio.run(one_burst(url, sessions, replicas * args.slots))
                    burst |= {"replicas": replicas, "times": factor, "sessions": sessions, "burst": index}
                    rows.append(burst)
                    print(json.dumps(burst), flush=True)
                    wait_until_empty(base, replicas, args.slots)
    finally:
        ray_serve.stop(5.0)
        if hog is not None:
            hog.terminate()
            hog.wait()
    beside = f"stress-ng --cpu {args.hog} beside it" if args.hog else "no CPU hog"
    print(f"\n{args.bursts} bursts a row; {args.slots} slots a replica; {beside}\n")
    print("| replicas | sessions a burst | landed a burst | refused with room | refused: p50 / max s | errors |")
    print("|---:|---:|---|---:|---|---:|")
    for replicas in counts:
        for factor in times:
            group = [r for r in rows if r["replicas"] == replicas and r["times"] == factor]
            landed = [r["landed"] for r in group]
            waits = sorted(s for r in group for s in r["refused_s"])
            p50 = waits[len(waits) // 2] if waits else None
            print(f"| {replicas} | {group[0]['sessions']} ({factor}x) | {min(landed)}-{max(landed)} | "
                  f"{sum(r['with_room'] for r in group)} | {p50} / {waits[-1] if waits else None} | "
                  f"{sum(len(r['errors']) + r['no_ready'] for r in group)} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2) + "\n")
    return 1 if any(r["with_room"] or r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
