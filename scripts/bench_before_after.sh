#!/usr/bin/env bash
# The whole server under the same load, at an older commit and in this tree, side by side in one run:
# what a change did to round trip, server overhead and CPU (docs/benchmarks.md).
#
#   scripts/bench_before_after.sh [OLD_COMMIT] [LEVELS] [SECONDS]     (defaults: 8817dc4 1,4,8,16 10)
#
# Configurations: "before" (OLD_COMMIT), "after, eager clock" (this tree with engine_clock=eager:
# the same stepping policy as before, so the difference is the rest of the change) and "after"
# (this tree, its defaults). Each: kame serve --frontend tiny --asr none --max-sessions 16 on
# loopback (the per-address limit raised: every session comes from 127.0.0.1), then kame bench
# load at each level; the load generator shares the machine.
set -euo pipefail
old=${1:-8817dc4}
levels=${2:-1,4,8,16}
seconds=${3:-10}
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
work=$(mktemp -d)
git -C "$root" worktree add -q --detach "$work/old" "$old"
trap 'git -C "$root" worktree remove --force "$work/old"; rm -rf "$work"' EXIT
port=18990

measure() {  # NAME SOURCE_TREE [ENV=VALUE...]
    local name=$1 tree=$2
    shift 2
    env KAME_MAX_CONNECTIONS_PER_IP=64 "$@" PYTHONPATH="$tree" "$python" -m kame.cli serve --frontend tiny --device cpu --asr none --llm local \
        --max-sessions 16 --port "$port" >"$work/$name.log" 2>&1 &
    local server=$!
    for _ in $(seq 240); do
        curl -fsS "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && break
        sleep 0.5
    done
    PYTHONPATH="$tree" "$python" -m kame.cli bench load --url "ws://127.0.0.1:$port/api/chat" --levels "$levels" \
        --seconds "$seconds" --json-out "$work/$name.json" >/dev/null
    kill -INT "$server"
    wait "$server" || true
}

measure before "$work/old"
measure after-eager "$root" KAME_ENGINE_CLOCK=eager
measure after "$root"

"$python" - "$work" <<'PY'
import json, sys
from pathlib import Path

work = Path(sys.argv[1])
names = ["before", "after-eager", "after"]
runs = {n: {r["sessions"]: r for r in json.loads((work / f"{n}.json").read_text())["levels"]} for n in names}
print("| sessions | config | round trip p50 / p99 ms | engine step ms | overhead p50 / p99 ms | mean batch | "
      "late | server CPU cores |")
print("|---:|---|---|---:|---|---:|---:|---:|")
for level in sorted(runs["before"]):
    for n in names:
        r = runs[n][level]
        rt, oh = r["round_trip_ms"], r["overhead_ms"]
        print(f"| {level} | {n} | {rt['p50']} / {rt['p99']} | {r['engine_step_ms']} | {oh['p50']} / {oh['p99']} | "
              f"{r['batch_mean']} | {r['frames_late']} | {r['server_cpu_cores']} |")
print()
print("| sessions | overhead p50 after-eager / before | overhead p99 after-eager / before | CPU after-eager / before |")
print("|---:|---:|---:|---:|")
for level in sorted(runs["before"]):
    b, a = runs["before"][level], runs["after-eager"][level]
    ratio = lambda x, y: "n/a" if not x or not y else f"{y / x:.2f}"  # noqa: E731
    print(f"| {level} | {ratio(b['overhead_ms']['p50'], a['overhead_ms']['p50'])} | "
          f"{ratio(b['overhead_ms']['p99'], a['overhead_ms']['p99'])} | "
          f"{ratio(b['server_cpu_cores'], a['server_cpu_cores'])} |")
PY
