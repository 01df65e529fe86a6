"""`kame eval robustness`: short factual questions said as real users say them (pauses, fillers, a
restart, someone else talking, a phone line, the assistant's own voice coming back), each through a
tandem session in this process, frame by frame; one table of what went wrong, per condition.

The loop is closed: every 80 ms frame that goes in may hold the echo of what the session played
before it (`EchoPath`), and an optional `process_input(mic_frame, played_frame)` (an echo canceller)
sees each frame before the session does. Results are saved after every item (a rerun skips what is
done); the metrics are `kame.eval.robustness_metrics`'.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from kame.audio import FRAME_SIZE, SAMPLE_RATE
from kame.eval.conditions import Condition, EchoPath, Question, Voices, words
from kame.eval.robustness_metrics import (
    ANSWER_GRACE_S,
    TimedEvent,
    attempts,
    covers,
    cue_words,
    item_metrics,
    table,
)
from kame.eval.voices import Voice, background_for
from kame.session_events import AssistantAudio, AssistantText, LLMAttempt, Transcript

ProcessInput = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (mic frame, frame played meanwhile) -> frame
# the conversation of one rendered question: (input pcm, echo path or None, input processor or None) -> events
Source = Callable[[np.ndarray, EchoPath | None, ProcessInput | None], Awaitable[list[TimedEvent]]]
OUTPUT_WAIT_S = 0.5  # with echo: how long a frame waits for the output it must carry; then that output is silence


def load_questions(limit: int | None = None, path: Path | None = None) -> list[Question]:
    """The shipped questions (kame/data/robustness_questions.jsonl), or those of `path`."""
    text = path.read_text() if path else resources.files("kame.data").joinpath("robustness_questions.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    questions = [Question(r["id"], r["question"], r["answer"], tuple(r["keywords"])) for r in rows]
    return questions[:limit] if limit else questions


# ----------------------------------------------------------------------------- what the speaker plays


class Playback:
    """What the laptop's speaker plays in each input frame's slot: the front-end's output frame before
    it; or, with `speak`, the front-end's text stream said by a TTS voice (a front-end with random
    weights makes noise, while a trained one says its text), phrase by phrase as its words come."""

    QUIET_FRAMES = 3  # no new text for this many frames: the last word is complete

    def __init__(self, speak: Callable[[str], np.ndarray] | None = None) -> None:
        self.speak = speak
        self._frames: dict[int, np.ndarray] = {}
        self._queue = np.zeros(0, np.float32)
        self._text, self._quiet = "", 0

    def on_audio(self, event: AssistantAudio) -> None:
        if self.speak is None:
            self._frames[event.frame] = event.pcm

    def on_text(self, text: str) -> None:
        self._text += text
        self._quiet = 0

    def frame(self, slot: int) -> np.ndarray:
        """The samples played during input frame `slot` (output frame slot - 1 came back after it was sent)."""
        if self.speak is None:
            return self._frames.pop(slot - 1, np.zeros(FRAME_SIZE, np.float32))
        self._quiet += 1
        if len(self._queue) < FRAME_SIZE:
            self._say()
        played = np.zeros(FRAME_SIZE, np.float32)
        take = min(FRAME_SIZE, len(self._queue))
        played[:take], self._queue = self._queue[:take], self._queue[take:]
        return played

    def _say(self) -> None:
        cut = len(self._text) if self._quiet >= self.QUIET_FRAMES else self._text.rfind(" ")
        phrase, self._text = self._text[:max(cut, 0)], self._text[max(cut, 0):]
        if words(phrase):
            self._queue = np.concatenate([self._queue, self.speak(" ".join(phrase.split()))])


class Interjection:
    """A `process_input` that adds the user's `pcm` (a backchannel, a barge-in) to the mic once the
    question is `AFTER_END_S` over and the speaker has played the assistant for `TALKING_FRAMES` frames in a row,
    then hands the frame to `inner` (an echo canceller) if any. `started_at`: the audio time it began."""

    TALKING_FRAMES = 4  # 0.32 s of the assistant's voice
    LOUD = 1e-3  # RMS of a played frame that holds speech
    AFTER_END_S = 1.2  # and no sooner after the question: its utterance has ended (else they would be one)

    def __init__(self, pcm: np.ndarray, after_s: float, inner: ProcessInput | None = None) -> None:
        self.pcm, self.after, self.inner = pcm, round((after_s + self.AFTER_END_S) * SAMPLE_RATE), inner
        self.sample, self.talking, self.said = 0, 0, 0
        self.started_at: float | None = None

    def __call__(self, mic: np.ndarray, played: np.ndarray) -> np.ndarray:
        self.sample += len(mic)
        loud = float(np.sqrt(np.mean(np.square(played, dtype=np.float64)))) >= self.LOUD if len(played) else False
        self.talking = self.talking + 1 if loud and self.sample > self.after else 0
        if self.started_at is None and self.talking >= self.TALKING_FRAMES:
            self.started_at = round(self.sample / SAMPLE_RATE, 3)
        if self.started_at is not None and self.said < len(self.pcm):
            piece = self.pcm[self.said:self.said + len(mic)]
            mic = mic.copy()
            mic[:len(piece)] += piece
            self.said += len(piece)
        return self.inner(mic, played) if self.inner is not None else mic


# ----------------------------------------------------------------------------- one session


@dataclass
class _Loop:
    sent: int = 0  # input frames pushed
    back: int = 0  # output frames come back
    late: int = 0  # frames sent without the output they should have carried
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    news: asyncio.Event = field(default_factory=asyncio.Event)  # a transcript or an LLM phase came
    closed_at: float = 0.0  # the audio time of the ASR's latest final's end

    @property
    def audio_s(self) -> float:
        return self.sent * FRAME_SIZE / SAMPLE_RATE

    async def output_back(self, frames: int) -> None:
        while self.back < frames:
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), OUTPUT_WAIT_S)
            except TimeoutError:
                self.late += 1
                return

    async def quiet(self, heard_s: float, quiet_s: float = 1.0, limit_s: float = 20.0) -> None:
        """Until the ASR has closed an utterance at or after `heard_s` of audio (a loaded CPU's ASR lags
        by seconds) and then no transcript or LLM event came for `quiet_s`; at most `limit_s`."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            self.news.clear()
            try:
                await asyncio.wait_for(self.news.wait(), quiet_s)
            except TimeoutError:
                if self.closed_at >= heard_s:
                    return


async def converse_closed_loop(runtime, pcm: np.ndarray, config=None, tail_s: float = 4.0,
                               echo: EchoPath | None = None, process_input: ProcessInput | None = None,
                               assistant_voice: Callable[[str], np.ndarray] | None = None) -> list[TimedEvent]:
    """Say `pcm` then `tail_s` of silence to a new session at real-time pace, one frame at a time; with
    `echo`, each frame also holds the echo of what was played before it. Returns every event, stamped
    with the audio time (seconds pushed) at which it came out."""
    from kame.session import SessionConfig, TandemSession

    audio = np.concatenate([np.asarray(pcm, np.float32), np.zeros(round(tail_s * SAMPLE_RATE), np.float32)])
    frames = -(-len(audio) // FRAME_SIZE)
    audio = np.pad(audio, (0, frames * FRAME_SIZE - len(audio)))
    events: list[TimedEvent] = []
    loop, playback = _Loop(), Playback(assistant_voice)
    started = time.monotonic()
    async with await TandemSession.open(runtime, config or SessionConfig()) as session:
        collector = asyncio.get_running_loop().create_task(_collect(session, events, loop, playback),
                                                           name=f"robustness-{session.id}")
        for slot in range(frames):
            await _until(started + slot * FRAME_SIZE / SAMPLE_RATE)
            mic = audio[slot * FRAME_SIZE:(slot + 1) * FRAME_SIZE]
            if echo is not None:
                await loop.output_back(slot)  # the echo in this frame is of output that came back before it
            if echo is not None or process_input is not None:
                played = playback.frame(slot)
                mic = mic + echo(played) if echo is not None else mic
                if process_input is not None:
                    mic = process_input(mic, played)
            session.push_pcm(np.asarray(mic, np.float32))
            loop.sent = slot + 1
        await _until(started + frames * FRAME_SIZE / SAMPLE_RATE)
        await loop.quiet(len(pcm) / SAMPLE_RATE)  # a lagging ASR and the LLM catch up with what they were given
    await collector
    return events


async def _collect(session, events: list[TimedEvent], loop: _Loop, playback: Playback) -> None:
    try:
        async for event in session:
            events.append((round(loop.audio_s, 3), event))
            if isinstance(event, AssistantAudio):
                loop.back += 1
                playback.on_audio(event)
                loop.arrived.set()
            elif isinstance(event, AssistantText):
                playback.on_text(event.text)
            elif isinstance(event, Transcript | LLMAttempt):
                if isinstance(event, Transcript) and event.final:
                    loop.closed_at = max(loop.closed_at, event.end_s)
                loop.news.set()
    finally:
        loop.back = 1 << 30  # nothing more comes: nobody waits
        loop.arrived.set()
        loop.closed_at = float("inf")  # nothing more comes: nobody waits
        loop.news.set()


async def _until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


# ----------------------------------------------------------------------------- the evaluation


@dataclass(frozen=True)
class RobustnessSettings:
    out: Path  # results.json, report.md, tts/
    conditions: tuple[Condition, ...]
    voices: tuple[Voice, ...]
    questions: tuple[Question, ...]
    echo_delay_s: float = 0.12  # speaker to mic
    echo_gain_db: float = -6.0
    grace_s: float = ANSWER_GRACE_S
    seed: int = 0
    assistant_voice: Voice | None = None  # says the front-end's text in the echo; None: its own audio
    input_processor: Callable[[], ProcessInput] | None = None  # one per session (an echo canceller)
    judge: Judge | None = None  # scores each answer as spoken MT-Bench does (a real LLM judge)
    report_settings: dict = field(default_factory=dict)  # shown in the report (the command's flags)


async def evaluate(source: Source, settings: RobustnessSettings) -> list[dict]:
    """Every (voice, condition, question) not done yet, through `source`; then the report. Returns the results."""
    from tqdm import tqdm

    results_path = settings.out / "results.json"
    settings.out.mkdir(parents=True, exist_ok=True)
    results = json.loads(results_path.read_text()) if results_path.exists() else []
    done = {(r["voice"], r["condition"], r["question_id"]) for r in results}
    todo = [(v, c, q) for v in settings.voices for c in settings.conditions for q in settings.questions
            if (v.name, c.name, q.id) not in done]
    tts = settings.out / "tts"
    for voice_, condition, question in tqdm(todo, desc="robustness", unit="item"):
        speakers = Voices(voice_.speaker(tts), background_for(voice_).speaker(tts))
        rendered = condition.render(question, speakers, settings.seed)
        echo = EchoPath(settings.echo_delay_s, settings.echo_gain_db) if condition.echo else None
        processor = settings.input_processor() if settings.input_processor else None  # on in every condition
        interjection = (Interjection(rendered.interjection, rendered.speech_end_s, processor)
                        if rendered.interjection is not None else None)
        events = await source(rendered.pcm, echo, interjection or processor)
        item = record(voice_.name, condition.name, question, rendered.speech_end_s, events, settings.grace_s)
        if settings.judge is not None:
            item |= await settings.judge.score(question.plain, events)
        if interjection is not None:
            item["interjected_at_s"] = interjection.started_at  # None: the assistant never talked
        results.append(item)
        _save(results_path, json.dumps(results, indent=1))
    chosen = _product({v.name for v in settings.voices}, {c.name for c in settings.conditions},
                      {q.id for q in settings.questions})
    results = [r for r in results if (r["voice"], r["condition"], r["question_id"]) in chosen]
    _save(settings.out / "report.md", report(results, settings))
    return results  # this run's items (results.json keeps those of earlier runs with other choices too)


class Judge:
    """Spoken MT-Bench's judge on each answer (`kame.eval.harness.judge`): what the assistant said
    after the question, heard by Whisper from its audio (`heard="audio"`: a trained front-end's
    voice), or its text stream (`heard="text"`: an untrained preset, whose audio is noise)."""

    def __init__(self, settings, heard: str = "audio", asr_model: str = "tiny.en") -> None:
        from kame.eval.harness import _judge_llm

        self.settings, self.heard = settings, heard
        self.llm = _judge_llm(settings)
        self.asr = None
        if heard == "audio":
            from kame.asr import build_asr

            self.asr = build_asr("whisper", asr_model, realtime=False)

    async def said(self, events: Sequence[TimedEvent]) -> str:
        if self.asr is None:
            return "".join(e.text for _, e in events if isinstance(e, AssistantText)).strip()
        from kame.eval.harness import heard_said

        audio = [e.pcm for _, e in events if isinstance(e, AssistantAudio)]
        return await heard_said(self.asr, np.concatenate(audio) if audio else np.zeros(FRAME_SIZE, np.float32))

    async def score(self, question: str, events: Sequence[TimedEvent]) -> dict:
        from kame.eval.harness import judge

        said = await self.said(events)
        score, judgements = await judge(self.llm, question, said, self.settings.retries)
        return {"answer_said": said, "score": score, "judgements": judgements}

    async def aclose(self) -> None:
        await self.llm.aclose()
        if self.asr is not None:
            self.asr.close()


def _product(voices: set, conditions: set, questions: set) -> set:
    return {(v, c, q) for v in voices for c in conditions for q in questions}


def record(voice_: str, condition: str, question: Question, speech_end_s: float, events: Sequence[TimedEvent],
           grace_s: float = ANSWER_GRACE_S) -> dict:
    """One item of results.json: its metrics, and what the ASR and the planner did (for reading it again)."""
    return {
        "voice": voice_, "condition": condition, "question_id": question.id, "question": question.plain,
        "speech_end_s": round(speech_end_s, 3), **item_metrics(events, question, speech_end_s, grace_s),
        "transcripts": [{"t": t, "final": e.final, "text": e.text, "start_s": round(e.start_s, 3),
                         "end_s": round(e.end_s, 3)} for t, e in events if isinstance(e, Transcript)],
        "llm": [{"epoch": a.epoch, "t": a.started_at, "first_token_t": a.first_token_at, "trigger": a.trigger,
                 "line": a.line, "answer": a.answer} for a in attempts(events)],
        "assistant_text": "".join(e.text for _, e in events if isinstance(e, AssistantText)).strip(),
        "llm_failed": sum(1 for _, e in events if isinstance(e, LLMAttempt) and e.phase == "failed"),
    }


def report(results: list[dict], settings: RobustnessSettings) -> str:
    names = [c.name for c in settings.conditions]
    lines = ["# Robustness: real users, not TTS", "",
             f"{len(settings.questions)} questions x {len(settings.voices)} voices "
             f"({', '.join(v.name for v in settings.voices)}) per condition; definitions in docs/evaluation.md.",
             "", table(results, names), "", "## Per voice", ""]
    for voice_ in settings.voices:
        lines += [f"### {voice_.name}", "", table([r for r in results if r["voice"] == voice_.name], names), ""]
    from kame.eval.partial_curve import curve_plot, curve_table, points

    asked = points(results, settings.questions)
    plot = curve_plot(asked, settings.out / "partial_curve.png") if asked else None
    lines += ["## Answers from partial transcripts", "",
              "Every LLM attempt, by how long before the user's true end its words were heard, and whether its "
              "answer was right (docs/evaluation.md):", "", curve_table(asked), ""]
    lines += [f"![answers right against how early they were asked]({plot.name})", ""] if plot else []
    lines += ["## Conditions", ""] + [f"- `{c.name}`: {c.describe}" for c in settings.conditions]
    lines += ["", "## Settings", "", "```json", json.dumps(settings.report_settings, indent=2, default=str), "```", ""]
    return "\n".join(lines)


def _save(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # a run killed mid-write never leaves a broken file


# ----------------------------------------------------------------------------- a scripted LLM for CPU runs


def scripted_reply(questions: Sequence[Question], first_token_s: float = 0.0):
    """A script for `kame.testing.openai_server.ScriptedOpenAIServer`: the right answer to the question
    whose cue words (after its boundary) the user's lines hold, else a hedge; as an LLM that answers
    only what it heard would."""
    from kame.testing.openai_server import ScriptedReply

    def reply(body: dict) -> ScriptedReply:
        lines = body["messages"][-1]["content"].splitlines()
        heard = words(" ".join(line.partition(":")[2] for line in lines if line.startswith("user:")))
        matching = [q for q in questions if covers(heard, cue_words(q))]
        best = max(matching, key=lambda q: len(set(words(q.plain)) & set(heard)), default=None)
        return ScriptedReply(text=best.answer if best else "Let me think about that.",
                             first_token_delay_s=first_token_s)

    return reply
