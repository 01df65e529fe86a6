"""Where one engine step's time goes, at the batch sizes that matter for capacity (docs/benchmarks.md, "GPU":
the capacity set, not run yet).

    python scripts/profile_step.py [--frontend moshi-7b-random] [--device cuda] [--batches 64,128]
                                   [--kv-cache int8] [--steps 20] [--json-out FILE]

For each batch: an engine of that many slots, every slot stepping (each with an oracle), warmed (CUDA graphs
captured), then `--steps` steps timed by phase (Mimi encode, the LM's main transformer, the depformer's 8
codebook steps, Mimi decode; the device synchronised after each) and one step under torch.profiler: its top
operators by device time, and how many kernels it launched. What bounds a step (launches, the KV cache's
bandwidth, the matmuls) is read from these; a dry run on the tiny model works on a CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kame.frontend.engine import FRAME_SIZE, BatchedEngine  # noqa: E402
from kame.frontend.loader import load_frontend  # noqa: E402
from kame.frontend.oracle import OracleUpdate  # noqa: E402

PHASES = ("encode", "main", "depformer", "decode")


class PhaseTimer:
    """Wraps the engine's phases (and the LM's two halves) to add each one's synchronised duration."""

    def __init__(self, engine: BatchedEngine) -> None:
        self.device, self.times = engine.device, dict.fromkeys(PHASES, 0.0)
        self.active = False
        engine._encode = self._timed("encode", engine._encode)
        engine._decode = self._timed("decode", engine._decode)
        for state in _lm_gen_states(engine):  # moshi keeps the graphed callables in each view's state
            state.graphed_main = self._timed("main", state.graphed_main)
            if state.graphed_depth is not None:
                state.graphed_depth = self._timed("depformer", state.graphed_depth)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, phase: str, fn):
        def timed(*args):
            if not self.active:
                return fn(*args)
            self._sync()
            started = time.perf_counter()
            with torch.profiler.record_function(f"kame.{phase}"):
                out = fn(*args)
            self._sync()
            self.times[phase] += time.perf_counter() - started
            return out
        return timed


def _lm_gen_states(engine: BatchedEngine) -> list:
    """The LM generator's state of every view size the engine may install (or its only one)."""
    views = engine._rows.views
    if views is None:
        return [engine.lm_gen._streaming_state]
    for n in engine._rows.sizes():
        views.install(n)
    return [states[1][""] for states, _ in views._views.values()]


def profile_batch(frontend, batch: int, kv_cache: str, steps: int, warmup: int) -> dict:
    rng = np.random.default_rng(0)
    engine = BatchedEngine(frontend, batch, kv_cache=kv_cache)
    timer = PhaseTimer(engine)
    try:
        slots = [engine.acquire() for _ in range(batch)]
        for slot in slots:
            engine.push_oracle(slot, OracleUpdate.reset(0, tuple(range(10, 40))))

        def step() -> None:
            engine.step({s: (rng.standard_normal(FRAME_SIZE) * 0.05).astype(np.float32) for s in slots})

        for _ in range(warmup):
            step()
        totals, per_step = [], []
        timer.active = True
        for _ in range(steps):
            timer.times = dict.fromkeys(PHASES, 0.0)
            timer._sync()
            started = time.perf_counter()
            step()
            timer._sync()
            totals.append(time.perf_counter() - started)
            per_step.append(timer.times)
        timer.active = False
        phases = {phase: round(1000 * statistics.median(t[phase] for t in per_step), 2) for phase in PHASES}
        top, kernels = profiled_step(step, engine.device)
        memory = torch.cuda.max_memory_allocated() / 2**30 if engine.device.type == "cuda" else None
    finally:
        engine.close()
    total = 1000 * statistics.median(totals)
    return {"batch": batch, "kv_cache": kv_cache, "step_ms": round(total, 2), "phases_ms": phases,
            "other_ms": round(total - sum(phases.values()), 2), "kernels_per_step": kernels, "top_ops": top,
            "peak_memory_gib": None if memory is None else round(memory, 2)}


def profiled_step(step, device: torch.device) -> tuple[list[dict], int | None]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    cuda = device.type == "cuda"
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)[:15]
    top = [{"op": e.key, "ms": round(getattr(e, key, 0.0) / 1000, 3), "calls": e.count} for e in events]
    kernels = None
    if cuda:
        kernels = sum(1 for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    return top, kernels


def markdown(result: dict) -> str:
    lines = [f"engine step of `{result['frontend']}` on {result['device']}, every slot stepping, median of "
             f"{result['steps']} steps", "",
             "(each phase's median; other: the step's median less theirs: sampling, the oracle, Python)", "",
             "| batch | KV cache | step ms | encode | main transformer | depformer | decode | other | kernels/step | "
             "peak GiB |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        p = r["phases_ms"]
        lines.append(f"| {r['batch']} | {r['kv_cache']} | {r['step_ms']} | {p['encode']} | {p['main']} | "
                     f"{p['depformer']} | {p['decode']} | {r['other_ms']} | {r['kernels_per_step']} | "
                     f"{r['peak_memory_gib']} |")
    for r in result["rows"]:
        lines += ["", f"top operators at batch {r['batch']} ({r['kv_cache']} KV), one step:", "",
                  "| operator | ms | calls |", "|---|---:|---:|"]
        lines += [f"| `{op['op']}` | {op['ms']} | {op['calls']} |" for op in r["top_ops"]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frontend", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="2,4")
    parser.add_argument("--kv-cache", default="model", help="model, int8, or a comma list of both")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    frontend = load_frontend(args.frontend, args.device)
    rows = []
    for kv_cache in args.kv_cache.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            with contextlib.suppress(torch.OutOfMemoryError):
                rows.append(profile_batch(frontend, batch, kv_cache, args.steps, args.warmup))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "top_ops"}), file=sys.stderr, flush=True)
                continue
            print(f"batch {batch} with the {kv_cache} KV cache: out of device memory", file=sys.stderr)
            torch.cuda.empty_cache()
    result = {"frontend": args.frontend, "device": str(frontend.device), "steps": args.steps, "rows": rows}
    print(markdown(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
