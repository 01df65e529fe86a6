"""`kame infer`: the oracle's words come out of tiny-copy's text stream; errors are one clear line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sphn

from kame.cli import main
from kame.frontend.presets import TINY_COPY_DIR


@pytest.fixture(scope="module")
def question_wav(tmp_path_factory) -> Path:
    """Three seconds of quiet noise at 16 kHz (the CLI resamples to 24 kHz)."""
    path = tmp_path_factory.mktemp("audio") / "question.wav"
    rng = np.random.default_rng(7)
    sphn.write_wav(str(path), (rng.standard_normal(48000) * 0.05).astype(np.float32), 16000)
    return path


def test_oracle_sentence_comes_out_of_tiny_copy(question_wav, tmp_path, capsys):
    out = tmp_path / "answer.wav"
    code = main(["infer", "--frontend", "tiny-copy", "--input", str(question_wav), "--output", str(out),
                 "--oracle", "the capital of France is Paris", "--oracle-at", "0.5"])
    assert code == 0
    assert "the capital of France is Paris" in capsys.readouterr().out
    audio, sample_rate = sphn.read(str(out))
    assert sample_rate == 24000 and audio.shape[1] == 1920 * 50  # 3 s + 1 s tail, one frame out per frame in


def test_json_gives_per_frame_times_and_schedule(question_wav, tmp_path, capsys):
    code = main(["infer", "--frontend", "tiny-copy", "--input", str(question_wav), "--output",
                 str(tmp_path / "a.wav"), "--oracle", "hello there", "--oracle-at", "0.4",
                 "--oracle", "good morning", "--oracle-at", "2.0", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert [o["text"] for o in result["oracle"]] == ["hello there", "good morning"]
    assert [o["frame"] for o in result["oracle"]] == [5, 25]
    pieces = result["pieces"]
    assert "hello there" in result["text"] and "good morning" in result["text"]
    assert all(p["time_s"] == pytest.approx(p["frame"] * 0.08) for p in pieces)
    # each oracle is spoken after its own reset, not before
    assert "".join(p["text"] for p in pieces if 5 < p["frame"] <= 25).strip() == "hello there"
    assert "".join(p["text"] for p in pieces if p["frame"] > 25).strip() == "good morning"


def test_local_directory_without_oracle_table(question_wav, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    repo = tmp_path / "moshi-like"
    shutil.copytree(TINY_COPY_DIR, repo)
    state = load_file(repo / "model.safetensors")
    del state["oracle_emb.weight"]
    save_file(state, repo / "model.safetensors")
    code = main(["infer", "--frontend", str(repo), "--input", str(question_wav), "--output", str(tmp_path / "b.wav")])
    assert code == 0


def test_errors_are_one_clear_line(tmp_path, capsys):
    bad = tmp_path / "bad.wav"
    bad.write_text("not audio")
    assert main(["infer", "--frontend", "tiny-copy", "--input", str(bad), "--output", str(tmp_path / "o.wav")]) == 2
    assert "cannot decode as audio" in capsys.readouterr().err
    assert main(["infer", "--frontend", "tiny-copy", "--input", str(tmp_path / "none.wav"),
                 "--output", str(tmp_path / "o.wav")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["infer", "--frontend", str(tmp_path), "--input", str(bad), "--output", "o.wav"]) == 2
    capsys.readouterr()
    for command in (["infer", "--input", str(bad), "--output", "o.wav"], ["bench", "frontend"]):
        assert main([*command, "--device", "cpu", "--quantize", "int8"]) == 2
        assert "--quantize int8 runs on a CUDA GPU only" in capsys.readouterr().err


def test_console_script_runs(question_wav, tmp_path):
    exe = Path(sys.executable).parent / "kame"
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "kame.cli"]
    proc = subprocess.run(
        [*command, "infer", "--frontend", "tiny-copy", "--input", str(question_wav),
         "--output", str(tmp_path / "c.wav"), "--oracle", "water boils at one hundred degrees"],
        capture_output=True, text=True, timeout=120, env=os.environ | {"HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "water boils at one hundred degrees" in proc.stdout
    assert "front-end tiny-copy ready" in proc.stderr


def test_bench_frontend_reports_each_batch(capsys, tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "frontend", "--frontend", "tiny", "--device", "cpu", "--batch-sizes", "1,2",
                 "--frames", "3", "--warmup", "1", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["batch"] for r in result["rows"]] == [1, 2]
    assert all(r["lm_ms"] > 0 and r["frame_ms"] >= r["lm_ms"] for r in result["rows"])
    assert "| batch |" in capsys.readouterr().out


@pytest.mark.realtime
@pytest.mark.slow
def test_infer_with_an_llm_runs_the_whole_tandem_in_process(scripted_llm, tmp_path, capsys):
    """A recorded question through a real TandemSession: Whisper, the planner, the LLM, no server."""
    question = Path(__file__).parent / "fixtures" / "question.wav"
    code = main(["infer", "--frontend", "tiny-copy", "--device", "cpu", "--input", str(question), "--output",
                 str(tmp_path / "a.wav"), "--llm-base-url", scripted_llm.base_url, "--llm-model", "m",
                 "--asr", "whisper", "--tail", "3"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "final   What is the capital of France?" in out
    assert "oracle  reset" in out
    assert out.strip().splitlines()[-1].startswith("assistant:") and "Paris" in out.splitlines()[-1]
    audio, rate = sphn.read(str(tmp_path / "a.wav"))
    assert rate == 24000 and audio.shape[1] >= 24000 * 4  # the question and the tail came back as audio


def test_infer_refuses_a_scripted_oracle_with_an_llm(question_wav, tmp_path, capsys):
    code = main(["infer", "--frontend", "tiny-copy", "--input", str(question_wav), "--output", str(tmp_path / "a.wav"),
                 "--llm", "local", "--oracle", "hello"])
    assert code == 2 and "one or the other" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the no-GPU default")
def test_infer_without_a_frontend_picks_what_kame_serve_picks(question_wav, tmp_path, capsys, caplog):
    caplog.set_level("INFO", logger="kame.runtime")
    code = main(["infer", "--input", str(question_wav), "--output", str(tmp_path / "a.wav"), "--oracle", "hello there"])
    assert code == 0 and "hello there" in capsys.readouterr().out  # tiny-copy repeats its oracle
    assert any("tiny-copy (no --frontend given: no GPU" in r.getMessage() for r in caplog.records)


@pytest.fixture(scope="module")
def personaplex(tmp_path_factory) -> Path:
    """The PersonaPlex-layout fixture as a repo (with a Mimi and a tokenizer: test_personaplex.checkpoint)."""
    from .test_personaplex import REFERENCE, checkpoint

    return checkpoint(tmp_path_factory.mktemp("pp") / "repo", REFERENCE["lm_kwargs"])


def test_personaplex_flags_as_offline_py_names_them(personaplex, question_wav, tmp_path, capsys):
    """NVIDIA's offline.py flags on the PersonaPlex-layout fixture: --text-prompt prefills the role text before
    the input (it changes what the model says; the prompt's frames are not in the output, whose frames count
    from the input's first); --greedy repeats exactly; --seed makes a sampled run repeat, and another seed gives
    another run; --voice-prompt names a voice in --voice-prompt-dir (an unknown one is refused). (The text
    tokens are compared: the fixture's Mimi is random, its audio says little.)"""
    def run(name, *flags):
        out = tmp_path / f"{name}.wav"
        assert main(["infer", "--frontend", str(personaplex), "--device", "cpu", "--input", str(question_wav),
                     "--output", str(out), "--tail", "0.5", "--json", *flags]) == 0
        result = json.loads(capsys.readouterr().out)
        audio, _ = sphn.read(str(out))
        assert audio.shape == (1, 1920 * 44)  # 3 s + 0.5 s, one frame out per frame in, none for the prompt
        assert all(0 <= p["frame"] < 44 and p["time_s"] == pytest.approx(p["frame"] * 0.08) for p in result["pieces"])
        return [(p["frame"], p["token"]) for p in result["pieces"]]

    plain = run("plain", "--greedy")
    persona = run("persona", "--greedy", "--text-prompt", "You are a patient teacher.")
    assert persona == run("again", "--greedy", "--text-prompt", "You are a patient teacher.") and persona != plain
    seeded = [run(f"seed{seed}", "--seed", str(seed)) for seed in (1, 1, 2)]
    assert seeded[0] == seeded[1] and seeded[0] != seeded[2]
    voices = tmp_path / "voices"  # offline.py's --voice-prompt-dir, with the reference-made voice in it
    voices.mkdir()
    shutil.copy(Path(__file__).parent / "fixtures" / "personaplex-tiny" / "voice.pt", voices / "TINY0.pt")
    voiced = run("voiced", "--greedy", "--text-prompt", "You are a patient teacher.", "--voice-prompt", "TINY0.pt",
                 "--voice-prompt-dir", str(voices))
    assert voiced != persona  # the voice is part of the prompt
    code = main(["infer", "--frontend", str(personaplex), "--device", "cpu", "--input", str(question_wav),
                 "--output", str(tmp_path / "v.wav"), "--voice-prompt", "NATF2.pt", "--voice-prompt-dir", str(voices)])
    assert code == 2 and "'NATF2.pt': no such voice; there are: TINY0.pt" in capsys.readouterr().err


def test_a_role_text_on_a_front_end_without_persona_is_one_clear_line(question_wav, tmp_path, capsys):
    code = main(["infer", "--frontend", "tiny-copy", "--input", str(question_wav), "--output",
                 str(tmp_path / "a.wav"), "--text-prompt", "You are a pirate."])
    assert code == 2 and "takes no persona" in capsys.readouterr().err
