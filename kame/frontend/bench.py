"""Front-end benchmark: ms per frame of Mimi encode, LM step and Mimi decode, by batch size."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from kame.frontend.engine import FRAME_SIZE, BatchedEngine
from kame.frontend.loader import load_frontend
from kame.frontend.oracle import OracleUpdate

PHASES = ("encode", "lm", "decode")


def bench_batch(engine: BatchedEngine, frames: int, warmup: int, seed: int = 0) -> dict:
    """Step all slots of `engine` together; per-phase medians over `frames` steps."""
    rng = np.random.default_rng(seed)
    slots = [engine.acquire() for _ in range(engine.batch_size)]
    for slot in slots:
        engine.push_oracle(slot, OracleUpdate.reset(0, tuple(range(10, 40))))
    per_phase: dict[str, list[float]] = {p: [] for p in PHASES}
    totals = []
    for index in range(warmup + frames):
        batch = {s: (rng.standard_normal(FRAME_SIZE) * 0.05).astype(np.float32) for s in slots}
        timings: dict[str, float] = {}
        started = time.perf_counter()
        engine.step(batch, timings=timings)
        if index >= warmup:
            totals.append(time.perf_counter() - started)
            for phase in PHASES:
                per_phase[phase].append(timings.get(phase, 0.0))
    for slot in slots:
        engine.release(slot)
    ms = {p: 1000 * statistics.median(v) for p, v in per_phase.items()}
    total = 1000 * statistics.median(totals)
    return {
        "batch": engine.batch_size, **{f"{p}_ms": round(v, 3) for p, v in ms.items()},
        "frame_ms": round(total, 3), "per_session_ms": round(total / engine.batch_size, 3),
        "p95_frame_ms": round(1000 * float(np.percentile(totals, 95)), 3),
    }


def run(source: str, device: str, batch_sizes: list[int], frames: int, warmup: int,
        quantize: str | None = None) -> dict:
    frontend = load_frontend(source, device, quantize=quantize)
    weights_gib = torch.cuda.memory_allocated() / 2**30 if frontend.device.type == "cuda" else None
    rows = []
    for batch in batch_sizes:
        if frontend.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        engine = BatchedEngine(frontend, batch)
        row = bench_batch(engine, frames, warmup)
        if frontend.device.type == "cuda":
            row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        engine.close()
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]["per_session_ms"]
    for row in rows:
        row["per_session_vs_first"] = round(row["per_session_ms"] / base, 3)
    return {
        "frontend": source, "device": str(frontend.device),
        "dtype": str(frontend.dtype) + (f", {quantize} linear layers" if quantize else ""),
        "weights_gib": round(weights_gib, 2) if weights_gib is not None else None,
        "torch_threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "gpu": torch.cuda.get_device_name() if frontend.device.type == "cuda" else None,
        "frames": frames, "rows": rows,
    }


def markdown(result: dict) -> str:
    lines = [
        f"front-end `{result['frontend']}` on {result['device']} ({result['dtype']}), "
        f"median of {result['frames']} frames",
        "",
        "| batch | encode ms | LM step ms | decode ms | frame ms | p95 frame ms | ms per session | vs batch 1 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['batch']} | {r['encode_ms']} | {r['lm_ms']} | {r['decode_ms']} | {r['frame_ms']} | "
                     f"{r['p95_frame_ms']} | {r['per_session_ms']} | {r['per_session_vs_first']} |")
    return "\n".join(lines)


def main_frontend(args: argparse.Namespace) -> int:
    device = args.device
    if args.batch_sizes:
        sizes = [int(x) for x in args.batch_sizes.split(",")]
    else:
        cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        sizes = [1, 8, 32, 64] if cuda else [1, 4, 16]
    result = run(args.frontend, device, sizes, args.frames, args.warmup, getattr(args, "quantize", None))
    print(markdown(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0
