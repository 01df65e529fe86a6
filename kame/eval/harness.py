"""Spoken MT-Bench's loop, against any conversation source (a server's websocket, a session in this
process): each question spoken (piper, cached) in every mode, the assistant's audio transcribed,
graded by an LLM judge; results saved after every item (a rerun skips what is done), then the
Markdown report and the delay plot.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from tqdm import tqdm

from kame.asr import build_asr
from kame.asr.events import FinalTranscript
from kame.asr.transcribe import transcribe_pcm
from kame.backend.llm import ChatMessage, LLMClient, LLMError, OpenAICompatibleLLM
from kame.backend.profiles import BackendProfile
from kame.eval.mtbench import (
    delay_plot,
    judge_messages,
    latency_figures,
    load_questions,
    markdown_report,
    parse_rating,
)
from kame.protocol import wire_event
from kame.session_events import LLMAttempt, OracleApplied, SessionEvent, Transcript


@dataclass(frozen=True)
class Mode:
    """One way of answering every question; a source turns it into its own session options."""

    name: str  # the report's row, and the key a rerun resumes by
    backend: str | None = None  # LLM profile; None: the source's default
    asr: bool = True  # False: no transcripts, no oracle: the front-end alone (plain Moshi)
    oracle_delay_s: float | None = None  # hold every oracle update back this long; None: no sweep point


class SpokenConversation(Protocol):
    """What a source gives back for one question: a `kame.converse.ConversationLog` (a session in this
    process, or one over the websocket read back into the session's events), or its like."""

    events: list[tuple[float, SessionEvent]]  # (seconds since the start, the session's event)
    speech_end_s: float  # when the question's last sample went

    @property
    def assistant_audio(self) -> np.ndarray: ...

    @property
    def assistant_text(self) -> str: ...


ConversationSource = Callable[[np.ndarray, Mode], Awaitable[SpokenConversation]]


@dataclass(frozen=True)
class JudgeSettings:
    base_url: str  # OpenAI-compatible endpoint
    model: str = "gpt-4.1"
    api_key_env: str | None = "OPENAI_API_KEY"
    retries: int = 2  # re-asks for an unparseable judgement


@dataclass(frozen=True)
class EvalSettings:
    out: Path  # results.json, report.md, delay_curve.png, tts/
    judge: JudgeSettings
    modes: tuple[Mode, ...]
    categories: tuple[str, ...] = ("reasoning", "stem", "humanities")
    limit: int | None = None  # first N questions only
    asr_model: str = "tiny.en"  # the Whisper model transcribing the assistant
    report_settings: dict | None = None  # shown in the report (the command line's flags)


def modes_for(profiles: Sequence[str | None] = (None,), baseline: bool = True,
              delays: Sequence[float] = ()) -> tuple[Mode, ...]:
    """The front-end alone, the tandem with each profile, then the first profile's oracle delays."""
    profiles = list(profiles) or [None]
    modes = [Mode("moshi (front-end alone)", asr=False)] if baseline else []
    modes += [Mode(f"tandem {p or 'default'}", backend=p) for p in profiles]
    modes += [Mode(f"tandem {profiles[0] or 'default'} +{d:g}s", backend=profiles[0], oracle_delay_s=d)
              for d in delays]
    return tuple(modes)


async def judge(llm: LLMClient, question: str, answer: str, retries: int) -> tuple[float | None, list[str]]:
    """The judge's score of `answer`, asked again while unparseable; None: counted as missing."""
    judgements = []
    for _ in range(retries + 1):
        try:
            text = "".join([d async for d in llm.stream_chat([ChatMessage(r, c) for r, c in
                                                               judge_messages(question, answer)])])
        except LLMError as exc:
            judgements.append(f"(judge failed: {exc})")
            continue
        judgements.append(text)
        score = parse_rating(text)
        if score is not None:
            return score, judgements
    return None, judgements  # never a number


async def evaluate(source: ConversationSource, settings: EvalSettings) -> Path:
    """Every (mode, question) not done yet through `source`, judged; then the report. Returns the folder."""
    questions = load_questions(settings.categories, settings.limit)
    results_path = settings.out / "results.json"
    results = _load_results(results_path)
    done = {(r["mode"], r["question_id"]) for r in results}
    todo = [(m, q) for m in settings.modes for q in questions if (m.name, q["question_id"]) not in done]
    from kame.testing.speech import speech  # piper (GPL, the eval extra), loaded only once a run starts

    judge_llm = _judge_llm(settings.judge)
    asr = build_asr("whisper", settings.asr_model, realtime=False)
    try:
        for mode, question in tqdm(todo, desc="mt-bench", unit="item"):
            conversation = await source(speech(question["question"], settings.out / "tts"), mode)
            results.append(await _grade(conversation, mode, question, asr, judge_llm, settings.judge.retries))
            _save(results_path, json.dumps(results, indent=1))
    finally:
        asr.close()
        await judge_llm.aclose()
    _write_report(results, settings)
    return settings.out


async def heard_said(asr, pcm: np.ndarray) -> str:
    """What the assistant said in `pcm`, as Whisper hears it: its finals, joined."""
    return " ".join(e.text for e in await transcribe_pcm(asr, pcm) if isinstance(e, FinalTranscript))


async def _grade(conversation: SpokenConversation, mode: Mode, question: dict, asr, judge_llm: LLMClient,
                 retries: int) -> dict:
    said = await heard_said(asr, conversation.assistant_audio)
    score, judgements = await judge(judge_llm, question["question"], said, retries)
    return {
        "mode": mode.name, "delay_s": mode.oracle_delay_s, **question,
        "answer_said": said, "answer_text_stream": conversation.assistant_text, "score": score,
        "judgements": judgements,
        "latency": latency_figures(conversation.events, conversation.speech_end_s),
        "transcripts": _as_json(conversation, Transcript), "oracle": _as_json(conversation, OracleApplied),
        "llm": _as_json(conversation, LLMAttempt),
    }


def _as_json(conversation: SpokenConversation, kind: type) -> list[dict]:
    """The conversation's events of `kind` as results.json keeps them: their wire JSON (docs/protocol.md)."""
    return [wire_event(e).model_dump(exclude_none=True) for _, e in conversation.events if isinstance(e, kind)]


def _judge_llm(settings: JudgeSettings) -> OpenAICompatibleLLM:
    return OpenAICompatibleLLM(BackendProfile("judge", settings.base_url, settings.model, settings.api_key_env or None,
                                              first_token_timeout_s=60, token_timeout_s=30, max_tokens=400,
                                              temperature=0.0))


def _write_report(results: list[dict], settings: EvalSettings) -> None:
    plot = delay_plot(results, settings.out / "delay_curve.png")
    report = markdown_report(results, [m.name for m in settings.modes], list(settings.categories),
                             settings.report_settings or {}, plot.name if plot else None)
    _save(settings.out / "report.md", report)


def _load_results(path: Path) -> list[dict]:
    """What an earlier run finished (the run is resumable), creating the folder if needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return json.loads(path.read_text()) if path.exists() else []


def _save(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # a run killed mid-write never leaves a broken file
