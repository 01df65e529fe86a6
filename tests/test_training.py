"""`kame train` from token files (no audio): augmentation, the trainer, eval, export, LoRA, torchrun, resume.

The token files are a copy task written in RUN/tokens's format (kame.training.synthetic): the
assistant says words that only its own dialogue's oracle holds, over random audio codes, so a
front-end that learned to read its oracle scores far better with its own oracle than another's.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from kame.cli import main as kame
from kame.errors import KameError
from kame.frontend.engine import BatchedEngine
from kame.frontend.loader import load_frontend
from kame.frontend.oracle import oracle_stream
from kame.training import augment
from kame.training.augment import OracleEvent
from kame.training.dataset import load_tokens, split
from kame.training.synthetic import shape_of, write_copy_task

ROOT = Path(__file__).resolve().parents[1]
KAME = [sys.executable, "-m", "kame.cli"]


def env() -> dict:
    # the fault handler names the Python stack of a worker that aborts (a torchrun rank once died at exit with
    # only "terminate called without an active exception" to show: docs/benchmarks.md, "on a busy machine")
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"}


# ------------------------------------------------------------------ augmentation

EVENTS = [OracleEvent(5, (11, 12), False), OracleEvent(9, (13, 14, 15), True), OracleEvent(30, (16,), False),
          OracleEvent(40, (17, 18), True)]


def test_shift_moves_every_event_and_clamps_at_zero():
    assert [e.frame for e in augment.shift_events(EVENTS, 3)] == [8, 12, 33, 43]
    assert [e.frame for e in augment.shift_events(EVENTS, -7)] == [0, 2, 23, 33]


def test_random_shift_covers_both_ranges_and_never_zero():
    rng = random.Random(0)
    shifts = {augment.random_shift(rng) for _ in range(2000)}
    assert shifts == {*range(-15, 0), *range(1, 11)}


def test_drop_never_drops_the_last_event_of_a_turn():
    rng = random.Random(1)
    for _ in range(200):
        kept = augment.drop_events(EVENTS, 0.99, rng)
        assert [e for e in EVENTS if e.last_of_turn] == [e for e in kept if e.last_of_turn]
    many = [OracleEvent(i, (5,), False) for i in range(200)]
    kept = [len(augment.augment_events(many, random.Random(seed))) / len(many) for seed in range(50)]
    assert 0.2 < min(kept) < 0.45 and 0.75 < max(kept) < 0.97  # a drop probability from U(0.1, 0.7) per example


def test_augmented_stream_is_seeded_and_built_by_oracle_stream():
    a = augment.augmented_stream(EVENTS, 60, 1000, 3, random.Random(7))
    b = augment.augmented_stream(EVENTS, 60, 1000, 3, random.Random(7))
    assert a == b
    events = augment.augment_events(EVENTS, random.Random(7))
    assert a == oracle_stream([(e.frame, e.tokens) for e in events], 60, 1000, 3)
    assert a != augment.augmented_stream(EVENTS, 60, 1000, 3, random.Random(8))


# ------------------------------------------------------------------ token files and split


@pytest.fixture(scope="module")
def tiny():
    return load_frontend("tiny", "cpu")


def copy_task(run: Path, tiny, dialogues: int) -> Path:
    write_copy_task(run, "tiny", tiny.tokenizer, shape_of(tiny.lm), dialogues=dialogues, turns=3)
    return run


@pytest.fixture(scope="module")
def small_tokens(tmp_path_factory, tiny) -> Path:
    return copy_task(tmp_path_factory.mktemp("small"), tiny, 40)


def fresh_run(tmp_path: Path, small_tokens: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(small_tokens / "tokens", run / "tokens")
    return run


def test_token_files_follow_the_spec(small_tokens, tiny):
    manifest = json.loads((small_tokens / "tokens" / "manifest.json").read_text())
    assert manifest["frontend"] == "tiny" and len(manifest["dialogues"]) == 40
    assert manifest["frontend_config"] == {"text_card": 1000, "padding_id": 3, "n_q": 8, "dep_q": 4, "card": 64}
    with safe_open(str(small_tokens / "tokens" / f"{manifest['dialogues'][0]}.safetensors"), "pt") as f:
        meta = json.loads(f.metadata()["kame"])
        user, assistant, text = (f.get_tensor(k) for k in ("user_codes", "assistant_codes", "text"))
    assert user.dtype == assistant.dtype == torch.int16 and text.dtype == torch.int32
    assert user.shape == (4, meta["frames"]) and assistant.shape == (4, meta["frames"])
    assert set(meta) == {"name", "frames", "oracle_events", "frontend"}
    frame, tokens, last = meta["oracle_events"][0]
    assert isinstance(frame, int) and tokens and tiny.lm.text_initial_token_id not in tokens and last in (True, False)
    assert set(text[text != 3].tolist()) <= {t for _, toks, _ in meta["oracle_events"] for t in toks}


def test_split_is_deterministic_and_holds_out_about_a_tenth(small_tokens):
    dialogues = load_tokens(small_tokens).dialogues
    train, held = split(dialogues)
    assert len(held) == 4 and len(train) == 36
    assert {d.name for d in split(list(reversed(dialogues)))[1]} == {d.name for d in held}  # by name, not order
    assert len(split(dialogues[:2])[1]) == 1
    with pytest.raises(KameError, match="at least 2 dialogues"):
        split(dialogues[:1])


def test_clear_errors(tmp_path, small_tokens, capsys):
    assert kame(["train", "--from-tokens", "--frontend", "tiny", "--out", str(tmp_path / "empty")]) == 2
    assert "no token files" in capsys.readouterr().err
    run = fresh_run(tmp_path, small_tokens)
    assert kame(["train", "--from-tokens", "--frontend", "tiny-copy", "--out", str(run), "--device", "cpu"]) == 2
    assert "was made with front-end 'tiny'" in capsys.readouterr().err
    assert kame(["train", "--frontend", "tiny", "--out", str(run)]) == 2
    assert "needs --data" in capsys.readouterr().err
    assert kame(["export", "--run", str(run)]) == 2
    assert "has not been trained" in capsys.readouterr().err


# ------------------------------------------------------------------ a trained run


TRAIN_STEPS = 1200


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny) -> Path:
    """`kame train --from-tokens` on 2000 copy-task dialogues (the copy cannot be learnt by heart)."""
    run = copy_task(tmp_path_factory.mktemp("trained"), tiny, 2000)
    assert kame(["train", "--from-tokens", "--frontend", "tiny", "--out", str(run), "--steps", str(TRAIN_STEPS),
                 "--device", "cpu"]) == 0
    return run


@pytest.mark.slow
def test_loss_falls_and_is_logged(trained):
    rows = [json.loads(line) for line in (trained / "train" / "log.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == TRAIN_STEPS
    assert set(rows[0]) == {"step", "loss", "text_loss", "audio_loss", "lr", "tokens_per_s"}
    assert rows[-1]["text_loss"] < 0.5 * rows[0]["text_loss"] and rows[-1]["loss"] < rows[0]["loss"]
    assert (trained / "train" / "loss.png").stat().st_size > 1000


@pytest.mark.slow
def test_eval_shows_the_oracle_gain(trained):
    result = json.loads((trained / "eval.json").read_text())
    assert result["dialogues"] == 200 and result["step"] == TRAIN_STEPS
    accuracy = result["text_accuracy"]
    # rounded: the accuracies are shares of held-out tokens, and a gain of exactly 10 points can come out 0.0999...
    assert round(accuracy["own_oracle"] - accuracy["other_oracle"], 9) >= 0.10, accuracy
    assert result["text_loss"]["own_oracle"] < result["text_loss"]["other_oracle"]


@pytest.mark.slow
def test_checkpoint_loads_and_steps_in_the_engine(trained, tiny):
    frontend = load_frontend(str(trained / "checkpoint"), "cpu")
    assert not torch.equal(frontend.oracle_emb.weight, tiny.oracle_emb.weight)  # trained, not text_emb's copy
    assert json.loads((trained / "checkpoint" / "training.json").read_text())["step"] == TRAIN_STEPS
    engine = BatchedEngine(frontend, batch_size=1)
    try:
        slot = engine.acquire()
        outputs = [engine.step({slot: np.zeros(1920, dtype=np.float32)})[0] for _ in range(4)]
    finally:
        engine.close()
    assert [o.frame for o in outputs] == [0, 1, 2, 3] and outputs[-1].pcm.shape == (1920,)


@pytest.mark.slow
def test_kame_infer_runs_on_the_checkpoint(trained, tmp_path):
    import soundfile

    wav = tmp_path / "in.wav"
    soundfile.write(wav, (np.random.default_rng(0).standard_normal(24000) * 0.05).astype(np.float32), 24000)
    done = subprocess.run([*KAME, "infer", "--frontend", str(trained / "checkpoint"), "--device", "cpu",
                           "--input", str(wav), "--output", str(tmp_path / "out.wav"), "--oracle", "capital city",
                           "--json"], capture_output=True, text=True, env=env(), timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["oracle"][0]["text"] == "capital city" and (tmp_path / "out.wav").stat().st_size > 40000


# ------------------------------------------------------------------ resume, LoRA, torchrun


def checkpoint_keys(run: Path) -> set[str]:
    with safe_open(str(run / "checkpoint" / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_resume_continues_from_the_last_checkpoint(tmp_path, small_tokens, capsys):
    run = fresh_run(tmp_path, small_tokens)
    args = ["train", "--from-tokens", "--frontend", "tiny", "--out", str(run), "--device", "cpu", "--batch", "2"]
    assert kame([*args, "--steps", "6"]) == 0
    assert (run / "train" / "step-000006.pt").is_file()
    assert kame([*args, "--steps", "12"]) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert kame([*args, "--steps", "12", "--resume", "--checkpoint-every", "3"]) == 0
    steps = [json.loads(line)["step"] for line in (run / "train" / "log.jsonl").read_text().splitlines()]
    assert steps == [6, 10, 12]  # the resumed run went on from step 6, not from 0
    assert sorted(p.name for p in (run / "train").glob("step-*.pt")) == ["step-000009.pt", "step-000012.pt"]
    assert json.loads((run / "eval.json").read_text())["step"] == 12
    before = (run / "train" / "step-000012.pt").stat().st_mtime_ns
    assert kame([*args, "--steps", "12"]) == 0  # the same command on the finished run: cached, nothing trains
    assert (run / "train" / "step-000012.pt").stat().st_mtime_ns == before


def test_lora_run_exports_merged_plain_weights(tmp_path, small_tokens, tiny):
    run = fresh_run(tmp_path, small_tokens)
    assert kame(["train", "--from-tokens", "--frontend", "tiny", "--out", str(run), "--device", "cpu",
                 "--steps", "8", "--batch", "2", "--lora-rank", "4"]) == 0
    keys = checkpoint_keys(run)
    assert not any("lora" in k or "base_layer" in k for k in keys)
    assert keys == set(tiny.lm.state_dict()) | {"oracle_emb.weight"}
    frontend = load_frontend(str(run / "checkpoint"), "cpu")
    merged = frontend.lm.state_dict()["transformer.layers.0.gating.linear_in.weight"]
    assert not torch.equal(merged, tiny.lm.state_dict()["transformer.layers.0.gating.linear_in.weight"])
    saved = torch.load(sorted((run / "train").glob("step-*.pt"))[-1], weights_only=False)["weights"]
    assert any("lora_A" in k for k in saved)
    assert all("lora_" in k or k.endswith("oracle_emb.weight") for k in saved)  # adapters + oracle only


def failure(output: str) -> str:
    """A failed run's output for the assertion: where Python's fault handler dumped the stacks (a rank that
    aborted: "Fatal Python error: Aborted", the threads' stacks), then the end."""
    start = output.find("Fatal Python error")
    dump = output[start:start + 8000] + "\n...\n" if start >= 0 else ""
    return dump + output[-3000:]


def torchrun(run: Path, *flags: str) -> subprocess.CompletedProcess:
    """`kame train --from-tokens` on `run` in two gloo processes under torchrun."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "kame.cli", "train", "--from-tokens", "--frontend", "tiny", "--out", str(run), "--device", "cpu",
               "--batch", "2", *flags]
    # its own process group, so that a timeout ends the workers too, not only the launcher
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**env(), "OMP_NUM_THREADS": "1"}, start_new_session=True) as launcher:
        try:
            output, _ = launcher.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(command, launcher.returncode, output, "")


def test_torchrun_two_processes_give_the_same_checkpoint_format(tmp_path, small_tokens, tiny):
    run = fresh_run(tmp_path, small_tokens)
    done = torchrun(run, "--steps", "4")
    assert done.returncode == 0, failure(done.stdout)
    assert checkpoint_keys(run) == set(tiny.lm.state_dict()) | {"oracle_emb.weight"}
    assert [json.loads(line)["step"] for line in (run / "train" / "log.jsonl").read_text().splitlines()] == [4]
    load_frontend(str(run / "checkpoint"), "cpu")


@pytest.mark.slow
def test_fsdp_trains_what_ddp_trains_and_resumes_sharded(tmp_path, small_tokens, tiny, capsys):
    """Two gloo processes, same seeds, so the same windows: FSDP's sharded weights, gradients and
    optimizer state must reach DDP's weights (up to float summation order)."""
    ddp, fsdp = fresh_run(tmp_path / "ddp", small_tokens), fresh_run(tmp_path / "fsdp", small_tokens)
    for run, flags in ((ddp, ()), (fsdp, ("--fsdp",))):
        done = torchrun(run, "--steps", "4", "--checkpoint-every", "2", *flags)
        assert done.returncode == 0, failure(done.stdout)
    # the feed-forward blocks of 2 main layers and of the depformer's 4 steps, then the root
    assert "FSDP: 7 groups sharded over 2 processes" in done.stdout
    a = torch.load(ddp / "train" / "step-000004.pt", weights_only=False)
    b = torch.load(fsdp / "train" / "step-000004.pt", weights_only=False)
    assert b["optimizer_format"] == "fsdp-full" and a["optimizer_format"] == "plain"
    base = {f"lm.{k}": v for k, v in tiny.lm.named_parameters()}
    assert set(a["weights"]) == set(b["weights"]) == set(base) | {"oracle_emb.weight"}
    moved = max(float((a["weights"][k] - base[k]).abs().max()) for k in base)
    gap = max(float((a["weights"][k] - b["weights"][k]).abs().max()) for k in a["weights"])
    assert moved > 1e-3 and gap < 0.05 * moved, (moved, gap)  # measured: moved 9.3e-3, gap 2.1e-5
    load_frontend(str(fsdp / "checkpoint"), "cpu")
    # resumed sharded from step 2: the optimizer state goes back into the shards, and it ends where
    # the uninterrupted run did
    (fsdp / "train" / "step-000004.pt").unlink()
    done = torchrun(fsdp, "--steps", "4", "--checkpoint-every", "2", "--fsdp", "--resume")
    assert done.returncode == 0, failure(done.stdout)
    c = torch.load(fsdp / "train" / "step-000004.pt", weights_only=False)
    assert max(float((b["weights"][k] - c["weights"][k]).abs().max()) for k in b["weights"]) < 1e-5
    # an unsharded process cannot take over a sharded run's optimizer state
    assert kame(["train", "--from-tokens", "--frontend", "tiny", "--out", str(fsdp), "--device", "cpu", "--batch",
                 "2", "--steps", "6", "--fsdp", "--resume"]) == 2
    assert "saved by a sharded run" in capsys.readouterr().err
    config = json.loads((fsdp / "train" / "config.json").read_text())
    assert config["steps"] == 4 and config["fsdp"] is True  # a refused resume changes nothing
    # LoRA under FSDP: frozen base and adapters in the same groups; only adapters + oracle saved
    lora = fresh_run(tmp_path / "lora", small_tokens)
    done = torchrun(lora, "--steps", "2", "--fsdp", "--lora-rank", "2")
    assert done.returncode == 0, failure(done.stdout)
    saved = torch.load(next((lora / "train").glob("step-*.pt")), weights_only=False)["weights"]
    assert any("lora_A" in k for k in saved) and all("lora_" in k or k.endswith("oracle_emb.weight") for k in saved)
    load_frontend(str(lora / "checkpoint"), "cpu")


def test_a_directory_base_passes_on_its_own_mimi_and_tokenizer(tmp_path, tiny_copy):
    from kame.frontend.presets import TINY_COPY_DIR

    run = tmp_path / "run"
    write_copy_task(run, "tiny-copy", tiny_copy.tokenizer, shape_of(tiny_copy.lm), dialogues=10)
    assert kame(["train", "--from-tokens", "--frontend", "tiny-copy", "--out", str(run), "--device", "cpu",
                 "--steps", "2", "--batch", "2"]) == 0
    out = run / "checkpoint"
    for name in ("mimi.safetensors", "tokenizer.model", "mimi_config.json"):
        assert (out / name).read_bytes() == (TINY_COPY_DIR / name).read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["lm_gen_config"] == json.loads((TINY_COPY_DIR / "config.json").read_text())["lm_gen_config"]
    frontend = load_frontend(str(out), "cpu")
    assert not torch.equal(frontend.oracle_emb.weight, tiny_copy.oracle_emb.weight)  # trained from its own oracle_emb
