"""`kame eval robustness` for real, in this process: tiny-copy, Whisper tiny.en, a scripted LLM that
answers only what it heard; two questions, clean, with a 1 s pause at the boundary, and with the echo of
the assistant (its text said by flite, as a trained front-end would say it). Then the session's
transcripts through the real Realtime mapping: each premature final is a turn it closed early."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from kame.cli import main
from kame.session_events import Transcript

pytestmark = pytest.mark.slow
CONDITIONS = ["clean", "pause_1s", "echo"]


class Passthrough:
    """An input processor (where an echo canceller goes) that changes nothing and keeps what it saw."""

    made: list[Passthrough] = []

    def __init__(self) -> None:
        self.frames = 0
        self.loudest_played = 0.0
        Passthrough.made.append(self)

    def process_input(self, mic_frame, played_frame):
        assert mic_frame.shape == played_frame.shape == (1920,)
        self.frames += 1
        self.loudest_played = max(self.loudest_played, float(abs(played_frame).max()))
        return mic_frame


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if shutil.which("flite") is None:  # the assistant's voice in the echo condition
        if os.environ.get("KAME_REQUIRE_FLITE") == "1":
            pytest.fail("flite is required here (apt-get install flite)")
        pytest.skip("flite is not installed (apt-get install flite)")
    out = tmp_path_factory.mktemp("robustness")
    args = ["eval", "robustness", "--out", str(out), "--conditions", ",".join(CONDITIONS), "--voices", "piper:joe",
            "--limit", "2", "--tail", "3", "--frontend", "tiny-copy", "--device", "cpu", "--asr", "whisper",
            "--scripted-llm", "--input-processor", f"{__name__}:Passthrough", "--end-of-turn", "silence"]
    assert main(args) == 0
    return out, args


def test_every_condition_has_every_metric(run, capsys):
    out, args = run
    results = json.loads((out / "results.json").read_text())
    assert sorted((r["condition"], r["question_id"]) for r in results) == sorted(
        (c, q) for c in CONDITIONS for q in ("spain", "france"))
    report = (out / "report.md").read_text()
    head = next(line for line in report.splitlines() if line.startswith("| condition"))
    for metric in ("WER %", "whole-question %", "answer right %", "premature finals / q", "oracle lead s",
                   "self-answer %", "ASR lag at the end s"):
        assert metric in head
    rows = {line.split("|")[1].strip(): line for line in report.splitlines() if line.startswith("| ")}
    assert all(c in rows for c in CONDITIONS)
    assert main(args) == 0  # resumable: nothing is redone, the table is printed again
    assert len(json.loads((out / "results.json").read_text())) == 6
    assert "| pause_1s | 2 |" in capsys.readouterr().out


def test_clean_speech_is_heard_and_the_pause_closes_the_turn_early(run):
    out, _ = run
    results = {(r["condition"], r["question_id"]): r for r in json.loads((out / "results.json").read_text())}
    clean = [r for (c, _), r in results.items() if c == "clean"]
    edits, total = sum(r["wer_edits"] for r in clean), sum(r["wer_words"] for r in clean)
    assert edits / total <= 0.25, [r["user_transcript"] for r in clean]
    assert all(r["premature_finals"] == 0 for r in clean)
    assert all(r["attempts"] >= 1 and r["whole"] is not None for r in clean)
    # today's silence rule (0.6 s) ends the utterance in a 1 s pause, before the question's last words
    paused = [r for (c, _), r in results.items() if c == "pause_1s"]
    assert all(r["premature_finals"] >= 1 for r in paused), [r["transcripts"] for r in paused]
    assert all(r["self_answers"] <= r["attempts"] for r in results.values())


def test_each_premature_final_is_a_turn_the_realtime_mapping_closes_early(run):
    """The Realtime mapping (server VAD) fed the session's transcripts: a speech_stopped and a committed
    user item per final, so the turns it closed before the question's end are the premature finals."""
    from server.realtime import RealtimeMapping
    from server.realtime import actions as act
    from server.realtime.config import SessionFacts
    from server.settings import RealtimeSettings

    out, _ = run
    vad = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 600,
           "create_response": True, "interrupt_response": True, "idle_timeout_ms": None}
    for r in json.loads((out / "results.json").read_text()):
        facts = SessionFacts("s1", "tiny-copy", "whisper", ("custom",), "custom", "Be brief.", vad,
                             RealtimeSettings(), 1 << 20)
        mapping = RealtimeMapping(facts, "kame", False, 1000.0)
        for t in r["transcripts"]:
            mapping.on_session(Transcript(t["final"], t["text"], t["start_s"], t["end_s"], 0.0), 1000.0 + t["t"])
        sent = [a.event for a in mapping.take() if isinstance(a, act.Send)]
        stopped = [e["audio_end_ms"] / 1000 for e in sent if e["type"] == "input_audio_buffer.speech_stopped"]
        committed = [e for e in sent if e["type"] == "input_audio_buffer.committed"]
        assert len(stopped) == len(committed) == sum(t["final"] for t in r["transcripts"])
        assert sum(s < r["speech_end_s"] for s in stopped) == r["premature_finals"], r["transcripts"]


def test_the_input_processor_sees_every_frame_and_what_was_played(run):
    """One processor per session, called on each frame with the frame played meanwhile: in the echo
    condition the assistant's voice; the processor's frame is what the session hears."""
    made = Passthrough.made[:6]
    assert len(made) == 6 and all(p.frames > 40 for p in made)  # a question and 3 s of tail, 80 ms each
    assert any(p.loudest_played > 0.05 for p in made)  # the assistant spoke in the echo sessions
