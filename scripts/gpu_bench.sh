#!/usr/bin/env bash
# GPU benchmark in one command (about 10 minutes on one H200): installs the project, then
#  1. the front-end engine: Moshi 7B architecture (random weights), bf16, CUDA graphs, batch 1/8/32/64;
#  2. the same in int8 (--quantize int8, bitsandbytes), batch 1/8/32: memory, step time, sessions that fit;
#  3. the whole server under load: kame serve on that model, N real-time sessions (1, 8, 32, 64), on the
#     tick clock (the GPU default) and on the eager one (8, 32, 64);
#  4. with two GPUs: two replicas behind kame serve --ray, the same load;
#  5. a training smoke run: LoRA on moshi-7b-random for a few steps (scripts/bench_train.py);
#  6. where the Hugging Face hub answers: the real checkpoints (SakanaAI/kame, kyutai/stt-1b-en_fr) as a
#     user gets them: `kame doctor`, the load time of `kame serve --device cuda`, and one spoken question
#     end to end (the first assistant text, the transcript, the oracle and its lead). The LLM is the
#     openai profile when OPENAI_API_KEY is set, else $KAME_GPU_LLM (default: embedded). Skipped offline.
# Writes $OUT (default ./gpu-bench)/{frontend.json, frontend-int8.json, fit.md, load.json, train.json,
# real/*, report.md}.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-bench}
mkdir -p "$OUT"
python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
pip install -q -e ".[train]" 2>&1 | tail -2  # bitsandbytes (for --quantize int8) comes with moshi on Linux
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
# the checks only a GPU can make (CUDA graphs with per-session sampling, int8 weights)
pip install -q pytest pytest-timeout hypothesis 2>&1 | tail -1
timeout 300 python -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tee "$OUT/gpu-tests.txt" | tail -5 || true

timeout 300 kame bench frontend --frontend moshi-7b-random --device cuda --batch-sizes 1,8,32,64 \
    --frames 50 --warmup 10 --json-out "$OUT/frontend.json" | tee "$OUT/frontend.md"
timeout 240 kame bench frontend --frontend moshi-7b-random --device cuda --quantize int8 --batch-sizes 1,8,32 \
    --frames 50 --warmup 10 --json-out "$OUT/frontend-int8.json" | tee "$OUT/frontend-int8.md" || true
# sessions that fit per card size: weights + per-slot growth of the peak (KV cache, activations), measured
python3 - "$OUT" >"$OUT/fit.md" <<'PY' || true
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| weights | weights GiB | GiB per extra slot | 16 GiB | 24 GiB | 48 GiB | 80 GiB | 141 GiB |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for name in ("frontend.json", "frontend-int8.json"):
    if not (out / name).exists():
        continue
    result = json.loads((out / name).read_text())
    rows = [r for r in result["rows"] if "peak_mem_gib" in r]
    first, last = rows[0], rows[-1]
    per_slot = (last["peak_mem_gib"] - first["peak_mem_gib"]) / (last["batch"] - first["batch"])
    base = first["peak_mem_gib"] - per_slot * first["batch"]
    fits = [max(0, int((card * 0.95 - base) / per_slot)) for card in (16, 24, 48, 80, 141)]
    print(f"| {result['dtype']} | {result['weights_gib']} | {per_slot:.2f} | " + " | ".join(map(str, fits)) + " |")
PY
cat "$OUT/fit.md"

PORT=18999
load_run() {  # NAME CLOCK LEVELS LIMIT_S: kame serve on the 7B architecture with that clock, then bench load
    KAME_ENGINE_CLOCK=$2 kame serve --frontend moshi-7b-random --device cuda --asr none --llm local \
        --max-sessions 64 --port $PORT >"$OUT/serve-$1.log" 2>&1 &
    SERVER=$!
    trap 'kill -INT $SERVER 2>/dev/null || true' EXIT
    for _ in $(seq 240); do curl -fsS "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1 && break; sleep 1; done
    timeout "$4" kame bench load --url "ws://127.0.0.1:$PORT/api/chat" --levels "$3" --seconds 10 \
        --json-out "$OUT/$1.json" | tee "$OUT/$1.md" || true
    kill -INT $SERVER; wait $SERVER || true
    trap - EXIT
}
load_run load tick 1,8,32,64 200
# the same load on the eager clock: which of the two gives the lower latency, and at how many steps,
# decides a GPU's default (auto is the tick there today; docs/benchmarks.md, "The frame clock")
load_run load-eager eager 8,32,64 120

# two engine replicas behind Ray Serve's proxy, on a machine with two GPUs (prepared; skipped on one)
if [ "$(nvidia-smi --list-gpus | wc -l)" -ge 2 ]; then
    pip install -q -e ".[ray]" 2>&1 | tail -1
    KAME_PORT=$PORT kame serve --ray --replicas 2 --frontend moshi-7b-random --device cuda --asr none --llm local \
        --max-sessions 32 >"$OUT/serve-ray.log" 2>&1 &
    RAYSERVER=$!
    for _ in $(seq 300); do curl -fsS "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1 && break; sleep 1; done
    timeout 200 kame bench load --url "ws://127.0.0.1:$PORT/api/chat" --levels 1,8,32,64 --seconds 10 \
        --json-out "$OUT/load-ray.json" | tee "$OUT/load-ray.md" || true
    kill -INT $RAYSERVER; wait $RAYSERVER || true
fi

# training smoke: LoRA (rank 16) on the 7B architecture, random tokens, 512-frame chunks: step time,
# tokens/s, peak memory (docs/training.md has the estimates these check)
timeout 420 python scripts/bench_train.py --frontend moshi-7b-random --lora-rank 16 --steps 12 --chunk 512 \
    --device cuda --json-out "$OUT/train.json" 2>"$OUT/train.log" | tee "$OUT/train.md" || true

# the real checkpoints, where the hub answers (a lent benchmark machine has no network: skipped there)
if python -c "import sys; from kame.frontend.checkpoint import hub_reachable; sys.exit(not hub_reachable(None))"; then
    mkdir -p "$OUT/real"
    LLM=${KAME_GPU_LLM:-$([ -n "${OPENAI_API_KEY:-}" ] && echo openai || echo embedded)}
    kame doctor --device cuda --llm "$LLM" | tee "$OUT/real/doctor.txt" || true
    started=$(date +%s.%N)
    kame serve --device cuda --llm "$LLM" --port $PORT >"$OUT/real/serve.log" 2>&1 &
    REALSERVER=$!
    for _ in $(seq 1800); do  # downloads included: up to 30 min
        curl -fsS "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1 && break
        kill -0 $REALSERVER 2>/dev/null || break
        sleep 1
    done
    echo "ready after $(python -c "import time; print(round(time.time() - $started, 1))") s (downloads included)" \
        | tee "$OUT/real/load.txt"
    timeout 120 kame client --url "ws://127.0.0.1:$PORT/api/chat" --input tests/fixtures/question.wav \
        --output "$OUT/real/answer.wav" --tail 8 --json >"$OUT/real/client.jsonl" || true
    kill -INT $REALSERVER 2>/dev/null; wait $REALSERVER || true
    python - "$OUT/real/client.jsonl" >"$OUT/real/summary.md" <<'PY' || true
import json, sys, wave
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
with wave.open("tests/fixtures/question.wav") as w:
    spoken = w.getnframes() / w.getframerate()
events = [(r["t"], r["event"]) for r in rows if r.get("type") == "event"]
texts = [r["t"] for r in rows if r.get("type") == "text"]
finals = [e["text"] for _, e in events if e.get("type") == "transcript" and e.get("final")]
oracle = [f"{t:.2f} s {e['op']}: {e['text']}" for t, e in events if e.get("type") == "oracle"]
leads = [e["lead_s"] for _, e in events if e.get("type") == "oracle_lead"]
after = [t - spoken for t in texts if t >= spoken]
summary = next((r for r in rows if r.get("type") == "summary"), {})
print(f"- question: {spoken:.2f} s of speech (tests/fixtures/question.wav)")
print(f"- first assistant text after the question ended: {after[0]:.2f} s" if after else "- no assistant text after the question")
print(f"- final transcript: {finals}")
print(f"- oracle lead: {leads}")
print("- oracle: " + "; ".join(oracle[:8]))
print(f"- assistant said: {summary.get('assistant_text', '')!r}")
PY
    cat "$OUT/real/summary.md"
fi

{
  echo "# GPU benchmark ($(cat "$OUT/gpu.txt"))"
  echo; echo "## GPU tests"; echo; tail -3 "$OUT/gpu-tests.txt"
  echo; echo "## Front-end engine"; echo; tail -n +1 "$OUT/frontend.md" | grep -E '^\||^front-end'
  echo; echo "## Front-end engine, int8"; echo; grep -E '^\||^front-end' "$OUT/frontend-int8.md" || true
  echo; echo "## Sessions that fit (95 % of the card)"; echo; cat "$OUT/fit.md"
  echo; echo "## Server under load"; echo; grep -E '^\||^largest' "$OUT/load.md"
  echo; echo "## Server under load, eager clock"; echo; grep -E '^\||^largest' "$OUT/load-eager.md" || true
  if [ -f "$OUT/load-ray.md" ]; then
    echo; echo "## Two replicas behind Ray Serve"; echo; grep -E '^\||^largest' "$OUT/load-ray.md"
  fi
  if [ -f "$OUT/real/summary.md" ]; then
    echo; echo "## Real checkpoints (SakanaAI/kame, kyutai/stt-1b-en_fr)"; echo
    cat "$OUT/real/load.txt"; echo; cat "$OUT/real/summary.md"; echo; echo '```'; cat "$OUT/real/doctor.txt"; echo '```'
  fi
  if [ -f "$OUT/train.json" ]; then
    echo; echo "## Training smoke (LoRA r16, moshi-7b-random, random tokens)"; echo; echo '```'; cat "$OUT/train.json"; echo '```'
  fi
} > "$OUT/report.md"
cat "$OUT/report.md"
