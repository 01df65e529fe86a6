"""`kame eval robustness`'s pieces that need no session: each condition's renderer on a synthetic voice
(lengths, silences, SNR, band limit, the echo path's delay and level measured back) and the metrics on
hand-made event lists; and flite, the extra voices' synthesiser (required where CI installs it)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from kame.audio import FRAME_SIZE, SAMPLE_RATE
from kame.eval import conditions as cond
from kame.eval.conditions import EchoPath, Question, Voices
from kame.eval.robustness import Playback, load_questions, scripted_reply
from kame.eval.robustness_metrics import (
    asr_lag,
    attempts,
    covers,
    cue_words,
    item_metrics,
    oracle_lead,
    premature_finals,
    self_answers,
    table,
    user_transcript,
    wer,
    whole_question,
)
from kame.session_events import AssistantText, LLMAttempt, OracleApplied, OracleLead, Transcript

Q = Question("spain", "What is the capital | of Spain?", "Madrid is the capital of Spain.", ("madrid",))
WORD_S = 0.25  # the fake voice: one tone burst of this length per word, 50 ms apart


def tone_voice(pitch: float, pad_s: float = 0.2):
    """A deterministic stand-in for a TTS voice: a burst per word, padded with silence as a TTS pads."""
    def speak(text: str) -> np.ndarray:
        parts = [np.zeros(round(pad_s * SAMPLE_RATE), np.float32)]
        for index, _ in enumerate(cond.words(text)):
            t = np.arange(round(WORD_S * SAMPLE_RATE)) / SAMPLE_RATE
            parts += [(0.3 * np.sin(2 * np.pi * (pitch + 20 * index) * t)).astype(np.float32),
                      np.zeros(round(0.05 * SAMPLE_RATE), np.float32)]
        return np.concatenate([*parts, np.zeros(round(pad_s * SAMPLE_RATE), np.float32)])
    return speak


VOICES = Voices(tone_voice(220), tone_voice(700))


def test_clean_is_trimmed_speech_ending_at_its_last_word():
    r = cond.clean(Q, VOICES)
    assert abs(len(r.pcm) / SAMPLE_RATE - (6 * WORD_S + 5 * 0.05 + 0.02)) < 0.02  # 6 words, TTS padding gone
    assert abs(r.speech_end_s - (len(r.pcm) / SAMPLE_RATE - 0.01)) < 0.005
    assert r.reference == "What is the capital of Spain?"


@pytest.mark.parametrize("seconds", [0.5, 1.0, 2.0])
def test_a_pause_is_silence_of_that_length_at_the_boundary(seconds):
    r = cond.paused(seconds)(Q, VOICES)
    head = cond.trim(VOICES.user("What is the capital"))
    tail = cond.trim(VOICES.user("of Spain?"))
    assert len(r.pcm) == len(head) + round(seconds * SAMPLE_RATE) + len(tail)
    gap = r.pcm[len(head):len(head) + round(seconds * SAMPLE_RATE)]
    assert not gap.any()  # silent exactly where the boundary is
    assert np.array_equal(r.pcm[:len(head)], head) and np.array_equal(r.pcm[-len(tail):], tail)
    assert r.speech_end_s == pytest.approx(cond.speech_end(r.pcm))


def test_fillers_and_restart_say_more_than_the_question():
    clean = cond.clean(Q, VOICES).pcm
    fillers = cond.fillers(Q, VOICES).pcm
    restart = cond.restart(Q, VOICES).pcm
    # two fillers of one word each, three gaps; the restart says "What is the capital of" + "the capital of Spain"
    assert len(fillers) > len(clean) + 2 * WORD_S * SAMPLE_RATE
    assert len(restart) > len(clean) + 3 * WORD_S * SAMPLE_RATE
    assert np.array_equal(cond.fillers(Q, VOICES).pcm, fillers)  # deterministic


@pytest.mark.parametrize("snr", [10.0, 5.0])
def test_background_speech_is_mixed_at_its_snr(snr):
    clean = cond.clean(Q, VOICES)
    mixed = cond.background(snr)(Q, VOICES, seed=3)
    assert len(mixed.pcm) == len(clean.pcm) and mixed.speech_end_s == clean.speech_end_s
    assert cond.snr_db(clean.pcm, mixed.pcm - clean.pcm) == pytest.approx(snr, abs=0.5)
    assert np.array_equal(mixed.pcm, cond.background(snr)(Q, VOICES, seed=3).pcm)
    assert not np.array_equal(mixed.pcm, cond.background(snr)(Q, VOICES, seed=4).pcm)


def test_the_telephone_band_stops_near_4_khz_and_keeps_time():
    rng = np.random.default_rng(0)
    noise = (rng.standard_normal(SAMPLE_RATE) * 0.1).astype(np.float32)
    phone = cond.telephone_band(noise)
    assert len(phone) == len(noise)
    spectrum = np.abs(np.fft.rfft(phone)) ** 2
    freqs = np.fft.rfftfreq(len(phone), 1 / SAMPLE_RATE)
    assert spectrum[freqs > 4500].sum() < 1e-3 * spectrum.sum()  # nothing above the 8 kHz line's band
    assert spectrum[(freqs > 300) & (freqs < 3400)].sum() > 0.8 * spectrum.sum()
    t = np.arange(SAMPLE_RATE) / SAMPLE_RATE
    tone = (0.3 * np.sin(2 * np.pi * 440 * t) * np.hanning(SAMPLE_RATE)).astype(np.float32)
    shifted = [float(np.dot(cond.telephone_band(tone)[2000:-2000], np.roll(tone, k)[2000:-2000]))
               for k in range(-5, 6)]
    assert int(np.argmax(shifted)) - 5 == 0  # no delay: the filters' delay is taken out


@pytest.mark.parametrize(("delay_s", "gain_db"), [(0.05, -6.0), (0.12, -6.0), (0.2, -12.0)])
def test_the_echo_path_delays_and_attenuates_what_is_played(delay_s, gain_db):
    rng = np.random.default_rng(1)
    played = (rng.standard_normal(20 * FRAME_SIZE) * 0.2).astype(np.float32)
    echo = EchoPath(delay_s, gain_db)
    heard = np.concatenate([echo(played[i:i + FRAME_SIZE]) for i in range(0, len(played), FRAME_SIZE)])
    lags = np.arange(0, round(0.3 * SAMPLE_RATE))
    corr = [float(np.dot(heard[k:], played[:len(played) - k])) for k in lags]
    lag = int(lags[int(np.argmax(corr))])
    assert lag == round(delay_s * SAMPLE_RATE)
    level = 20 * np.log10(np.std(heard[lag:]) / np.std(played[:len(played) - lag]))
    assert level == pytest.approx(gain_db, abs=0.1)


def test_the_playback_is_the_output_frame_before_or_the_text_said():
    audio = Playback()
    from kame.session_events import AssistantAudio

    frame = np.full(FRAME_SIZE, 0.5, np.float32)
    audio.on_audio(AssistantAudio(3, frame, True, None))
    assert not audio.frame(3).any() and np.array_equal(audio.frame(4), frame)  # output 3 plays in slot 4
    said: list[str] = []
    voiced = Playback(lambda text: said.append(text) or np.ones(FRAME_SIZE + 10, np.float32))
    voiced.on_text(" Madrid is the cap")
    assert voiced.frame(0).all() and said == ["Madrid is the"]  # the word still coming waits
    voiced.on_text("ital")
    assert not voiced.frame(1)[10:].any()  # 10 samples of the phrase left, then nothing complete
    for slot in range(2, 2 + Playback.QUIET_FRAMES):
        voiced.frame(slot)
    assert said == ["Madrid is the", "capital"]  # quiet: the last word is complete


def test_condition_and_question_sets():
    assert list(cond.CONDITIONS)[:1] == ["clean"] and cond.CONDITIONS["echo"].echo
    assert [c.name for c in cond.pick("pause_1s,clean")] == ["pause_1s", "clean"]
    with pytest.raises(ValueError, match="unknown conditions"):
        cond.pick("clean,nope")
    questions = load_questions()
    assert 12 <= len(questions) <= 20 and all("|" in q.text and q.keywords for q in questions)
    assert len({tuple(cue_words(q)) for q in questions}) == len(questions)  # each question its own ending


# ----------------------------------------------------------------------------- metrics on hand-made events


def partial(text, end_s, start_s=0.0):
    return Transcript(False, text, start_s, end_s, 0.2)


def final(text, end_s, start_s=0.0):
    return Transcript(True, text, start_s, end_s, 0.2)


def attempt(phase, epoch, **kw):
    return LLMAttempt(phase, epoch, "scripted", kw.pop("trigger", "partial"), **kw)


# "What is the capital ... of Spain?" with a 1 s pause: the silence rule closes the turn in the pause
PAUSED = [
    (0.9, partial("What is the", 0.8)),
    (0.9, attempt("started", 1, user_text="What is the")),
    (1.0, attempt("first_token", 1)),
    (1.0, OracleApplied("reset", 1, "Let me think.", 4, 12, True, 0)),
    (1.1, AssistantText(13, " Let")),
    (2.2, final("What is the capital", 2.1)),
    (2.2, attempt("started", 2, trigger="final", user_text="What is the capital")),
    (2.3, attempt("first_token", 2)),
    (2.6, attempt("done", 2, answer="The capital of what?")),
    (3.3, partial("of Spain", 3.2, 2.4)),
    (3.3, attempt("started", 3, user_text="of Spain")),
    (3.4, attempt("first_token", 3)),
    (3.5, attempt("done", 3, answer="Madrid is the capital of Spain.")),
    (3.9, final("of Spain", 3.8, 2.4)),
    (3.9, OracleLead(0.4, 3)),
]
PAUSED_END = 3.2


def test_wer():
    assert wer("What is the capital of Spain?", "what is the capital of spain") == 0
    assert wer("what is the capital of spain", "what is capital of the spain") == pytest.approx(2 / 6)
    assert wer("a b", "") == 1.0


def test_finals_before_the_true_end_are_premature():
    assert premature_finals(PAUSED, PAUSED_END) == 1
    assert premature_finals(PAUSED, 2.0) == 0
    assert user_transcript(PAUSED, PAUSED_END) == "What is the capital of Spain"
    assert user_transcript(PAUSED[:3], PAUSED_END) == "What is the"  # no final: the last partial


def test_an_attempt_sees_the_earlier_finals_and_its_own_line_once():
    found = attempts(PAUSED)
    assert [a.context for a in found] == [["what", "is", "the"], ["what", "is", "the", "capital"],
                                          ["what", "is", "the", "capital", "of", "spain"]]
    assert found[2].first_token_at == 3.4 and found[2].answer.startswith("Madrid")
    assert covers(["farenheit"], ["fahrenheit"]) and not covers(["france"], ["spain"])


def test_whole_question_is_judged_on_the_owner_after_the_grace():
    found = attempts(PAUSED)
    late = whole_question(found, Q, PAUSED_END, grace_s=0.5)  # attempt 3 has its words at 3.4
    assert late["whole"] and late["answer_right"] and late["whole_from_s"] == pytest.approx(0.2)
    early = whole_question(found, Q, PAUSED_END, grace_s=0.1)  # the pause's attempt still owns it
    assert early["whole"] is False and early["answer_right"] is False
    assert whole_question(found, Q, PAUSED_END, grace_s=0.1, lag_s=0.1)["whole"]  # the ASR's lag is taken off
    assert whole_question([], Q, PAUSED_END)["whole"] is None


def test_the_asr_lag_is_how_late_the_transcript_of_the_end_came():
    assert asr_lag(PAUSED, PAUSED_END) == pytest.approx(0.1)  # "of Spain" up to 3.2 s came out at 3.3 s
    assert asr_lag(PAUSED, 9.0) == pytest.approx(0.1)  # none covers it: the last one's
    assert asr_lag([], PAUSED_END) == 0.0


def test_the_oracle_lead_is_the_one_settled_after_the_end():
    assert oracle_lead(PAUSED, PAUSED_END) == 0.4
    assert oracle_lead(PAUSED, 5.0) is None


def test_self_answers_are_lines_holding_what_the_assistant_said():
    echoed = [*PAUSED,
              (4.5, AssistantText(50, " Madrid is the capital of Spain.")),
              (6.0, partial("Madrid is the capital of Spain", 5.9, 4.6)),
              (6.0, attempt("started", 4, user_text="Madrid is the capital of Spain")),
              (6.5, partial("capital of Spain again", 6.4, 6.1)),
              (6.5, attempt("started", 5, user_text="capital of Spain again"))]
    # attempt 4 holds "madrid is the" (said by the assistant, not the question's); attempt 5 only the question's words
    assert self_answers(attempts(echoed), Q) == 1
    assert self_answers(attempts(PAUSED), Q) == 0


def test_the_table_has_a_row_per_condition_and_every_metric():
    rows = [{"condition": c, "voice": "v", **item_metrics(PAUSED, Q, PAUSED_END)} for c in ("clean", "pause_1s")]
    text = table(rows, ["clean", "pause_1s", "absent"])
    lines = text.splitlines()
    assert len(lines) == 4 and lines[2].startswith("| clean | 1 |")
    for header in ("WER %", "whole-question %", "premature finals / q", "oracle lead s", "self-answer %"):
        assert header in lines[0]


def test_the_scripted_llm_answers_only_what_it_heard():
    reply = scripted_reply(load_questions())
    body = {"messages": [{"role": "system", "content": "x"},
                         {"role": "user", "content": "user: What is the capital\nassistant: Hm.\nuser: of Spain"}]}
    assert reply(body).text.startswith("Madrid")
    body["messages"][-1]["content"] = "user: What is the capital"
    assert reply(body).text == "Let me think about that."


# ----------------------------------------------------------------------------- the voices


def test_flite_voices_speak_deterministically(tmp_path):
    """The extra voices. CI installs flite (.ci/run) and sets KAME_REQUIRE_FLITE=1: there a missing flite fails."""
    if shutil.which("flite") is None:
        if os.environ.get("KAME_REQUIRE_FLITE") == "1":
            pytest.fail("flite is required here (apt-get install flite)")
        pytest.skip("flite is not installed (apt-get install flite)")
    from kame.eval.voices import VOICES, pick

    voices = pick("flite:slt,flite:rms")
    one = voices[0].speaker(tmp_path)("What is the capital of Spain?")
    assert 1.0 < len(one) / SAMPLE_RATE < 4.0 and np.abs(one).max() > 0.05
    assert np.array_equal(one, voices[0].speaker(tmp_path)("What is the capital of Spain?"))  # cached, the same
    other = voices[1].speaker(tmp_path)("What is the capital of Spain?")
    assert len(other) != len(one) or not np.allclose(other, one)
    assert len(list((tmp_path / "flite-slt").glob("*.wav"))) == 1
    assert {v.split(":")[0] for v in VOICES} == {"piper", "flite"}
