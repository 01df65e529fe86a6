"""`kame eval robustness`'s turn-taking measures on hand-made event lists: backchannels, barge-ins,
and an oracle that changes what the front-end was saying."""

from __future__ import annotations

from kame.eval.turn_metrics import contradictions, turn_metrics
from kame.session_events import AssistantText, OracleApplied, Transcript


def said(t: float, frame: int, text: str):
    return t, AssistantText(frame, text)


def reset(t: float, epoch: int, text: str, accepted: bool = True):
    return t, OracleApplied("reset", epoch, text, len(text.split()), 0, accepted, 0)


def final(t: float, text: str, start: float, end: float, backchannel: bool = False):
    return t, Transcript(True, text, start, end, 0.1, backchannel)


QUESTION = [final(3.0, "What is the capital of Spain?", 0.3, 2.4)]
ANSWER = ["Madrid", "is", "the", "capital", "of", "Spain."]


def test_a_changed_answer_mid_speech_is_counted_with_what_the_listener_heard():
    events = [*QUESTION, reset(2.5, 1, "Let me think about that."), said(2.6, 30, " Let"), said(2.7, 31, " me"),
              said(2.8, 32, " think"), reset(2.9, 2, "Madrid is the capital of Spain."),
              *[said(3.0 + i / 10, 33 + i, " " + w) for i, w in enumerate(ANSWER)]]
    heard, resets = contradictions(events)
    assert resets == 1 and heard == ["let me think || madrid is the capital of spain"]


def test_an_agreeing_reset_or_one_before_any_word_is_no_contradiction():
    events = [reset(1.0, 1, "Madrid is the capital."), reset(1.1, 2, "Madrid is the capital of Spain."),
              said(1.2, 10, " Madrid"), said(1.3, 11, " is"), said(1.4, 12, " the"),
              reset(1.5, 3, "Madrid is the capital of Spain, in the middle."),
              reset(1.6, 4, "Paris.", accepted=False)]
    assert contradictions(events) == ([], 1)


def test_backchannels_barge_ins_and_turns_after_the_question():
    events = [*QUESTION, said(3.1, 40, " Madrid"), said(3.3, 41, " is"),
              final(4.2, "Mm-hmm.", 3.4, 3.7, backchannel=True),  # while it spoke: let pass
              said(4.4, 42, " the"),
              final(6.0, "Wait, and Rome?", 4.6, 5.4),  # began 0.2 s after a word: a barge-in
              final(9.0, "Thanks.", 8.0, 8.4)]  # long after the last word: a turn, no barge-in
    got = turn_metrics(events, speech_end_s=2.4)
    assert (got["backchannels"], got["turns_after"], got["barge_ins"]) == (1, 2, 1)
    assert got["contradictions"] == 0


def test_the_partial_curve_bins_attempts_by_how_early_they_were_asked(tmp_path):
    from kame.eval.conditions import Question
    from kame.eval.partial_curve import curve_plot, curve_table, points

    spain = Question("spain", "What is the capital | of Spain?", "Madrid is the capital of Spain.", ("madrid",))
    item = {"question_id": "spain", "speech_end_s": 3.0, "asr_lag_s": 0.5, "llm": [
        {"t": 1.5, "answer": "Let me think about that."},  # heard at 1.0: 2 s early, a hedge
        {"t": 2.8, "answer": "Madrid is the capital of Spain."},  # heard at 2.3: 0.7 s early, right
        {"t": 3.9, "answer": "Madrid."},  # heard at 3.4: after the end
        {"t": 4.0, "answer": ""}]}  # cancelled before a word: no answer to judge
    found = points([item], [spain])
    assert found == [(2.0, False), (0.7, True), (-0.4, True)]
    table = curve_table(found)
    assert "| >= 1.5 s | 1 | 0 |" in table and "| 0.5-1 s | 1 | 100 |" in table
    assert "| after the end (< 0 s) | 1 | 100 |" in table and "| 0-0.5 s | 0 | - |" in table
    assert curve_plot(found, tmp_path / "curve.png").stat().st_size > 1000
    assert curve_plot([], tmp_path / "none.png") is None


def test_an_interjection_starts_once_the_assistant_talks_after_the_question():
    import numpy as np

    from kame.eval.robustness import Interjection

    said = np.full(3000, 0.5, np.float32)
    frame, quiet, voice = np.zeros(1920, np.float32), np.zeros(1920, np.float32), np.full(1920, 0.1, np.float32)
    seen = []
    inject = Interjection(said, after_s=0.16 - Interjection.AFTER_END_S,
                          inner=lambda mic, played: seen.append(played is voice) or mic)
    out = [inject(frame, voice), inject(frame, voice)]  # talking during the question: not yet
    out += [inject(frame, quiet)] + [inject(frame, voice) for _ in range(6)]
    assert inject.started_at == round(7 * 1920 / 24000, 3)  # the 4th talking frame after the question
    heard = np.concatenate(out)
    assert not heard[:6 * 1920].any() and heard[6 * 1920:].sum() == said.sum()  # all of it, once, from there
    assert len(seen) == 9  # every frame went on to the inner processor (an echo canceller)


def test_the_judge_scores_what_the_assistant_said():
    """--judge-base-url: each answer goes to a real OpenAI-compatible judge (here a scripted server on
    loopback) with the question, as spoken MT-Bench asks it; its rating lands in the item."""
    import asyncio

    from kame.eval.harness import JudgeSettings
    from kame.eval.robustness import Judge
    from kame.testing.openai_server import ScriptedOpenAIServer, ScriptedReply

    asked = []

    def reply(body):
        asked.append(body["messages"][-1]["content"])
        return ScriptedReply(text="Right and brief. Rating: [[8]]")

    server = ScriptedOpenAIServer(reply)
    server.start_in_thread()
    events = [*QUESTION, said(3.0, 33, " Madrid"), said(3.1, 34, " is"), said(3.2, 35, " the capital.")]

    async def go():
        judge = Judge(JudgeSettings(server.base_url, "judge", None, 1), heard="text")
        try:
            return await judge.score("What is the capital of Spain?", events)
        finally:
            await judge.aclose()

    try:
        got = asyncio.run(go())
    finally:
        server.stop_thread()
    assert got["score"] == 8 and got["answer_said"] == "Madrid is the capital."
    assert "What is the capital of Spain?" in asked[0] and "Madrid is the capital." in asked[0]


def test_word_pieces_are_joined_into_words_before_they_are_compared():
    events = [reset(1.0, 1, "Let me think."), said(1.1, 10, " Let"), said(1.2, 11, " me"), said(1.3, 12, " th"),
              said(1.4, 13, "ink"), reset(1.5, 2, "Madrid."), said(1.6, 14, " Mad"), said(1.7, 15, "rid.")]
    assert contradictions(events) == (["let me think || madrid"], 1)
