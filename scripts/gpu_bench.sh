#!/usr/bin/env bash
# GPU benchmark in one command (about 8 minutes on one H200): installs the project, then
#  1. the front-end engine: Moshi 7B architecture (random weights), bf16, CUDA graphs, batch 1/8/32/64;
#  2. the whole server under load: kame serve on that model, N real-time sessions (1, 8, 32, 64).
# Writes $OUT (default ./gpu-bench)/{frontend.json, load.json, report.md}.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-bench}
mkdir -p "$OUT"
python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
pip install -q -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

timeout 300 kame bench frontend --frontend moshi-7b-random --device cuda --batch-sizes 1,8,32,64 \
    --frames 50 --warmup 10 --json-out "$OUT/frontend.json" | tee "$OUT/frontend.md"

PORT=18999
kame serve --frontend moshi-7b-random --device cuda --asr none --llm local --max-sessions 64 --port $PORT \
    >"$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 240); do curl -fsS "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1 && break; sleep 1; done
timeout 200 kame bench load --url "ws://127.0.0.1:$PORT/api/chat" --levels 1,8,32,64 --seconds 10 \
    --json-out "$OUT/load.json" | tee "$OUT/load.md"
kill -INT $SERVER; wait $SERVER || true
trap - EXIT

{
  echo "# GPU benchmark ($(cat "$OUT/gpu.txt"))"
  echo; echo "## Front-end engine"; echo; tail -n +1 "$OUT/frontend.md" | grep -E '^\||^front-end'
  echo; echo "## Server under load"; echo; grep -E '^\||^largest' "$OUT/load.md"
} > "$OUT/report.md"
cat "$OUT/report.md"
