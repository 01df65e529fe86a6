"""Fine-tune a front-end on RUN/tokens: random chunks, augmented oracle, text + audio loss.

One process, or one per GPU under `torchrun` (DDP; gloo on a CPU, nccl on CUDA): every rank
draws its own chunks, rank 0 alone logs and writes. Writes RUN/train/{config.json, log.jsonl,
loss.png, step-N.pt}; `resume=True` continues from the newest step-N.pt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from moshi.utils.compile import no_compile
from torch import nn

from kame.errors import KameError
from kame.frontend.loader import Frontend, load_frontend, oracle_from_text_emb, resolve_device
from kame.training import checkpoints
from kame.training.augment import augmented_stream, stream_of
from kame.training.checkpoints import RunConfig
from kame.training.dataset import Chunk, check_frontend, lm_config, load_tokens, sample_chunks, split
from kame.training.model import OracleLM, add_lora, compute_loss, freeze_audio_heads
from kame.training.sharding import OPTIMIZER_FORMAT, full_state, load_state, shard

logger = logging.getLogger(__name__)

SMALL_MODEL_PARAMS = 50_000_000  # below this, the CPU-sized defaults apply
PLAIN_FORMAT = "plain"  # checkpoint["optimizer_format"] of an unsharded run: torch's own optimizer state


@dataclass(frozen=True)
class TrainOptions:
    """What the user asked for; None: the default for the base model's size."""

    frontend: str
    steps: int | None = None
    chunk: int = 512  # frames per training window (whole dialogue if shorter)
    batch: int | None = None  # windows per step and rank
    lr: float | None = None
    lora_rank: int | None = None
    device: str = "auto"
    seed: int = 0
    checkpoint_every: int | None = None  # None: 4 checkpoints per run
    log_every: int = 10
    resume: bool = False
    augment: bool = True  # False: every example sees its dialogue's oracle events as recorded
    audio_weight: float = 1.0  # 0: text loss only (the audio heads are not trained)
    fsdp: bool = False  # under torchrun: shard weights, gradients and optimizer state (kame.training.sharding)


def size_defaults(params: int) -> dict:
    """Hyper-parameters by model size: the tiny CPU models learn in minutes, 7B as Moshi fine-tunes."""
    if params < SMALL_MODEL_PARAMS:
        return {"steps": 3000, "batch": 8, "lr": 3e-3, "weight_decay": 0.0}
    return {"steps": 2000, "batch": 1, "lr": 3e-5, "weight_decay": 0.1}


def run_config(options: TrainOptions, params: int, sharded: bool = False) -> RunConfig:
    """What the run is: the options, the size defaults, and whether it is really sharded (--fsdp
    with more than one process)."""
    d = size_defaults(params)
    steps = options.steps or d["steps"]
    return RunConfig(
        frontend=options.frontend, lora_rank=options.lora_rank, steps=steps, chunk=options.chunk,
        batch=options.batch or d["batch"], lr=options.lr or d["lr"], weight_decay=d["weight_decay"],
        betas=(0.9, 0.95), warmup=max(1, steps // 20), seed=options.seed, augment=options.augment,
        audio_weight=options.audio_weight, fsdp=sharded,
    )


# ---------------------------------------------------------------- processes


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def ranks() -> Ranks:
    """This process's place under torchrun (its env vars), or a single process."""
    return Ranks(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                 int(os.environ.get("LOCAL_RANK", 0)))


def init_distributed(device: torch.device) -> Ranks:
    """Join torchrun's process group (once) when there is more than one process."""
    r = ranks()
    if r.world > 1 and not torch.distributed.is_initialized():
        # the other ranks wait at a barrier while rank 0 runs the data stages (ASR can take hours)
        torch.distributed.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                             timeout=timedelta(hours=12))
    return r


def barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def rank_device(device: str, r: Ranks) -> torch.device:
    dev = resolve_device(device)
    if dev.type == "cuda" and r.world > 1:
        dev = torch.device("cuda", r.local)
        torch.cuda.set_device(dev)
    return dev


# ---------------------------------------------------------------- model


def build_model(frontend: Frontend, lora_rank: int | None, train_audio: bool = True) -> nn.Module:
    """The trainable module: the base's LM + oracle embedding, LoRA-wrapped when asked; without
    `train_audio` the depformer and audio heads are frozen (a text-only run leaves them as they are)."""
    if frontend.oracle_emb is None:  # a base that takes no oracle (PersonaPlex's): KAME's starts as text_emb
        frontend.oracle_emb = oracle_from_text_emb(frontend.lm)
    frontend.oracle_emb.float()
    model: nn.Module = OracleLM(frontend.lm, frontend.oracle_emb)
    model.train().requires_grad_(True)
    if lora_rank:
        model = add_lora(model, lora_rank)
    if not train_audio:
        freeze_audio_heads(model)
    if frontend.device.type == "cuda":  # activations are recomputed in the backward pass
        frontend.lm.transformer.checkpointing = True
    return model


def load_base(source: str, device: torch.device, lora: bool) -> Frontend:
    """The base front-end: float32 weights, except a LoRA base on CUDA (frozen: bf16 is enough)."""
    dtype = torch.bfloat16 if lora and device.type == "cuda" else torch.float32
    return load_frontend(source, device, dtype=dtype)


def count_params(frontend: Frontend) -> int:
    return sum(p.numel() for p in frontend.lm.parameters())


def optimizer(model: nn.Module, config: RunConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms, biases and other small tensors."""
    decay, keep = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and "norm" not in name else keep).append(p)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": keep, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas)


def lr_factor(step: int, config: RunConfig) -> float:
    """Linear warm-up, then a cosine down to a tenth of the peak."""
    if step < config.warmup:
        return (step + 1) / config.warmup
    progress = min(1.0, (step - config.warmup) / max(1, config.steps - config.warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


# ---------------------------------------------------------------- batches


def make_batch(chunks: list[Chunk], rng: random.Random, start_token: int, padding_token: int,
               device: torch.device, augment: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [B, 1 + n_q, L], oracle [B, L]) of the chunks, each with its oracle built over its
    whole dialogue (an oracle applied before the window still shows in it), freshly augmented
    unless `augment` is False."""
    codes, oracle = [], []
    for c in chunks:
        frames = c.start + c.length
        stream = (augmented_stream(c.dialogue.events, frames, start_token, padding_token, rng) if augment
                  else stream_of(c.dialogue.events, frames, start_token, padding_token))
        codes.append(c.dialogue.codes(c.start, c.length))
        oracle.append(torch.tensor(stream[c.start:], dtype=torch.long))
    return torch.stack(codes).to(device), torch.stack(oracle).to(device)


@contextlib.contextmanager
def autocast(device: torch.device) -> Iterator[None]:
    """bf16 autocast on CUDA (float32 on a CPU), and none of moshi's torch.compile: its first
    compilation costs more than a tiny model's whole training, and windows vary in length."""
    with no_compile(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        yield


# ---------------------------------------------------------------- the loop


def train(run_dir: Path, options: TrainOptions) -> Path:
    """Train (or resume) and return the newest checkpoint's path."""
    run_dir = Path(run_dir)
    r = ranks()
    device = rank_device(options.device, r)
    init_distributed(device)
    tokens = load_tokens(run_dir)
    frontend = load_base(options.frontend, device, bool(options.lora_rank))
    lm = frontend.lm
    check_frontend(tokens, lm_config(lm), options.frontend)
    train_set, _ = split(tokens.dialogues)
    sharded = options.fsdp and r.world > 1
    if options.fsdp and not sharded:
        logger.warning("--fsdp with a single process: nothing to shard, training unsharded (start it with torchrun)")
    config = run_config(options, count_params(frontend), sharded)
    model = build_model(frontend, config.lora_rank, train_audio=config.audio_weight > 0)
    if sharded:
        groups = shard(model, device)
        if r.main:
            logger.info("FSDP: %d groups sharded over %d processes", groups, r.world)
    opt = optimizer(model, config)  # after sharding: it must hold the sharded parameters
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, config))
    rng = random.Random(config.seed * 1000 + r.rank)
    step = _start(run_dir, options, config, model, opt, sched, rng, r)
    if step >= config.steps:
        logger.info("training already reached step %d of %d", step, config.steps)
        return _final_checkpoint(run_dir)
    wrapped = model if sharded else _ddp(model, device, r)
    log = _Log(run_dir, r.main, tokens_per_frame=1 + lm.n_q)
    every = options.checkpoint_every or max(1, config.steps // 4)
    bar = _progress(config.steps, step, r.main)
    while step < config.steps:
        chunks = sample_chunks(train_set, config.batch, config.chunk, rng)
        codes, oracle = make_batch(chunks, rng, lm.text_initial_token_id, lm.text_padding_token_id, device,
                                   config.augment)
        with autocast(device):
            loss = compute_loss(wrapped(codes, oracle), codes, lm.text_padding_token_id, config.audio_weight)
        opt.zero_grad(set_to_none=True)
        with no_compile():  # activation checkpointing recomputes the forward here: compiled, it saves other tensors
            loss.total.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        sched.step()
        step += 1
        log.add(step, loss, sched.get_last_lr()[0], codes.numel() // codes.shape[1])
        if step % options.log_every == 0 or step == config.steps:
            bar.set_postfix(log.flush())
        bar.update(1)
        if step % every == 0 or step == config.steps:
            _save(run_dir, step, model, opt, sched, rng, r, sharded)
    bar.close()
    log.plot()
    return _final_checkpoint(run_dir)


def _start(run_dir: Path, options: TrainOptions, config: RunConfig, model: nn.Module, opt, sched,
           rng: random.Random, r: Ranks) -> int:
    """The step to start from: 0 for a new run, the newest checkpoint's with `resume` (or when the
    same run is asked for again after it finished)."""
    found = checkpoints.latest(run_dir)
    if found is None:
        if r.main:
            checkpoints.write_config(run_dir, config)
        barrier()
        return 0
    if not options.resume and found[0] >= config.steps and checkpoints.read_config(run_dir) == config:
        return found[0]  # the same command again on a finished run: nothing to train
    if not options.resume:
        raise KameError(f"{checkpoints.train_dir(run_dir)} already holds a checkpoint (step {found[0]}): pass "
                        "--resume to continue it, or train into another --out")
    previous = checkpoints.read_config(run_dir)
    changed = resume_conflicts(previous, config)
    if changed:
        raise KameError("cannot resume: the run was trained with " + ", ".join(
            f"{key} {was!r} (now {now!r})" for key, was, now in changed)
            + "; give the same options (or its --recipe) again, or train into another --out")
    step, path = found
    state = checkpoints.load(path)
    saved_format = state.get("optimizer_format", PLAIN_FORMAT)
    if saved_format != (OPTIMIZER_FORMAT if config.fsdp else PLAIN_FORMAT):
        was = "a sharded" if saved_format != PLAIN_FORMAT else "an unsharded"
        raise KameError(f"cannot resume {path}: it was saved by {was} run; resume it the same way (--fsdp under "
                        "torchrun with more than one process, or neither)")
    if config.fsdp:
        load_state(model, opt, state["weights"], state["optimizer"])
    else:
        checkpoints.restore_weights(model, state["weights"], path)
        opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    rng.setstate(state["rng"][r.rank % len(state["rng"])])
    barrier()  # every rank has read the old config and restored its state
    if r.main and previous.steps != config.steps:
        checkpoints.write_config(run_dir, config)  # a resumed run may be asked for more steps
    logger.info("resuming from %s (step %d)", path, step)
    return step


def resume_conflicts(previous: RunConfig, config: RunConfig) -> list[tuple[str, object, object]]:
    """(option, then, now) for every option a resumed run changes, but the number of steps (a run
    may be asked for more, and its warm-up follows) and sharding (the checkpoint's optimizer
    format decides whether the process count and --fsdp can take it over)."""
    same_length = dataclasses.replace(previous, steps=config.steps, warmup=config.warmup, fsdp=config.fsdp)
    return [(f.name, getattr(previous, f.name), getattr(config, f.name)) for f in dataclasses.fields(config)
            if getattr(same_length, f.name) != getattr(config, f.name)]


def _save(run_dir: Path, step: int, model: nn.Module, opt, sched, rng: random.Random, r: Ranks,
          sharded: bool) -> None:
    if sharded:  # every rank takes part in gathering the shards
        weights, optim = full_state(model, opt)
    else:
        weights, optim = (checkpoints.trainable_state(model), opt.state_dict()) if r.main else ({}, {})
    states = [None] * r.world
    if r.world > 1:
        torch.distributed.all_gather_object(states, rng.getstate())
    else:
        states = [rng.getstate()]
    if r.main:
        checkpoints.save(run_dir, step, weights, {"optimizer": optim, "scheduler": sched.state_dict(), "rng": states,
                                                  "optimizer_format": OPTIMIZER_FORMAT if sharded else PLAIN_FORMAT})
    barrier()


def _final_checkpoint(run_dir: Path) -> Path:
    found = checkpoints.latest(run_dir)
    if found is None:
        raise KameError(f"no checkpoint in {checkpoints.train_dir(run_dir)}")
    return found[1]


def _ddp(model: nn.Module, device: torch.device, r: Ranks) -> nn.Module:
    if r.world == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=False)


def _progress(total: int, initial: int, main: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", disable=not main, unit="step")


class _Log:
    """Averages the loss over each logging window; rank 0 appends it to log.jsonl and plots it."""

    def __init__(self, run_dir: Path, main: bool, tokens_per_frame: int) -> None:
        self.path = checkpoints.train_dir(run_dir) / "log.jsonl"
        self.main, self.tokens_per_frame = main, tokens_per_frame
        self._reset()

    def _reset(self) -> None:
        self.sums, self.count, self.frames, self.t0 = [0.0, 0.0, 0.0], 0, 0, time.perf_counter()

    def add(self, step: int, loss, lr: float, frames: int) -> None:
        for i, value in enumerate((loss.total, loss.text, loss.audio)):
            self.sums[i] += float(value.detach())
        self.count, self.frames, self.step, self.lr = self.count + 1, self.frames + frames, step, lr

    def flush(self) -> dict:
        elapsed = max(1e-9, time.perf_counter() - self.t0)
        total, text, audio = (s / max(1, self.count) for s in self.sums)
        row = {"step": self.step, "loss": total, "text_loss": text, "audio_loss": audio, "lr": self.lr,
               "tokens_per_s": self.frames * self.tokens_per_frame / elapsed}
        if self.main:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        self._reset()
        return {"loss": f"{total:.3f}", "text": f"{text:.3f}"}

    def plot(self) -> None:
        if self.main:
            plot_losses(self.path, self.path.with_name("loss.png"))


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def plot_losses(log_path: Path, out: Path) -> Path | None:
    """loss.png from log.jsonl; without matplotlib, say so once and skip."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no loss plot (pip install matplotlib)")
        return None
    rows = read_log(log_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in ("loss", "text_loss", "audio_loss"):
        ax.plot([row["step"] for row in rows], [row[key] for row in rows], label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
