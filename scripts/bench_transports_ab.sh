#!/bin/bash
# The transport bench (`kame bench load`, every transport at 1 and 8 sessions) on another revision and on
# this tree, alternately (old, new, old, new: a drift of the machine's load shows in both), one server each.
#   bash scripts/bench_transports_ab.sh BASE_REV [OUT_DIR]
# Figures: OUT_DIR/{old,new}-{1,2}.json (bench load's --json-out); docs/benchmarks.md reads them side by side.
# TRANSPORTS (moshi,realtime,live,live-webrtc), LEVELS (1,8) and BENCH_SECONDS (10) narrow or lengthen the runs;
# SERVER_ENV (e.g. "KAME_REALTIME__LIVE_ZERO_SILENCE_S=0") is set for both servers.
set -euo pipefail
base=${1:?usage: bench_transports_ab.sh BASE_REV [OUT_DIR]}
out=${2:-/tmp/bench-ab}
here=$(git rev-parse --show-toplevel)
python=${PYTHON:-$here/.venv/bin/python}
old=$(mktemp -d)/old
mkdir -p "$out"
git -C "$here" worktree add -q --detach "$old" "$base"
trap 'git -C "$here" worktree remove --force "$old"' EXIT
for round in 1 2; do
  for side in old new; do
    tree=$here; [ "$side" = old ] && tree=$old
    (cd "$tree" && export ${SERVER_ENV:-KAME_AB=1} && KAME_MAX_CONNECTIONS_PER_IP=64 exec "$python" -m kame.cli serve --frontend tiny-copy --device cpu \
        --asr none --llm local --max-sessions 8 --port 18931 > "$out/server-$side-$round.log" 2>&1) &
    pid=$!
    for _ in $(seq 180); do curl -sf http://127.0.0.1:18931/healthz > /dev/null && break; sleep 1; done
    echo "$side, run $round: $(uptime)"
    "$python" -m kame.cli bench load --url http://127.0.0.1:18931 --levels "${LEVELS:-1,8}" --seconds "${BENCH_SECONDS:-10}" \
        --transport "${TRANSPORTS:-moshi,realtime,live,live-webrtc}" --server-pid "$pid" --json-out "$out/$side-$round.json" \
        > "$out/$side-$round.txt" 2>&1
    kill -INT "$pid"; wait "$pid" || true
  done
done
echo "figures in $out"
