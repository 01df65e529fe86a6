"""`kame train` (dialogues in, checkpoint out: every stage, each cached) and `kame export`.

Stages, all under RUN: prepared/ and oracles/ and tokens/ (the data stages), train/, eval.json,
checkpoint/. A rerun skips what is already done; `--resume` continues the training itself.
Under `torchrun`, rank 0 runs the data stages, eval and export while the other ranks wait.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from kame.errors import KameError
from kame.flags import add_device_flag, add_frontend_flag
from kame.training.runfiles import ORACLE_STRATEGIES

# what an option is when neither the command line nor a recipe gives it
DEFAULTS = {"chunk": 512, "seed": 0, "oracles": "random", "device": "auto", "augment": True, "audio_weight": 1.0,
            "fsdp": False}


def register_train(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser("train", help="train a KAME front-end: recorded dialogues (or a recipe) in, checkpoint out")
    train.add_argument("--recipe", default=None, metavar="NAME|FILE",
                       help="a TOML file of these options (or a shipped recipe: tiny-copy); the command line wins")
    train.add_argument("--data", default=None, help="folder of dialogue WAVs (user left, assistant right)")
    add_frontend_flag(train, base=True)
    train.add_argument("--out", required=True, help="the run folder: every stage's output goes under it")
    train.add_argument("--steps", type=int, default=None, help="optimizer steps (default: by model size)")
    train.add_argument("--chunk", type=int, default=None, help="frames per training window (default 512)")
    train.add_argument("--batch", type=int, default=None, help="windows per step and process (default: by size)")
    train.add_argument("--lr", type=float, default=None, help="peak learning rate (default: by size)")
    train.add_argument("--seed", type=int, default=None, help="default 0")
    train.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                       help="write RUN/train/step-N.pt every N steps (default: four times per run)")
    train.add_argument("--oracles", default=None, choices=ORACLE_STRATEGIES,
                       help="how the oracle of each turn is simulated (default random)")
    train.add_argument("--llm", default=None, metavar="PROFILE", help="with --oracles llm: the backend profile")
    train.add_argument("--asr-model", default=None, help="the ASR that times the words of untranscribed dialogues")
    train.add_argument("--lora-rank", type=int, default=None, metavar="R",
                       help="LoRA adapters of rank R instead of a full fine-tune")
    train.add_argument("--augment", action=argparse.BooleanOptionalAction, default=None,
                       help="jitter and thin each example's oracle (default); --no-augment feeds it as recorded")
    train.add_argument("--audio-weight", type=float, default=None, metavar="W",
                       help="the audio loss's weight against the text loss (default 1; 0: text only)")
    train.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=None,
                       help="under torchrun: shard weights, gradients and optimizer state across the processes "
                            "(FSDP2), for full fine-tunes too big for one GPU (default: DDP, a copy per process)")
    add_device_flag(train, default=None)  # None: the recipe's, else DEFAULTS'
    train.add_argument("--resume", action="store_true", help="continue the training from RUN/train's newest checkpoint")
    train.add_argument("--from-tokens", action="store_true", help="start from RUN/tokens (skip the data stages)")
    train.set_defaults(func=_cmd_train)

    export = sub.add_parser("export", help="write RUN/checkpoint from a training run's newest checkpoint")
    export.add_argument("--run", required=True, help="the run folder of `kame train`")
    add_device_flag(export)
    export.set_defaults(func=_cmd_export)


def apply_recipe(args: argparse.Namespace) -> dict | None:
    """Fill the options the command line left out from --recipe, then from DEFAULTS; the recipe's
    [synthetic] table, if it has one."""
    synthetic = None
    if args.recipe:
        from kame.training.recipe import load

        recipe = load(args.recipe)
        for key, value in recipe.options.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
        synthetic = recipe.synthetic
        if synthetic is not None and args.data:
            raise KameError(f"--data and recipe {recipe.path}'s [synthetic] data: one source of dialogues at a time")
    for key, value in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return synthetic


def _check_args(args: argparse.Namespace, synthetic: dict | None) -> None:
    if not args.frontend:
        raise KameError("kame train needs --frontend BASE (a preset, a directory or a hub repo id), "
                        "on the command line or in its --recipe")
    if not args.from_tokens and not args.data and synthetic is None:
        raise KameError("kame train needs --data DIR (the recorded dialogues), "
                        "or --from-tokens to start from RUN/tokens")
    if args.data and not Path(args.data).is_dir():
        raise KameError(f"--data {args.data}: no such folder")
    if args.oracles == "llm" and not args.llm:
        raise KameError("--oracles llm needs --llm PROFILE (the backend that writes the oracles)")
    for name in ("lora_rank", "steps", "chunk", "batch", "checkpoint_every"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise KameError(f"--{name.replace('_', '-')} must be at least 1")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise KameError(f"--lr must be a positive number, not {args.lr}")
    if not (math.isfinite(args.audio_weight) and args.audio_weight >= 0):
        raise KameError(f"--audio-weight must be 0 or more, not {args.audio_weight}")


def data_stages(args: argparse.Namespace, run: Path) -> None:
    """prepare -> oracles -> tokens, each skipping the dialogues it has already done."""
    try:
        from kame.training.dialogues import prepare
        from kame.training.oracles import simulate
        from kame.training.tokens import tokenize
    except ImportError as exc:
        raise KameError(f"the data stages are not available ({exc}); "
                        "start from existing tokens with --from-tokens") from exc
    prepare(Path(args.data), run, asr_model=args.asr_model, device=args.device)
    simulate(run, strategy=args.oracles, llm=args.llm, seed=args.seed)
    tokenize(run, frontend=args.frontend, device=args.device)


def check_manifest(run: Path, frontend: str) -> None:
    from kame.training.dataset import read_manifest

    made_with = read_manifest(run)["frontend"]
    if made_with != frontend:
        raise KameError(f"{run / 'tokens'} was made with front-end {made_with!r}, not {frontend!r}: pass "
                        f"--frontend {made_with}, or delete {run / 'tokens'} to remake the tokens")


def _cmd_train(args: argparse.Namespace) -> int:
    synthetic = apply_recipe(args)
    _check_args(args, synthetic)
    from kame.training.train import TrainOptions, barrier, init_distributed, rank_device, ranks, train

    run = Path(args.out)
    r = ranks()
    init_distributed(rank_device(args.device, r))
    if r.main and not args.from_tokens:
        if synthetic is not None:
            from kame.training.recipe import synthetic_stage

            synthetic_stage(run, synthetic, args.frontend, args.seed)
        else:
            data_stages(args, run)
    barrier()
    check_manifest(run, args.frontend)
    options = TrainOptions(frontend=args.frontend, steps=args.steps, chunk=args.chunk, batch=args.batch, lr=args.lr,
                           lora_rank=args.lora_rank, device=args.device, seed=args.seed, resume=args.resume,
                           checkpoint_every=args.checkpoint_every, augment=args.augment,
                           audio_weight=args.audio_weight, fsdp=args.fsdp)
    train(run, options)
    if r.main:
        _finish(run, args.device)
    # every rank leaves the process group together: one that destroyed it while rank 0 still evaluated was
    # seen to abort at exit ("terminate called without an active exception", torch 2.15, gloo)
    barrier()
    _shutdown()
    if r.world > 1:
        _leave_without_finalizing()
    return 0


def _finish(run: Path, device: str) -> None:
    from kame.training.evaluate import evaluate
    from kame.training.export import export

    result = evaluate(run, device)
    checkpoint = export(run, device)
    own, other = result["text_accuracy"]["own_oracle"], result["text_accuracy"]["other_oracle"]
    print(f"checkpoint: {checkpoint}  (use --frontend {checkpoint})")
    print(f"oracle gain: {100 * (own - other):+.1f} points of text accuracy on {result['dialogues']} held-out "
          f"dialogues ({100 * own:.1f} % with their own oracle, {100 * other:.1f} % with another's); "
          f"see {run / 'eval.json'}")


def _shutdown() -> None:
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _leave_without_finalizing() -> None:
    """A torchrun worker's exit once its work is on disk and the process group is gone: no interpreter
    finalization. A worker was still seen to abort after all of the above (CI, 2026-12-08: the LoRA FSDP run's
    rank 1, `SIGABRT`, its fault handler showing the main thread with no Python frame left, that is, in
    finalization, and the abort on a thread of torch's own): a C++ thread of torch's distributed runtime still
    joinable while the interpreter tears down (PyTorch's abandoned #179291 describes the same window for gloo).
    Nothing of ours runs past this point, so the worker flushes what it printed and leaves with `os._exit`."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _cmd_export(args: argparse.Namespace) -> int:
    from kame.training.export import export

    out = export(Path(args.run), args.device)
    print(json.dumps({"checkpoint": str(out)}))
    return 0
