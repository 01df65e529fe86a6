#!/usr/bin/env bash
# The whole server under the same load, at an older commit and in this tree, side by side in one run:
# what a change did to round trip, server overhead and CPU (docs/benchmarks.md).
#
#   scripts/bench_before_after.sh [OLD_COMMIT] [LEVELS] [SECONDS]     (defaults: 8817dc4 1,4,8,16 10)
#   ASR=whisper INPUT=tests/fixtures/question.wav ROUNDS=2 BASELINE=d079eca scripts/bench_before_after.sh 8817dc4 3 10
#       (the ASR in the server; each session speaks INPUT, looped, instead of noise, which ASR leaves
#       alone; rounds alternated; BASELINE: one more commit, run with its defaults)
#
# Configurations: "before" (OLD_COMMIT), "after-eager" and "after-tick" (this tree with
# engine_clock=eager / tick) and "after" (this tree, its defaults). Each: kame serve --frontend
# tiny --asr $ASR (default none) --max-sessions 16 on loopback (the per-address limit raised: every
# session comes from 127.0.0.1), then kame bench load at each level; the load generator shares the
# machine. With ROUNDS > 1 the configurations are run in turn that many times (a row per run):
# this VM's timings drift within a sitting, and alternating shows it.
set -euo pipefail
old=${1:-8817dc4}
levels=${2:-1,4,8,16}
seconds=${3:-10}
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
work=$(mktemp -d)
baseline=${BASELINE:-}
git -C "$root" worktree add -q --detach "$work/old" "$old"
[ -z "$baseline" ] || git -C "$root" worktree add -q --detach "$work/baseline" "$baseline"
trap 'git -C "$root" worktree remove --force "$work/old"; [ -z "$baseline" ] || git -C "$root" worktree remove --force "$work/baseline"; rm -rf "$work"' EXIT
port=18990
asr=${ASR:-none}
input=${INPUT:-}
[ -z "$input" ] || input=$(realpath "$input")
rounds=${ROUNDS:-1}

measure() {  # NAME SOURCE_TREE [ENV=VALUE...]
    local name=$1 tree=$2
    shift 2
    # from the tree itself: `python -m` puts the working directory first on the path, ahead of PYTHONPATH
    (cd "$tree" && exec env KAME_MAX_CONNECTIONS_PER_IP=64 "$@" PYTHONPATH="$tree" "$python" -m kame.cli serve \
        --frontend tiny --device cpu --asr "$asr" --llm local --max-sessions 16 --port "$port") >"$work/$name.log" 2>&1 &
    local server=$!
    for _ in $(seq 240); do
        curl -fsS "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && break
        kill -0 "$server" 2>/dev/null || { cat "$work/$name.log"; echo "$name: the server exited" >&2; exit 1; }
        sleep 0.5
    done
    # one load generator for every configuration: this tree's
    PYTHONPATH="$root" "$python" -m kame.cli bench load --url "ws://127.0.0.1:$port/api/chat" --levels "$levels" \
        --seconds "$seconds" ${input:+--input "$input"} --json-out "$work/$name.json" >/dev/null
    kill -INT "$server"
    wait "$server" || true
}

for round in $(seq "$rounds"); do
    measure "before-$round" "$work/old"
    [ -z "$baseline" ] || measure "baseline-$round" "$work/baseline"
    measure "after-eager-$round" "$root" KAME_ENGINE_CLOCK=eager
    measure "after-tick-$round" "$root" KAME_ENGINE_CLOCK=tick
    measure "after-$round" "$root"
done

"$python" - "$work" "$rounds" "$baseline" <<'PY'
import json, statistics, sys
from pathlib import Path

work, rounds, baseline = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
configs = ["before"] + (["baseline"] if baseline else []) + ["after-eager", "after-tick", "after"]
runs = {f"{c}-{k}": {r["sessions"]: r for r in json.loads((work / f"{c}-{k}.json").read_text())["levels"]}
        for k in range(1, rounds + 1) for c in configs}
print("| sessions | config | round trip p50 / p99 ms | engine step ms | steps per frame | overhead p50 / p99 ms | "
      "mean batch | out / in | late | server CPU cores |")
print("|---:|---|---|---:|---:|---|---:|---:|---:|---:|")
levels = sorted(runs["before-1"])
for level in levels:
    for name, run in runs.items():
        r = run[level]
        rt, oh = r["round_trip_ms"], r["overhead_ms"]
        per_frame = r["batch_mean"] and level / r["batch_mean"]
        out_in = 1 - r["frames_dropped"] / r["frames_sent"] if r["frames_sent"] else None
        print(f"| {level} | {name} | {rt['p50']} / {rt['p99']} | {r['engine_step_ms']} | "
              f"{per_frame and round(per_frame, 2)} | {oh['p50']} / {oh['p99']} | {r['batch_mean']} | "
              f"{out_in and round(out_in, 3)} | {r['frames_late']} | {r['server_cpu_cores']} |")
print()
others = [c for c in configs if c != "after-eager"]
print("| sessions | p50 round trip / after-eager's (median of the rounds): " + " | ".join(others) + " |")
print("|---:|" + "---:|" * len(others))
for level in levels:
    p50 = {c: statistics.median(runs[f"{c}-{k}"][level]["round_trip_ms"]["p50"] or float("nan")
                                for k in range(1, rounds + 1)) for c in configs}
    print(f"| {level} | " + " | ".join(f"{p50[c] / p50['after-eager']:.2f}" for c in others) + " |")
PY
