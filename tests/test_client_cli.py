"""`kame client` against the running tandem server; `kame talk` without an audio device."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import sphn

from kame.audio import write_wav
from kame.cli import main

from .conftest import QUESTIONS, words
from .server_harness import few_dropped


def ask_france(tandem_server, voices, tmp_path, capsys, *flags: str) -> tuple[list[dict], Path]:
    """`kame client --json` with the spoken France question: its JSON lines and the answer's WAV."""
    url, _ = tandem_server
    question = tmp_path / "question.wav"
    write_wav(question, voices["france"])
    out = tmp_path / "answer.wav"
    assert main(["client", "--url", url + "/api/chat", "--input", str(question), "--output", str(out),
                 "--json", *flags]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()], out


@pytest.mark.realtime
def test_client_streams_a_file_and_records_the_answer(tandem_server, voices, tmp_path, capsys):
    lines, out = ask_france(tandem_server, voices, tmp_path, capsys, "--tail", "3")
    summary = lines[-1]
    assert summary["type"] == "summary" and "Paris is the capital of France" in summary["assistant_text"]
    events = [line["event"] for line in lines if line["type"] == "event"]
    finals = [e for e in events if e["type"] == "transcript" and e["final"]]
    assert finals and words(finals[-1]["text"]) == words(QUESTIONS["france"][0])
    assert any(e["type"] == "oracle" for e in events)
    times = [line["t"] for line in lines if "t" in line]
    assert times == sorted(times)
    audio, rate = sphn.read(str(out))
    # a frame out per frame in, but for those a loaded machine dropped (skipped to live) and said so
    stats = [e for e in events if e["type"] == "stats"]
    dropped = stats[-1]["frames_dropped"] if stats else 0
    expected_s = len(voices["france"]) / 24000 + 3
    assert few_dropped(dropped, round(expected_s / 0.08)), dropped
    assert rate == 24000 and abs(audio.shape[1] / 24000 + dropped * 0.08 - expected_s) < 0.25


@pytest.mark.realtime
def test_client_fast_mode_runs_faster_than_real_time(tandem_server, voices, tmp_path, capsys):
    url, _ = tandem_server
    question = tmp_path / "q.wav"
    write_wav(question, voices["spider"])
    started = time.monotonic()
    assert main(["client", "--url", url + "/api/chat", "--input", str(question), "--output",
                 str(tmp_path / "a.wav"), "--fast", "--tail", "4"]) == 0
    elapsed = time.monotonic() - started
    out = capsys.readouterr().out
    assert "user (final)" in out and "assistant:" in out
    assert elapsed < len(voices["spider"]) / 24000 + 4


def test_client_reports_a_missing_input(tmp_path, capsys):
    assert main(["client", "--input", str(tmp_path / "none.wav"), "--output", str(tmp_path / "o.wav")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_talk_without_portaudio_is_a_clear_message(capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "sounddevice", None)  # as on a machine without PortAudio, whatever this one has
    code = main(["talk", "--url", "ws://127.0.0.1:1/api/chat"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("kame: error:") and "PortAudio" in err
    assert "Traceback" not in err


def test_talk_without_a_usable_microphone_is_a_clear_message(capsys, monkeypatch):
    import sys
    import types

    def no_device(**kwargs):
        raise ValueError("No input device matching")

    fake = types.SimpleNamespace(check_input_settings=no_device, check_output_settings=no_device)
    monkeypatch.setitem(sys.modules, "sounddevice", fake)
    code = main(["talk", "--url", "ws://127.0.0.1:1/api/chat"])
    err = capsys.readouterr().err
    assert code == 2 and "no usable microphone/speaker (No input device matching)" in err
    assert "Traceback" not in err


def _heavy_modules_after(code: str) -> str:
    """Run `code` in a fresh interpreter; the heavy modules it imported, comma-separated."""
    import subprocess
    import sys

    probe = (code + "\nimport sys\n"
             "print(','.join(sorted(m for m in ('torch', 'moshi', 'faster_whisper', 'transformers') "
             "if m in sys.modules)))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return result.stdout.strip()


CLIENT = Path(__file__).resolve().parents[1] / "client"


def _client_modules() -> list[str]:
    return sorted(f"client.{p.stem}" for p in CLIENT.glob("*.py") if p.stem != "__init__")


def test_the_wire_clients_need_no_torch():
    """client/ speaks the protocol with the codec and audio helpers only: no torch, moshi or ASR, in
    any of its modules at import (the eval and replay commands load the library's models when they run)."""
    modules = _client_modules()
    assert {"client.client", "client.cli", "client.conversation", "client.talk"} <= set(modules)
    assert _heavy_modules_after("".join(f"import {m}\n" for m in modules)) == ""


def test_the_command_line_starts_without_loading_models():
    """`kame --help` and every subcommand's parser are built without torch (lazy imports)."""
    assert _heavy_modules_after("from kame.cli import build_parser\nbuild_parser()") == ""


def _kame_client(url: str, tmp_path, *flags: str) -> tuple[int, str]:
    """`kame client` as a user runs it, in its own process: (exit code, stderr)."""
    import subprocess
    import sys
    from pathlib import Path

    question = Path(__file__).parent / "fixtures" / "question.wav"
    result = subprocess.run([sys.executable, "-m", "kame.cli", "client", "--url", url, "--input", str(question),
                             "--output", str(tmp_path / "answer.wav"), *flags], capture_output=True, text=True,
                            timeout=120)
    return result.returncode, result.stderr


@pytest.mark.slow
def test_client_errors_are_one_line_with_a_distinct_exit_code(tmp_path):
    """Down, full, unauthorised, bad input: a one-line reason and its own exit code, never a traceback."""
    from websockets.sync.client import connect

    from .server_harness import free_port, running_server

    outcomes = {"down": _kame_client(f"ws://127.0.0.1:{free_port()}/api/chat", tmp_path)}
    with running_server(asr="none", max_sessions=1) as (url, _), connect(url + "/api/chat"):  # the one slot, held
        outcomes["busy"] = _kame_client(url + "/api/chat", tmp_path)
    with running_server(asr="none", auth_tokens=["secret"]) as (url, _):
        outcomes["unauthorised"] = _kame_client(url + "/api/chat?token=wrong", tmp_path)
        outcomes["bad input"] = _kame_client(url + "/api/chat?token=secret&audio=mp3", tmp_path)
    with running_server(asr="whisper") as (url, _):  # the bundled tiny.en: English only
        outcomes["language"] = _kame_client(url + "/api/chat", tmp_path, "--language", "ja")
        outcomes["persona"] = _kame_client(url + "/api/chat", tmp_path, "--text-prompt", "You are a pirate.")
    expected = {"down": (3, "cannot reach the server"), "busy": (4, "HTTP 503"),
                "unauthorised": (5, "HTTP 401"), "bad input": (2, "audio must be 'opus' or 'pcm'"),
                "language": (2, "hears English only, not Japanese"), "persona": (2, "takes no persona")}
    for case, (code, text) in expected.items():
        got_code, err = outcomes[case]
        lines = [line for line in err.splitlines() if line.startswith("kame: error:")]
        assert got_code == code and len(lines) == 1 and text in lines[0], (case, got_code, err[-600:])
        assert "Traceback" not in err, (case, err[-600:])


def test_client_realtime_api_goes_through_the_openai_sdk(tandem_server, voices, tmp_path, capsys):
    lines, out = ask_france(tandem_server, voices, tmp_path, capsys, "--tail", "4", "--realtime-api")
    summary = lines[-1]
    assert summary["url"].endswith("/v1/realtime") and summary["errors"] == 0
    assert words(summary["user_text"])[:6] == words("What is the capital of France")
    assert " ".join(words("Paris is the capital of France")) in " ".join(words(summary["assistant_text"]))
    audio, rate = sphn.read(str(out))
    assert rate == 24000 and audio.shape[1] >= 24000 * 0.5  # the response's audio, not the quiet between
