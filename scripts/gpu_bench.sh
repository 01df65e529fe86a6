#!/usr/bin/env bash
# GPU benchmark in one command (about 9 minutes on one H200), inside a time budget (GPU_BENCH_BUDGET_S, default
# 540 s: each pass gets what is left, the most valuable first, and the report is written whatever ran).
# GPU_BENCH_SET=capacity (the default; issue #43) runs the checks only a GPU can make (pass 1 below; docs/gpu.md
# lists them, each with the CPU test that covers its logic), then the capacity passes:
#  C1 capacity: kame serve of 128 slots (KV cache auto: int8 where bf16 does not fit) with 2 front processes,
#     under 32/64/96/128 real-time sessions from 8 load processes: frames back, round trip p50/p99, engine
#     step, the server's cores (fronts, engine and codec processes), GPU memory (nvidia-smi's peak);
#  C2 rows: the engine alone, 1 session on 1 slot against 1, 8 and 32 sessions on 128 slots (and 1 on 128
#     stepping the whole batch, as before), int8 KV cache: what a step costs per talking session;
#  C3 profile: one step at batch 64 and 128 (bf16 and int8 KV) by phase (Mimi encode, main transformer,
#     depformer, Mimi decode), its top operators and kernel launches (scripts/profile_step.py);
#  C4 host: the host side alone (--frontend null) at 64/128/192 sessions, one process against 2 fronts;
#  C5 kv-quality: bf16 against int8 KV on the 7B, teacher-forced over 300 frames (scripts/kv_quality.py);
#  C6 one-of-many: the whole server's round trip for one session on 128 slots against 1 slot;
#  C7 long: one slot for 6000 frames (past the 3000-frame context): step time early and late, peak memory;
#  C8 persona: a PersonaPlex-layout 7B (random weights) prefilling a persona (10 s of voice, a role text) beside
#     1, 8, 32 talking sessions: the prefill's time, the talking sessions' frames late or skipped meanwhile.
# GPU_BENCH_SET=all: the earlier passes instead (measured 2026-12-04, docs/benchmarks.md "GPU"):
#  1. the checks only a GPU can make (`pytest -m gpu`: tests/test_gpu.py, CUDA graphs with per-session sampling
#     and per view size, int8 weights, a Kyutai-layout checkpoint read onto CUDA; tests/test_int8_attention.py,
#     the Triton int8 attention compiled at Moshi 7B's shapes and inside CUDA graphs);
#  2. the front-end engine: Moshi 7B architecture (random weights), bf16, CUDA graphs, batch 1/8/32/64;
#  3. the whole server under load: kame serve on that model, N real-time sessions (1, 8, 32, 64), tick clock;
#  4. a training smoke run: LoRA on moshi-7b-random for a few steps (scripts/bench_train.py);
#  5. the same load on the eager clock (8, 32, 64);
#  6. int8 (--quantize int8, bitsandbytes) where bitsandbytes imports: memory, step time, sessions that fit;
#     then the host side alone (scripts/bench_host.py, no model) on this machine's cores;
#  7. with two GPUs: two replicas behind kame serve --ray, the same load;
#  8. where the Hugging Face hub answers: the real checkpoints (SakanaAI/kame, kyutai/stt-1b-en_fr) as a
#     user gets them: `kame doctor`, the load time of `kame serve --device cuda`, and one spoken question
#     end to end (the first assistant text, the transcript, the oracle and its lead). The LLM is the
#     openai profile when OPENAI_API_KEY is set, else $KAME_GPU_LLM (default: embedded). Skipped offline.
# Install: into .venv-gpu from the package index; or, on a machine with no network and its own torch, from
# wheels in .whl/ (this project's wheel and what the image lacks; docs/benchmarks.md, "GPU", says how to make
# them) into a --target folder over the image's packages.
# GPU_BENCH_DRY=1: the same passes on the tiny model on the CPU, to check the script itself in a minute or two.
# Writes $OUT (default ./gpu-bench)/{frontend.json, fit.md, load.json, train.json, real/*, report.md, ...}.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-bench}
mkdir -p "$OUT"
STARTED=$SECONDS
BUDGET=${GPU_BENCH_BUDGET_S:-540}
left() { echo $((BUDGET - (SECONDS - STARTED))); }
# a pass's limit: its own, or what is left of the budget less 25 s for the report; 0 when nothing is left
limit() { local l=$(( $(left) - 25 )); [ "$l" -lt "$1" ] || l=$1; [ "$l" -gt 0 ] || l=0; echo "$l"; }
# GPU_BENCH_SKIP=frontend,train,...: passes left out (a rerun of what failed): capacity, rows, profile, host,
# kv-quality, one-of-many, long; gpu-tests, frontend, load, train,
# load-eager, int8, host
skip() { [[ ",${GPU_BENCH_SKIP:-}," == *",$1,"* ]]; }
SET=${GPU_BENCH_SET:-capacity}
if [ "${GPU_BENCH_DRY:-0}" = 1 ]; then
    MODEL=tiny; DEVICE=cpu; SESSIONS=4; CLIENTS=1; TRAIN=(--dry-run); HOST_LEVELS=2,4; HOST_PROFILE=4
    CAP_SLOTS=4; CAP_LEVELS=2,4; CAP_CLIENTS=1; CAP_FRONTS=2; ROWS_SESSIONS=1,2; PROFILE_BATCHES=2,4
    CAP_HOST_LEVELS=2,4; KVQ_FRAMES=60; LONG_FRAMES=200; PERSONA=(--levels 1,2 --seconds 4)
else
    # the load generator carries ~30 sessions per process (its Opus encoding holds the GIL): 64 need several,
    # else it, not the server, is what saturates (one process did at 64 on the H200, 2026-12-04)
    MODEL=moshi-7b-random; DEVICE=cuda; SESSIONS=64; CLIENTS=4; HOST_LEVELS=16,32,64,128; HOST_PROFILE=64
    TRAIN=(--frontend $MODEL --lora-rank 16 --steps 12 --chunk 512 --device $DEVICE)
    # 128 sessions: ~30 per load process, and the host side split over 2 fronts (docs/scaling.md)
    CAP_SLOTS=128; CAP_LEVELS=32,64,96,128; CAP_CLIENTS=8; CAP_FRONTS=2; ROWS_SESSIONS=1,8,32
    PROFILE_BATCHES=64,128; CAP_HOST_LEVELS=64,128,192; KVQ_FRAMES=300; LONG_FRAMES=6000
    PERSONA=(--frontend personaplex-7b-random --device cuda --levels 1,8,32 --seconds 8)
fi
if [ -d .whl ]; then  # offline: the image's python3 and torch, the rest from the wheels beside the code
    SITE=${KAME_SITE:-/tmp/kame-site}
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --ignore-requires-python --upgrade \
        --target "$SITE" .whl/*.whl 2>&1 | grep -v "^WARNING" | tail -3 || true
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
else
    python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
    pip install -q -e ".[train]" 2>&1 | tail -2  # bitsandbytes (for --quantize int8) comes with moshi on Linux
    pip install -q pytest pytest-timeout hypothesis py-spy 2>&1 | tail -1
fi
python3 -c "import sys, torch, moshi, fastapi; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'moshi', moshi.__version__)" | tee "$OUT/versions.txt"
if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
else
    echo "dry run: $MODEL on the CPU" | tee "$OUT/gpu.txt"
fi

# 1. the checks only a GPU can make (skipped, and said so, on a dry run). addopts replaced: pyproject's names
# pytest-xdist's --dist and pytest-timeout's --timeout, which this pass neither uses nor may have installed
skip gpu-tests || timeout "$(limit 150)" python3 -m pytest -q -p no:cacheprovider -p no:xdist -o addopts=-ra -m gpu \
    tests/test_gpu.py tests/test_int8_attention.py 2>&1 | tee "$OUT/gpu-tests.txt" | tail -5 || true

PORT=18999
serve_until_ready() {  # NAME UNTIL SLOTS FLAGS...: kame serve on the model in the background ($SERVER) until
    # /healthz answers or UNTIL (a $SECONDS value) passes; the load comes from one address: the per-address
    # cap (8 by default, docs/security.md) raised past the levels
    local name=$1 until=$2 slots=$3 started=$SECONDS
    shift 3
    KAME_MAX_CONNECTIONS_PER_IP=$((4 * slots)) kame serve --frontend $MODEL --device $DEVICE --asr none --llm local \
        --max-sessions "$slots" --port $PORT "$@" >"$OUT/serve-$name.log" 2>&1 &
    SERVER=$!
    trap 'kill -INT $SERVER 2>/dev/null || true' EXIT
    while [ $SECONDS -lt "$until" ] && ! curl -fsS "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1; do
        kill -0 $SERVER 2>/dev/null || break
        sleep 1
    done
    echo "$name: server ready after $((SECONDS - started)) s" | tee "$OUT/$name.md"
}
stop_server() {
    kill -INT $SERVER 2>/dev/null; timeout 40 tail --pid=$SERVER -f /dev/null || kill -9 $SERVER 2>/dev/null || true
    trap - EXIT
}
if [ "$SET" = capacity ]; then
# C1. 128 sessions of the 7B on one card: kame serve with 2 fronts, KV cache auto; GPU memory sampled meanwhile
if ! skip capacity && [ "$(limit 260)" -gt 60 ]; then
    until=$((SECONDS + $(limit 260)))
    serve_until_ready capacity $until $CAP_SLOTS --kv-cache auto --fronts $CAP_FRONTS
    grep -E "KV cache|captured|fronts" "$OUT/serve-capacity.log" | tee -a "$OUT/capacity.md" || true
    if [ "$DEVICE" = cuda ]; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >"$OUT/capacity-gpu-mem.txt" &
        SMI=$!
    fi
    timeout $((until - SECONDS > 1 ? until - SECONDS : 1)) kame bench load --url "ws://127.0.0.1:$PORT/api/chat" \
        --levels $CAP_LEVELS --seconds 10 --processes $CAP_CLIENTS --server-pid $SERVER \
        --json-out "$OUT/capacity.json" | tee -a "$OUT/capacity.md" || true
    if [ "$DEVICE" = cuda ]; then
        kill $SMI 2>/dev/null || true
        echo "GPU memory used, peak: $(sort -n "$OUT/capacity-gpu-mem.txt" | tail -1) MiB" | tee -a "$OUT/capacity.md"
    fi
    stop_server
fi
# C2. what a step costs per talking session: 1 of 1 slot against 1, 8, 32 of 128 (int8 KV: 128 bf16 do not fit)
skip rows || timeout "$(limit 170)" python3 scripts/bench_capacity.py engine --frontend $MODEL --device $DEVICE \
    --slots 1,$CAP_SLOTS --sessions $ROWS_SESSIONS --kv-cache int8 --frames 50 --warmup 10 --rounds 1 --threads 4 \
    --json-out "$OUT/rows.json" 2>"$OUT/rows.log" | tee "$OUT/rows.md" || true
# C3. one step at large batch, by phase, with its top operators
skip profile || timeout "$(limit 150)" python3 scripts/profile_step.py --frontend $MODEL --device $DEVICE \
    --batches $PROFILE_BATCHES --kv-cache model,int8 --steps 10 --json-out "$OUT/profile.json" \
    2>"$OUT/profile.log" | tee "$OUT/profile.md" || true
# C4. the host side alone: one process against two fronts
skip host || [ "$(limit 150)" -lt 60 ] || timeout "$(limit 150)" python3 scripts/bench_host.py --asr none \
    --fronts 0,$CAP_FRONTS --levels $CAP_HOST_LEVELS --seconds 8 --profile "${CAP_HOST_LEVELS##*,}" \
    --json-out "$OUT/host.json" 2>"$OUT/host.log" | tee "$OUT/host.md" || true
# C5. the int8 KV cache's cost in quality on the 7B (bf16 reference, teacher-forced)
skip kv-quality || timeout "$(limit 120)" python3 scripts/kv_quality.py --frontend $MODEL --device $DEVICE \
    --frames $KVQ_FRAMES --json-out "$OUT/kv-quality.json" 2>"$OUT/kv-quality.log" | tee "$OUT/kv-quality.md" || true
# C6. the whole server's round trip for one session: 1 slot against 128
skip one-of-many || [ "$(limit 220)" -lt 120 ] || timeout "$(limit 220)" python3 scripts/bench_capacity.py server \
    --frontend $MODEL --device $DEVICE --slots 1,$CAP_SLOTS --levels 1 --kv-cache int8 --rounds 1 --seconds 10 \
    --json-out "$OUT/one-of-many.json" 2>"$OUT/one-of-many.log" | tee "$OUT/one-of-many.md" || true
# C7. one slot far past its context: step time early and late, memory flat
skip long || timeout "$(limit 150)" python3 scripts/bench_capacity.py engine --frontend $MODEL --device $DEVICE \
    --slots 1 --sessions 1 --frames $LONG_FRAMES --warmup 0 --rounds 1 --json-out "$OUT/long.json" \
    2>"$OUT/long.log" | tee "$OUT/long.md" || true
# C8. a persona's prefill (PersonaPlex 7B layout) beside 1, 8, 32 talking sessions: its time, their frames' lag
skip persona || timeout "$(limit 150)" python3 scripts/bench_persona.py "${PERSONA[@]}" \
    2>"$OUT/persona.log" | tee "$OUT/persona.md" || true
fi

if [ "$SET" = all ]; then
# 2. the front-end engine on its own
skip frontend || timeout "$(limit 170)" kame bench frontend --frontend $MODEL --device $DEVICE --batch-sizes 1,8,32,64 \
    --frames 50 --warmup 10 --json-out "$OUT/frontend.json" 2>"$OUT/frontend.log" | tee "$OUT/frontend.md" || true
load_run() {  # NAME CLOCK LEVELS LIMIT_S: kame serve on the model with that clock, then bench load
    if skip "$1"; then return; fi
    local budget; budget=$(limit "$4")
    [ "$budget" -gt 30 ] || { echo "$1: skipped, out of time" | tee "$OUT/$1.md"; return; }
    local until=$((SECONDS + budget))
    KAME_ENGINE_CLOCK=$2 serve_until_ready "$1" $until $SESSIONS
    timeout $((until - SECONDS > 1 ? until - SECONDS : 1)) kame bench load --url "ws://127.0.0.1:$PORT/api/chat" \
        --levels "$3" --seconds 10 --processes $CLIENTS --json-out "$OUT/$1.json" | tee -a "$OUT/$1.md" || true
    stop_server
}
# 3. the server under load on the tick clock (a GPU's default)
load_run load tick 1,8,32,64 160

# 4. training smoke: LoRA (rank 16) on the 7B architecture, random tokens, 512-frame chunks: step time,
# tokens/s, peak memory (docs/training.md has the estimates these check)
skip train || timeout "$(limit 150)" python3 scripts/bench_train.py "${TRAIN[@]}" --json-out "$OUT/train.json" \
    2>"$OUT/train.log" | tee "$OUT/train.md" || true

# 5. the same load on the eager clock: which of the two gives the lower latency, and at how many steps,
# decides a GPU's default (auto is the tick there today; docs/benchmarks.md, "The frame clock")
load_run load-eager eager 8,32,64 130

# 6. int8 weights, where bitsandbytes imports (an offline image without its wheel skips this)
if skip int8; then
    :
elif [ "$DEVICE" = cuda ] && python3 -c "import bitsandbytes" 2>/dev/null; then
    timeout "$(limit 120)" kame bench frontend --frontend $MODEL --device cuda --quantize int8 --batch-sizes 1,8,32 \
        --frames 50 --warmup 10 --json-out "$OUT/frontend-int8.json" 2>"$OUT/frontend-int8.log" \
        | tee "$OUT/frontend-int8.md" || true
else
    echo "int8: skipped (bitsandbytes does not import here)" | tee "$OUT/frontend-int8.md"
fi
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
    rows = [r for r in result["rows"] if r.get("peak_mem_gib")]
    if len(rows) < 2:  # a CPU run (dry) has no device peak to read
        continue
    first, last = rows[0], rows[-1]
    per_slot = (last["peak_mem_gib"] - first["peak_mem_gib"]) / (last["batch"] - first["batch"])
    base = first["peak_mem_gib"] - per_slot * first["batch"]
    fits = [max(0, int((card * 0.95 - base) / per_slot)) for card in (16, 24, 48, 80, 141)]
    print(f"| {result['dtype']} | {result['weights_gib']} | {per_slot:.2f} | " + " | ".join(map(str, fits)) + " |")
PY

# the host side on this machine's cores: `kame serve --frontend null` (no model, no GPU) under 16-128
# sessions, and a py-spy profile of its GIL holder at 64: what one server process carries when the
# front-end costs nothing (a 2-core VM cannot run the server and the load both beyond ~48; docs/scaling.md)
if skip host; then
    :
elif [ "$(limit 150)" -ge 60 ]; then
    timeout "$(limit 150)" python3 scripts/bench_host.py --asr none --levels $HOST_LEVELS --seconds 10 \
        --profile $HOST_PROFILE --json-out "$OUT/host.json" 2>"$OUT/host.log" | tee "$OUT/host.md" || true
fi

# 7. two engine replicas behind Ray Serve's proxy, on a machine with two GPUs (prepared; skipped on one)
if [ "$DEVICE" = cuda ] && [ "$(nvidia-smi --list-gpus | wc -l)" -ge 2 ] && [ "$(limit 200)" -ge 200 ]; then
    [ -d .whl ] || pip install -q -e ".[ray]" 2>&1 | tail -1
    KAME_PORT=$PORT kame serve --ray --replicas 2 --frontend $MODEL --device cuda --asr none --llm local \
        --max-sessions 32 >"$OUT/serve-ray.log" 2>&1 &
    RAYSERVER=$!
    for _ in $(seq 300); do curl -fsS "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1 && break; sleep 1; done
    timeout "$(limit 200)" kame bench load --url "ws://127.0.0.1:$PORT/api/chat" --levels 1,8,32,64 --seconds 10 \
        --processes $CLIENTS --json-out "$OUT/load-ray.json" | tee "$OUT/load-ray.md" || true
    kill -INT $RAYSERVER; wait $RAYSERVER || true
fi

# the real checkpoints, where the hub answers (a lent benchmark machine has no network: skipped there)
if [ "$DEVICE" = cuda ] && [ "$(limit 300)" -ge 300 ] && timeout 30 python3 -c \
        "import sys; from kame.frontend.checkpoint import hub_reachable; sys.exit(not hub_reachable(None))"; then
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
    echo "ready after $(python3 -c "import time; print(round(time.time() - $started, 1))") s (downloads included)" \
        | tee "$OUT/real/load.txt"
    timeout 120 kame client --url "ws://127.0.0.1:$PORT/api/chat" --input tests/fixtures/question.wav \
        --output "$OUT/real/answer.wav" --tail 8 --json >"$OUT/real/client.jsonl" || true
    kill -INT $REALSERVER 2>/dev/null; wait $REALSERVER || true
    python3 - "$OUT/real/client.jsonl" >"$OUT/real/summary.md" <<'PY' || true
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

fi  # GPU_BENCH_SET=all

section() {  # TITLE FILE [PATTERN]: a file's table lines (or all of it) under a heading, or why it is missing
    echo; echo "## $1"; echo
    if [ -s "$2" ]; then grep -E "${3:-.}" "$2" || echo "(no table: see $(basename "$2"))"; else echo "(not run)"; fi
}
{
  echo "# GPU benchmark ($(cat "$OUT/gpu.txt"))"
  echo; cat "$OUT/versions.txt"; echo; echo "whole run: $((SECONDS - STARTED)) s of a $BUDGET s budget"
  section "GPU tests" "$OUT/gpu-tests.txt" 'passed|failed|skipped|error'
  if [ "$SET" = capacity ]; then
    section "Capacity: $CAP_SLOTS slots, $CAP_FRONTS fronts, KV cache auto" "$OUT/capacity.md" '^\||ready|KV cache|GPU memory|largest'
    section "A step per talking session (engine alone)" "$OUT/rows.md" '^\||^engine'
    section "One step at large batch, by phase" "$OUT/profile.md"
    section "Host side alone: one process against fronts" "$OUT/host.md" '^\||^profile'
    section "int8 KV cache against bf16 (teacher-forced)" "$OUT/kv-quality.md"
    section "One session on $CAP_SLOTS slots against 1 (whole server)" "$OUT/one-of-many.md" '^\||^whole'
    section "One slot past its context" "$OUT/long.md" '^\||^engine'
    section "A persona's prefill beside talking sessions (PersonaPlex 7B layout)" "$OUT/persona.md" '^\|'
  fi
  section "Front-end engine" "$OUT/frontend.md" '^\||^front-end'
  section "Front-end engine, int8" "$OUT/frontend-int8.md" '^\||^front-end|skipped'
  section "Sessions that fit (95 % of the card)" "$OUT/fit.md"
  section "Server under load, tick clock" "$OUT/load.md" '^\||^largest|ready|skipped'
  section "Server under load, eager clock" "$OUT/load-eager.md" '^\||^largest|ready|skipped'
  section "Host side (--frontend null, no model): one server process's CPU" "$OUT/host.md" '^\||^profile'
  [ -f "$OUT/load-ray.md" ] && section "Two replicas behind Ray Serve" "$OUT/load-ray.md" '^\||^largest'
  if [ -f "$OUT/real/summary.md" ]; then
    echo; echo "## Real checkpoints (SakanaAI/kame, kyutai/stt-1b-en_fr)"; echo
    cat "$OUT/real/load.txt"; echo; cat "$OUT/real/summary.md"; echo; echo '```'; cat "$OUT/real/doctor.txt"; echo '```'
  else
    echo; echo "## Real checkpoints"; echo; echo "(skipped: the hub does not answer here, or too little time was left)"
  fi
  echo; echo "## Training smoke (LoRA r16, $MODEL, random tokens)"; echo; echo '```'
  cat "$OUT/train.json" 2>/dev/null || { echo "(no result)"; tail -5 "$OUT/train.log" 2>/dev/null; }
  echo '```'
} > "$OUT/report.md" || true
cat "$OUT/report.md"
