"""Training recipes (`kame train --recipe`) and the one that makes the shipped `tiny-copy` preset.

The `tiny-copy` recipe is run here (with fewer steps than the shipped preset's 3000, to keep
the suite short) and its checkpoint must do what every end-to-end test relies on the shipped
one for: say, token for token, whatever oracle the engine is given, free-running.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kame.cli import main as kame
from kame.errors import KameError
from kame.frontend.engine import BatchedEngine, GenerationConfig
from kame.frontend.loader import load_frontend
from kame.frontend.oracle import OracleUpdate, oracle_stream, tokenize_words
from kame.frontend.presets import TINY_COPY_DIR
from kame.training import recipe
from kame.training.synthetic import echo_events, sentences, shape_of, write_oracle_echo
from kame.training.train import make_batch

RECIPE_STEPS = 400

# none of these is an MT-Bench sentence (the echo's training text); several words are not in it at all
SPOKEN = ["The capital of France is Paris.", "It is sunny and twenty two degrees in Tokyo today.",
          "Let me check that for you.", "Blue, because of Rayleigh scattering of sunlight.",
          "zebra quantum marmalade", "I can help with that. What time works best for you?"]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ------------------------------------------------------------------ recipe files


def test_the_shipped_recipes_load_and_check_their_keys(tmp_path):
    assert "tiny-copy" in recipe.shipped()
    tiny_copy = recipe.load("tiny-copy")
    assert tiny_copy.options["frontend"] == "tiny" and tiny_copy.options["augment"] is False
    assert tiny_copy.options["audio_weight"] == 0.0 and tiny_copy.synthetic["task"] == "oracle-echo"
    assert recipe.load(str(write(tmp_path / "r.toml", 'frontend = "tiny"\nlr = 1\n'))).options["lr"] == 1.0
    cases = {
        'frontend = "tiny"\nstep = 5\n': "unknown key 'step'",
        'steps = "5"\n': "steps must be a int",
        "steps = true\n": "steps must be a int",
        'augment = "no"\n': "augment must be a bool",
        '[synthetic]\ntask = "poetry"\n': "task must be one of oracle-echo, copy",
        '[synthetic]\ntask = "copy"\ndialogues = 1\n': "dialogues must be at least 2",
        'data = "x"\n[synthetic]\ntask = "copy"\n': "two sources of dialogues",
        '[synthetic]\ntask = "copy"\nframes = 50\n': "task copy has no `frames`",
        "steps = [\n": "cannot read recipe",
        'oracles = "oracle"\n': "oracles must be one of random, llm",
    }
    for text, message in cases.items():
        with pytest.raises(KameError, match=message):
            recipe.load(str(write(tmp_path / "bad.toml", text)))
    with pytest.raises(KameError, match="not a shipped recipe .*tiny-copy"):
        recipe.load("no-such-recipe")
    (tmp_path / "sub").mkdir()
    nested = recipe.load(str(write(tmp_path / "sub" / "r.toml", 'data = "../dialogues"\n')))
    assert nested.options["data"] == str(tmp_path / "dialogues")  # beside the recipe, wherever it is run


def test_the_command_line_wins_over_the_recipe_and_reruns_skip_the_data(tmp_path, capsys):
    run = tmp_path / "run"
    mine = write(tmp_path / "mine.toml", 'frontend = "tiny"\ndevice = "cpu"\nsteps = 50\nbatch = 2\nchunk = 32\n'
                 'augment = false\naudio_weight = 0\n[synthetic]\ntask = "oracle-echo"\ndialogues = 20\nframes = 40\n')
    assert kame(["train", "--recipe", str(mine), "--out", str(run), "--steps", "3"]) == 0
    config = json.loads((run / "train" / "config.json").read_text())
    assert (config["steps"], config["batch"], config["chunk"]) == (3, 2, 32)
    assert config["augment"] is False and config["audio_weight"] == 0.0 and config["seed"] == 0
    assert len(json.loads((run / "tokens" / "manifest.json").read_text())["dialogues"]) == 20
    made = (run / "tokens" / "echo_00000.safetensors").stat().st_mtime_ns
    assert kame(["train", "--recipe", str(mine), "--out", str(run), "--steps", "3"]) == 0  # all done: nothing redone
    assert (run / "tokens" / "echo_00000.safetensors").stat().st_mtime_ns == made
    capsys.readouterr()
    other = write(tmp_path / "other.toml", mine.read_text().replace("dialogues = 20", "dialogues = 30"))
    assert kame(["train", "--recipe", str(other), "--out", str(run), "--steps", "3"]) == 2
    assert "made by another synthetic spec" in capsys.readouterr().err
    assert kame(["train", "--recipe", str(mine), "--out", str(tmp_path / "r2"), "--data", str(tmp_path)]) == 2
    assert "one source of dialogues" in capsys.readouterr().err
    assert kame(["train", "--recipe", str(write(tmp_path / "nofe.toml", "steps = 2\n")), "--out", str(run)]) == 2
    assert "needs --frontend" in capsys.readouterr().err
    for flags, message in ((["--chunk", "0"], "--chunk must be at least 1"), (["--batch", "0"], "--batch must be"),
                           (["--lr", "0"], "--lr must be a positive"), (["--audio-weight", "nan"], "--audio-weight"),
                           (["--audio-weight", "-1"], "--audio-weight must be 0 or more")):
        assert kame(["train", "--recipe", str(mine), "--out", str(tmp_path / "bad"), *flags]) == 2
        assert message in capsys.readouterr().err, flags
    # a resumed run must be trained as it was: a changed option is refused, more steps are not
    assert kame(["train", "--recipe", str(mine), "--out", str(run), "--steps", "5", "--resume", "--augment"]) == 2
    assert "augment False (now True)" in capsys.readouterr().err
    assert kame(["train", "--frontend", "tiny", "--from-tokens", "--out", str(run), "--steps", "5", "--resume",
                 "--device", "cpu", "--batch", "2", "--chunk", "32"]) == 2  # the recipe's options left out
    assert "audio_weight 0.0 (now 1.0)" in capsys.readouterr().err
    assert kame(["train", "--recipe", str(mine), "--out", str(run), "--steps", "5", "--resume"]) == 0
    assert json.loads((run / "train" / "config.json").read_text())["steps"] == 5
    # token files another stage rewrote are not taken for the recipe's
    manifest = run / "tokens" / "manifest.json"
    listed = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(listed | {"dialogues": listed["dialogues"][1:]}))
    assert kame(["train", "--recipe", str(mine), "--out", str(run), "--steps", "5"]) == 2
    assert "no longer holds what the recipe made" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [[], ["--lora-rank", "2"]], ids=["full", "lora"])
def test_audio_weight_zero_leaves_the_audio_heads_as_they_were(tmp_path, extra):
    """Frozen, not merely without gradient: weight decay (the large models' default) would still
    shrink them, and LoRA adapters on them would be trained for nothing."""
    run = tmp_path / "run"
    assert kame(["train", "--recipe", "tiny-copy", "--out", str(run), "--steps", "5", "--batch", "2", "--lr", "0.05",
                 *extra]) == 0
    saved = torch.load(next((run / "train").glob("step-*.pt")), weights_only=False)["weights"]
    assert saved and not [k for k in saved if ".depformer" in k or ".linears." in k]  # never trained
    trained = load_file(str(run / "checkpoint" / "model.safetensors"))
    base = load_frontend("tiny", "cpu").lm.state_dict()
    depformer = [k for k in base if k.startswith(("depformer", "linears"))]
    assert depformer and all(torch.equal(trained[k], base[k]) for k in depformer)
    assert not torch.equal(trained["transformer.layers.0.self_attn.in_projs.0.weight"],
                           base["transformer.layers.0.self_attn.in_projs.0.weight"])
    log = [json.loads(line) for line in (run / "train" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] == log[-1]["text_loss"] and log[-1]["audio_loss"] > 0  # reported, not trained


def test_the_tiny_tokenizer_is_made_again_by_its_script(tmp_path):
    import runpy

    import sentencepiece as spm

    make = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "make_tiny_tokenizer.py"))["make"]
    made = spm.SentencePieceProcessor(model_file=str(make(tmp_path)))
    shipped = spm.SentencePieceProcessor(model_file=str(TINY_COPY_DIR / "tokenizer.model"))
    assert made.vocab_size() == shipped.vocab_size() == 1000
    assert all(made.id_to_piece(i) == shipped.id_to_piece(i) and made.get_score(i) == shipped.get_score(i)
               for i in range(1000))  # the bytes differ only in the training paths SentencePiece records


# ------------------------------------------------------------------ the oracle echo data


def test_echo_token_files_say_their_oracle_stream(tmp_path, tiny):
    shape = shape_of(tiny.lm)
    paths = write_oracle_echo(tmp_path, "tiny", tiny.tokenizer, shape, dialogues=5, frames=120, seed=3)
    pieces = {tuple(tokenize_words(tiny.tokenizer, s)) for s in sentences()}
    for path in paths:
        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["kame"])
            text = f.get_tensor("text").tolist()
            codes = f.get_tensor("user_codes"), f.get_tensor("assistant_codes")
        events = meta["oracle_events"]
        stream = oracle_stream([(frame, tokens) for frame, tokens, _ in events], 120, 1000, 3)
        assert text == [3 if t == 1000 else t for t in stream]
        assert all(any(p[:len(tokens)] == tuple(tokens) for p in pieces) for _, tokens, _ in events)  # prefixes
        assert codes[0].shape == (4, 120) and codes[1].shape == (4, 120) and len(set(codes[0].flatten().tolist())) > 30
    # some updates are cut short by the next one, whose timeline clears the rest of the older one
    many = echo_events(random.Random(0), [list(range(10, 30))], 5000)
    cut = [a for a, b in zip(many, many[1:], strict=False) if b[0] - a[0] <= len(a[1])]
    assert 0.15 < len(cut) / len(many) < 0.45


def test_without_augmentation_a_batch_holds_the_recorded_oracle(tmp_path, tiny):
    from kame.training.dataset import Chunk, load_tokens

    write_oracle_echo(tmp_path, "tiny", tiny.tokenizer, shape_of(tiny.lm), dialogues=3, frames=80, seed=1)
    dialogue = load_tokens(tmp_path).dialogues[0]
    chunk = Chunk(dialogue, 20, 40)
    codes, oracle = make_batch([chunk], random.Random(0), 1000, 3, torch.device("cpu"), augment=False)
    stream = oracle_stream([(e.frame, e.tokens) for e in dialogue.events], 60, 1000, 3)
    assert oracle[0].tolist() == stream[20:] and torch.equal(codes[0], dialogue.codes(20, 40))
    _, jittered = make_batch([chunk], random.Random(0), 1000, 3, torch.device("cpu"), augment=True)
    assert jittered[0].tolist() != stream[20:]


# ------------------------------------------------------------------ the recipe re-makes tiny-copy


# (frame, text) oracle resets of one session each: a text read out to its end, and one cut short
# by a newer, shorter answer (the engine's timeline clears the rest of the older one)
SESSIONS = [[(3, text)] for text in SPOKEN] + [[(3, SPOKEN[1]), (9, "Sorry, it rains.")]]


def echoed(frontend, sessions: list[list[tuple[int, str]]]) -> tuple[list[list[int]], list[list[int]]]:
    """(what the front-end's text stream said, free-running on silence, in each session; the word
    tokens of each session's oracle stream, which a perfect echo says)."""
    engine = BatchedEngine(frontend, batch_size=1, gen=GenerationConfig(use_sampling=False))
    start, padding = frontend.lm.text_initial_token_id, frontend.lm.text_padding_token_id
    said, expected = [], []
    try:
        for resets in sessions:
            events = [(frame, tuple(tokenize_words(frontend.tokenizer, text))) for frame, text in resets]
            frames = events[-1][0] + len(events[-1][1]) + 8
            expected.append([t for t in oracle_stream(events, frames, start, padding) if t not in (start, padding)])
            slot, out = engine.acquire(), []
            for frame in range(frames):
                for epoch, (at, tokens) in enumerate(events):
                    if at == frame:
                        engine.push_oracle(slot, OracleUpdate.reset(epoch, tokens))
                token = engine.step({slot: np.zeros(1920, dtype=np.float32)})[0].text_token
                out += [] if token is None else [token]
            engine.release(slot)
            said.append(out)
    finally:
        engine.close()
    return said, expected


@pytest.fixture(scope="module")
def remade(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("tiny-copy")
    assert kame(["train", "--recipe", "tiny-copy", "--out", str(run), "--steps", str(RECIPE_STEPS)]) == 0
    return run / "checkpoint"


@pytest.mark.slow
def test_the_recipe_remakes_tiny_copy(remade, tiny_copy):
    shipped = json.loads((TINY_COPY_DIR / "config.json").read_text())
    assert json.loads((remade / "config.json").read_text()) == shipped
    assert sorted(p.name for p in remade.iterdir()) == sorted(p.name for p in TINY_COPY_DIR.iterdir()
                                                              if p.name != "TRAINING.md")
    assert (remade / "tokenizer.model").read_bytes() == (TINY_COPY_DIR / "tokenizer.model").read_bytes()
    assert json.loads((TINY_COPY_DIR / "training.json").read_text()) == {
        "base": "tiny", "step": 3000, "lora_rank": None, "lora_merged": False}
    eval_json = json.loads((remade.parent / "eval.json").read_text())
    assert eval_json["text_accuracy"]["own_oracle"] > 0.95 and eval_json["oracle_gain"] > 0.9
    said, expected = echoed(load_frontend(str(remade), "cpu"), SESSIONS)
    assert said == expected
    assert tiny_copy.tokenizer.decode(expected[0]) == SPOKEN[0]
    assert len(expected[-1]) == 5 + len(tokenize_words(tiny_copy.tokenizer, "Sorry, it rains."))
    assert echoed(tiny_copy, SESSIONS)[0] == expected  # the shipped preset, made by the full recipe
