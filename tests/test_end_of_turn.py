"""The semantic end of turn: Smart Turn v3 on synthesised speech, a pause in mid-question through a real
Whisper stream, the rule that asks it, the fallback to silence, and the settings that choose it."""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import subprocess
import sys

import numpy as np
import pytest

from kame.asr import FinalTranscript, PartialTranscript, build_asr
from kame.asr import end_of_turn as eot
from kame.asr.end_of_turn import RATE, EndOfTurnError, PauseRule, bundled_smart_turn, load_turn_model
from kame.asr.transcribe import transcribe_pcm
from kame.asr.whisper import WhisperAsr, WhisperOptions
from kame.audio import SAMPLE_RATE
from kame.pcm import Resampler
from kame.testing.pauses import paused_question, quietest_cut, speech_end, word_starts
from kame.testing.speech import speech
from server.settings import ServerSettings, SettingsError, load_settings

# "Tell me a fun fact about ... the ocean." piper's audio differs from one process to the next (its noise);
# over runs this question's cut read 0.03-0.2 and the whole of it after the pause 0.74-0.87, where "How many
# legs does a ... spider have?" read 0.27-0.9 whole: a test on it would be a coin toss
HESITANT = ("Tell me a fun fact about the ocean.", 6)


@pytest.fixture(scope="module")
def smart() -> WhisperAsr:
    asr = WhisperAsr(WhisperOptions(end_of_turn="smart-turn", coalesce=False))
    yield asr
    asr.close()


@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    return tmp_path_factory.mktemp("tts")


def finals(events) -> list[FinalTranscript]:
    return [e for e in events if isinstance(e, FinalTranscript)]


# ------------------------------------------------------------------ the model


def test_the_bundled_model_is_found_without_importing_pipecat():
    path, why = bundled_smart_turn()
    assert path is not None and path.name == "smart-turn-v3.2-cpu.onnx" and "sha256 checked" in why
    dist = importlib.metadata.distribution("pipecat-ai")
    assert dist.metadata["License-Expression"] == "BSD-2-Clause"  # what docs/turn-taking.md says
    check = ("import sys; from kame.asr.end_of_turn import bundled_smart_turn; "
             "assert bundled_smart_turn()[0] and 'pipecat' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", check], capture_output=True).returncode == 0


@pytest.mark.slow
def test_smart_turn_hears_a_sentence_cut_short_as_incomplete(smart, tts):
    text, word = HESITANT
    pcm = speech(text, tts)
    cut = quietest_cut(pcm, word_starts(pcm, smart.model)[word][1])
    pause = np.zeros(int(WhisperOptions.eot_tail_s * SAMPLE_RATE), np.float32)  # the bit of the pause it hears

    def heard(audio24: np.ndarray) -> float:
        return smart.turn_model(Resampler(SAMPLE_RATE, 16000)(audio24))

    whole = heard(np.concatenate([pcm[: int(speech_end(pcm) * SAMPLE_RATE)], pause]))
    cut_short = heard(np.concatenate([pcm[:cut], pause]))
    assert cut_short < 0.3 and whole > 0.6, (whole, cut_short)


# ------------------------------------------------------------------ through a real Whisper stream


@pytest.mark.slow
def test_a_pause_in_mid_question_keeps_the_turn_open(smart, tts):
    question = paused_question(*HESITANT, pause_s=1.0, cache_dir=tts, model=smart.model)
    events = asyncio.run(transcribe_pcm(smart, question.pcm))
    [final] = finals(events)  # one final, for the whole question
    assert final.start_s < question.pause_at_s and final.end_s > question.speech_end_s
    assert final.text.lower().startswith("tell me a fun fact") and final.text.rstrip("?.").endswith("ocean")
    # the partials before the pause and after it are of one utterance (the planner streams attempts on
    # them as it does while the user speaks), and the final came well before the fallback: the model
    # heard the finished question as complete
    partials = [e for e in events if isinstance(e, PartialTranscript)]
    assert partials[0].end_s < question.pause_at_s + 0.5 < question.pause_at_s + 1.0 < partials[-1].end_s
    assert {p.start_s for p in partials} == {final.start_s}
    assert final.end_s - question.speech_end_s < smart.options.eot_fallback_s - 1.0


@pytest.mark.slow
def test_the_silence_rule_cuts_the_same_question_in_two(smart, tts):
    question = paused_question(*HESITANT, pause_s=1.0, cache_dir=tts, model=smart.model)
    silence = build_asr("whisper", options={"end_of_turn": "silence"})
    assert silence.turn_model is None
    first, second = finals(asyncio.run(transcribe_pcm(silence, question.pcm)))
    assert first.end_s < question.pause_at_s + 1.0 < second.start_s + 0.5
    assert "ocean" not in first.text.lower() and "ocean" in second.text.lower()


@pytest.mark.slow
def test_a_complete_question_gets_its_final_at_the_first_ask(smart, tts):
    text = "Who wrote the play called Hamlet?"
    quiet = np.zeros(SAMPLE_RATE // 2, np.float32)
    pcm = np.concatenate([quiet, speech(text, tts), quiet, quiet, quiet])
    end = speech_end(pcm)
    [final] = finals(asyncio.run(transcribe_pcm(smart, pcm)))
    assert final.end_s - end < smart.options.min_silence_s + 0.15  # asked at min_silence_s, plus the VAD's lag


# ------------------------------------------------------------------ the rule that asks it


class ScriptedModel:
    """Answers from a list; records the audio it was asked about."""

    def __init__(self, *answers: float) -> None:
        self.answers, self.heard = list(answers), []

    def __call__(self, audio: np.ndarray) -> float:
        self.heard.append(len(audio))
        return self.answers.pop(0)


def chunks(seconds: float) -> list[np.ndarray]:
    return [np.ones(512, np.float32)] * int(seconds * RATE / 512)


def test_the_model_is_asked_once_per_pause_and_hears_its_tail_only():
    model = ScriptedModel(0.1, 0.9)
    rule = PauseRule(model, min_silence_s=0.6, ask_s=0.5, fallback_s=2.5, threshold=0.5, tail_s=0.2)
    audio = chunks(2.0)
    assert not rule.ends(int(0.4 * RATE), audio)  # not yet asked
    assert not rule.ends(int(0.5 * RATE), audio)  # asked: incomplete
    assert not rule.ends(int(2.0 * RATE), audio) and len(model.heard) == 1  # not asked again in this pause
    assert model.heard[0] == len(audio) * 512 - int(0.3 * RATE)  # the last 0.3 s of the pause cut off
    rule.speech()
    assert rule.ends(int(0.5 * RATE), audio)  # a new pause, asked again: complete


def test_the_fallback_silence_ends_a_turn_the_model_calls_incomplete():
    rule = PauseRule(ScriptedModel(0.0), min_silence_s=0.6, ask_s=0.3, fallback_s=2.5, threshold=0.5)
    assert not rule.ends(int(0.3 * RATE), chunks(1))
    assert not rule.ends(int(2.4 * RATE), chunks(1))
    assert rule.ends(int(2.5 * RATE), chunks(1))


def test_the_model_hears_at_most_eight_seconds():
    model = ScriptedModel(0.9)
    PauseRule(model, min_silence_s=0.6, ask_s=0.3, fallback_s=2.5, threshold=0.5).ends(int(0.3 * RATE), chunks(20))
    assert 8 * RATE - int(0.1 * RATE) <= model.heard[0] <= 8 * RATE + 512


def test_without_a_model_the_silence_rule_decides():
    rule = PauseRule(None, min_silence_s=0.6, ask_s=0.3, fallback_s=2.5, threshold=0.5)
    assert not rule.ends(int(0.59 * RATE), chunks(1)) and rule.ends(int(0.6 * RATE), chunks(1))


@pytest.mark.slow
def test_an_utterance_the_model_never_calls_complete_ends_at_the_fallback(smart, tts, monkeypatch):
    monkeypatch.setattr(smart, "turn_model", lambda audio: 0.0)  # streams opened from now on ask this
    text = "Thank you very much."
    pcm = np.concatenate([speech(text, tts), np.zeros(SAMPLE_RATE * 4, np.float32)])
    [final] = finals(asyncio.run(transcribe_pcm(smart, pcm)))
    late = final.end_s - speech_end(pcm)  # audio time: the VAD's silence count lags the sound a little
    assert smart.options.eot_fallback_s <= late < smart.options.eot_fallback_s + 0.3


# ------------------------------------------------------------------ no model: the silence rule, said once


def test_without_pipecat_the_silence_rule_stands_in_with_one_clear_line(monkeypatch, caplog):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(eot.importlib.metadata, "distribution", not_installed)
    with caplog.at_level(logging.INFO, logger="kame.asr.whisper"):
        asr = WhisperAsr(WhisperOptions())
    assert asr.turn_model is None
    [line] = [r for r in caplog.records if "end of a turn" in r.getMessage()]
    assert line.levelno == logging.WARNING
    assert "the silence rule: pipecat-ai is not installed (pip install -e '.[turn]')" in line.getMessage()


def test_a_model_file_that_is_not_the_known_one_is_not_used(monkeypatch):
    monkeypatch.setattr(eot, "SMART_TURN_SHA256", "0" * 64)
    model, why = load_turn_model("smart-turn")
    assert model is None and "sha256 differs" in why


def test_an_explicit_model_path_must_exist(tmp_path):
    with pytest.raises(EndOfTurnError, match="no Smart Turn model at"):
        load_turn_model("smart-turn", str(tmp_path / "missing.onnx"))
    with pytest.raises(EndOfTurnError, match="unknown end_of_turn"):
        load_turn_model("vad")
    assert load_turn_model("silence") == (None, "the silence rule (end_of_turn = silence)")


# ------------------------------------------------------------------ settings


@pytest.fixture
def no_env(monkeypatch):
    import os

    for name in [n for n in os.environ if n.startswith("KAME_")]:
        monkeypatch.delenv(name)


def test_the_option_reaches_the_stream_from_the_env_and_the_cli(no_env, monkeypatch):
    assert ServerSettings().whisper.end_of_turn == WhisperOptions.end_of_turn
    monkeypatch.setenv("KAME_WHISPER__END_OF_TURN", "silence")
    monkeypatch.setenv("KAME_WHISPER__EOT_FALLBACK_S", "3")
    options = load_settings(None).runtime_settings().asr_options["whisper"]
    assert options["end_of_turn"] == "silence" and options["eot_fallback_s"] == 3.0
    asr = build_asr("whisper", options=options)
    assert asr.options.end_of_turn == "silence" and asr.turn_model is None
    monkeypatch.delenv("KAME_WHISPER__END_OF_TURN")
    loaded = load_settings(None, end_of_turn="silence")  # `kame serve --end-of-turn silence`
    assert (loaded.whisper.end_of_turn, loaded.whisper.eot_fallback_s) == ("silence", 3.0)


def test_the_pauses_must_grow(no_env):
    with pytest.raises(SettingsError, match="the pauses must grow"):
        load_settings(None, whisper={"eot_ask_s": 1.0, "eot_fallback_s": 0.5})
    with pytest.raises(SettingsError, match="setting whisper.end_of_turn"):
        load_settings(None, whisper={"end_of_turn": "vad"})


def test_doctor_says_what_ends_a_turn(no_env, monkeypatch):
    from server.doctor.models import end_of_turn_check

    check = end_of_turn_check(ServerSettings())
    assert (check.level, check.name) == ("ok", "end-of-turn") and "Smart Turn v3.2 from pipecat-ai" in check.text
    silence = end_of_turn_check(ServerSettings(whisper={"end_of_turn": "silence"}))
    assert silence.text == "the silence rule: 0.6 s of silence ends a turn"
    missing = end_of_turn_check(ServerSettings(whisper={"smart_turn_model": "/nowhere/st.onnx"}))
    assert missing.level == "FAIL" and "/nowhere/st.onnx" in missing.text

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(eot.importlib.metadata, "distribution", not_installed)
    fallback = end_of_turn_check(ServerSettings())
    assert fallback.level == "warn" and "pipecat-ai is not installed" in fallback.text


# ------------------------------------------------------------------ Kyutai STT's pause rule, judged


class NowExecutor:
    """Runs a question at once (the engine thread's executor, made deterministic)."""

    def submit(self, fn, *args):
        from concurrent.futures import Future

        future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as exc:  # as a thread pool keeps it
            future.set_exception(exc)
        return future


class LateExecutor:
    """Keeps the questions; answers them when told (a model slower than a frame)."""

    def __init__(self) -> None:
        self.asked = []

    def submit(self, fn, *args):
        from concurrent.futures import Future

        self.asked.append((Future(), fn, args))
        return self.asked[-1][0]

    def answer(self) -> None:
        for future, fn, args in self.asked:
            future.set_result(fn(*args))


class LoudVad:
    """Silero's ONNX session, stood in: a chunk is speech when it is loud."""

    def run(self, _outputs, feeds):
        loud = float(np.abs(feeds["input"][0, 64:]).mean()) > 0.05
        return np.array([[0.9 if loud else 0.1]], np.float32), feeds["h"], feeds["c"]


def judged_rule(model, executor, silence_frames=5, fallback_frames=20):
    from kame.asr.end_of_turn import FramePauseJudge
    from kame.asr.vad import SilenceEndOfTurn

    judge = FramePauseJudge(model, executor, 1280, ask_frames=3, fallback_frames=fallback_frames, threshold=0.5)
    return SilenceEndOfTurn(LoudVad(), silence_frames, judge=judge)


LOUD = (np.random.default_rng(0).standard_normal(1920) * 0.3).astype(np.float32)
QUIET = np.zeros(1920, np.float32)


def test_kyutai_pause_rule_ends_a_turn_smart_turn_calls_complete_at_the_pause_rules_frame():
    model = ScriptedModel(0.9)
    rule = judged_rule(model, NowExecutor())
    signal = [rule(f) for f in [LOUD] * 6 + [QUIET] * 8]
    assert signal.index(1.0) - 6 in (4, 5, 6) and signal[-1] == 1.0  # as the plain rule: the pause's frames
    # asked once, at 3 frames of pause, on what came before it and ~0.2 s of the pause
    assert len(model.heard) == 1 and 6 * 1280 < model.heard[0] <= 6 * 1280 + 0.3 * RATE


def test_kyutai_pause_rule_keeps_a_turn_open_that_smart_turn_calls_incomplete():
    model = ScriptedModel(0.1, 0.9)
    rule = judged_rule(model, NowExecutor())
    first = [rule(f) for f in [LOUD] * 6 + [QUIET] * 12]  # incomplete: the pause goes on
    second = [rule(f) for f in [LOUD] * 3 + [QUIET] * 8]  # speech again, then a pause called complete
    assert 1.0 not in first and second[-1] == 1.0 and len(model.heard) == 2
    fallback = judged_rule(ScriptedModel(0.0), NowExecutor(), fallback_frames=20)
    signal = [fallback(f) for f in [LOUD] * 6 + [QUIET] * 22]
    assert signal.index(1.0) - 6 in (19, 20, 21)  # the fallback ends it anyway


def test_kyutai_pause_rule_never_waits_for_the_model():
    executor = LateExecutor()
    rule = judged_rule(ScriptedModel(0.9), executor)
    assert [rule(f) for f in [LOUD] * 6 + [QUIET] * 8][-1] == 0.0  # not answered yet: the turn stays open
    executor.answer()
    assert rule(QUIET) == 1.0
    rule(LOUD)  # speech: the old pause's answer counts for nothing, the new pause waits for its own
    assert [rule(f) for f in [QUIET] * 8] == [0.0] * 8 and len(executor.asked) == 2


def test_a_failing_model_leaves_the_pause_to_the_silence_rule(caplog):
    def broken(audio):
        raise RuntimeError("onnx says no")

    rule = PauseRule(broken, min_silence_s=0.6, ask_s=0.6, fallback_s=2.5, threshold=0.5)
    with caplog.at_level(logging.ERROR):
        assert not rule.ends(int(0.5 * RATE), chunks(1)) and rule.ends(int(0.6 * RATE), chunks(1))
    kyutai = judged_rule(broken, NowExecutor())
    with caplog.at_level(logging.ERROR):
        assert [kyutai(f) for f in [LOUD] * 6 + [QUIET] * 8][-1] == 1.0
    assert len([r for r in caplog.records if "end-of-turn model failed" in r.getMessage()]) == 2


def test_kyutai_stt_without_a_head_judges_its_pauses_with_smart_turn(tmp_path):
    """The wiring on a real (tiny, random) STT checkpoint without an end-of-turn head: the judge's executor
    is made, a question runs through without the engine waiting on it, and close shuts the executor."""
    from pathlib import Path

    from kame.asr.kyutai_stt import KyutaiSttAsr, SttOptions
    from kame.audio import read_audio
    from kame.testing.hub_layouts import TINY_STT_LM_CONFIG, kyutai_stt_repo, random_weights

    layout = kyutai_stt_repo(tmp_path / "stt", random_weights(TINY_STT_LM_CONFIG, seed=2))
    asr = KyutaiSttAsr(SttOptions(model=str(layout), device="cpu", max_sessions=1))
    question = read_audio(Path(__file__).parent / "fixtures" / "question.wav")
    asked, model = [], asr.turn_model
    asr.turn_model = lambda audio: asked.append(len(audio)) or model(audio)  # streams opened from now on
    try:
        assert asr.end_of_turn == "pause" and asr._judges is not None
        asyncio.run(transcribe_pcm(asr, np.concatenate([question, np.zeros(SAMPLE_RATE * 2, np.float32)])))
    finally:
        asr.close()
    assert asked  # the pause after the question was judged
    assert asr._judges._shutdown
