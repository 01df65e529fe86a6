"""Training smoke benchmark: a few LoRA steps of a front-end on random tokens; step time, tokens/s, peak memory.

    python scripts/bench_train.py --frontend moshi-7b-random --lora-rank 16 --steps 10 --device cuda
    python scripts/bench_train.py --dry-run     # the same logic on the tiny model, on a CPU, in seconds

Prints one JSON object (and writes it to --json-out). The model learns nothing here: random
tokens only exercise the forward/backward pass, the optimizer and the checkpoint at its real size.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from kame.frontend.loader import load_frontend
from kame.training.synthetic import shape_of, write_random_tokens
from kame.training.train import TrainOptions, read_log, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frontend", default="moshi-7b-random")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--dry-run", action="store_true", help="tiny model, CPU, 3 steps: checks the script only")
    args = parser.parse_args()
    if args.dry_run:
        args.frontend, args.device, args.steps, args.chunk, args.lora_rank = "tiny", "cpu", 3, 64, 4
    result = bench(args)
    print(json.dumps(result, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")


def bench(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        shape = _shape(args.frontend)  # from the preset's config: no second model in memory
        write_random_tokens(run, args.frontend, shape, dialogues=4, frames=max(args.chunk + 1, 600))
        cuda = args.device.startswith("cuda")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        train(run, TrainOptions(frontend=args.frontend, steps=args.steps, chunk=args.chunk, batch=args.batch,
                                lora_rank=args.lora_rank or None, device=args.device, log_every=1))
        wall = time.perf_counter() - start
        rows = read_log(run / "train" / "log.jsonl")
        checkpoint = sorted((run / "train").glob("step-*.pt"))[-1]
        steady = rows[2:] or rows  # the first steps include allocator warm-up
        return {
            "frontend": args.frontend, "lora_rank": args.lora_rank, "device": args.device, "chunk": args.chunk,
            "batch": args.batch, "steps": args.steps, "wall_s": round(wall, 1),
            "tokens_per_s": round(sum(r["tokens_per_s"] for r in steady) / len(steady), 1),
            "s_per_step": round(args.batch * args.chunk * (1 + shape.n_q)
                                / (sum(r["tokens_per_s"] for r in steady) / len(steady)), 3),
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            "checkpoint_mib": round(checkpoint.stat().st_size / 2**20, 1),
            "final_loss": rows[-1]["loss"],
        }


def _shape(frontend: str):
    from kame.frontend.presets import RANDOM_PRESETS
    from kame.training.synthetic import Shape

    if frontend in RANDOM_PRESETS:
        config = RANDOM_PRESETS[frontend].lm_config
        return Shape(config["text_card"], config["existing_text_padding_id"], config["n_q"], config["dep_q"],
                     config["card"])
    return shape_of(load_frontend(frontend, "cpu").lm)


if __name__ == "__main__":
    main()
