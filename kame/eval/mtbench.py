"""MT-Bench pieces that need no server: the questions, the judge prompt and its strict parser,
per-question latency figures from a conversation's session events, the report table and the plot."""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from kame.session_events import AssistantText, LLMAttempt, OracleApplied, SessionEvent, Transcript

DEFAULT_CATEGORIES = ("reasoning", "stem", "humanities")  # the paper's: suited to speech
PAPER_SCORES = {"Moshi (paper)": 2.05, "KAME + gpt-4.1 (paper)": 6.43, "KAME + claude-opus-4-1 (paper)": 6.23,
                "Unmute + gpt-4.1 cascade, 2.1 s (paper)": 7.70}

JUDGE_SYSTEM = "You are a careful, impartial judge of answers given by a spoken voice assistant."
JUDGE_TEMPLATE = (
    "Rate the assistant's answer to the user's question below. Consider whether it is correct, helpful, "
    "relevant and as detailed as a short spoken reply allows; the answer was transcribed from speech, so "
    "ignore spelling and punctuation. Explain your judgement in a few sentences, then give a score from 1 "
    "to 10 in exactly this form: [[7]]\n\n"
    "[Question]\n{question}\n\n[The assistant's answer]\n{answer}\n[End of answer]"
)
_RATING = re.compile(r"\[\[(\d+(?:\.\d+)?)\]\]")


def load_questions(categories: tuple[str, ...] = DEFAULT_CATEGORIES, limit: int | None = None,
                   path: Path | None = None) -> list[dict]:
    """First turns of the MT-Bench questions in `categories` (FastChat's file, Apache-2.0)."""
    text = path.read_text() if path else resources.files("kame.data").joinpath("mt_bench_questions.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    known = {r["category"] for r in rows}
    unknown = set(categories) - known
    if unknown:
        raise ValueError(f"unknown MT-Bench categories {sorted(unknown)}; known: {sorted(known)}")
    chosen = [{"question_id": r["question_id"], "category": r["category"], "question": r["turns"][0]}
              for r in rows if r["category"] in categories]
    return chosen[:limit] if limit else chosen


def parse_rating(judgement: str) -> float | None:
    """The score in `[[N]]`, N in 1..10, only if exactly one such score is given; else None."""
    found = _RATING.findall(judgement)
    if len(found) != 1:
        return None
    score = float(found[0])
    return score if 1 <= score <= 10 else None


def judge_messages(question: str, answer: str) -> list[tuple[str, str]]:
    return [("system", JUDGE_SYSTEM), ("user", JUDGE_TEMPLATE.format(question=question, answer=answer or "(silence)"))]


# ----------------------------------------------------------------------------- latency figures


def latency_figures(events: Sequence[tuple[float, SessionEvent]], speech_end_s: float) -> dict:
    """From a conversation's timed session events (seconds since it started)."""
    text = [(t, e.text) for t, e in events if isinstance(e, AssistantText)]
    partials = [t for t, e in events if isinstance(e, Transcript)]
    oracles = [(t, e) for t, e in events if isinstance(e, OracleApplied) and e.accepted]
    resets = [(t, e) for t, e in oracles if e.op == "reset"]
    started = {e.epoch: e for _, e in events if isinstance(e, LLMAttempt) and e.phase == "started"}
    answer_start = next((t for t, piece in text if t >= speech_end_s and piece.strip()), None)
    used = [e for t, e in resets if answer_start is None or t <= answer_start]
    used_epoch = used[-1].epoch if used else None
    heard = started[used_epoch].user_text.split() if used_epoch in started else []
    mid_answer = [(t, e) for t, e in resets if answer_start is not None and t > answer_start]
    return {
        "speech_end_to_first_speech_s": None if answer_start is None else round(answer_start - speech_end_s, 3),
        "first_partial_to_first_oracle_s": round(oracles[0][0] - partials[0], 3) if partials and oracles else None,
        "words_heard_for_used_oracle": len(heard) if used_epoch is not None else None,
        "resets_mid_answer": len(mid_answer),
        "said_around_resets": [_said_around(text, t) for t, _ in mid_answer][:5],
    }


def _said_around(text: list[tuple[float, str]], at: float, window_s: float = 1.5) -> str:
    before = "".join(p for t, p in text if at - window_s <= t < at).strip()
    after = "".join(p for t, p in text if at <= t < at + window_s).strip()
    return f"{before} | {after}"


# ----------------------------------------------------------------------------- report


def _mean(values: list[float]) -> float | None:
    return round(statistics.mean(values), 2) if values else None


def score_table(results: list[dict], modes: list[str], categories: list[str]) -> dict[str, dict[str, float | None]]:
    table = {}
    for mode in modes:
        rows = [r for r in results if r["mode"] == mode]
        table[mode] = {c: _mean([r["score"] for r in rows if r["category"] == c and r["score"] is not None])
                       for c in categories}
        table[mode]["all"] = _mean([r["score"] for r in rows if r["score"] is not None])
        table[mode]["missing"] = sum(1 for r in rows if r["score"] is None)
    return table


def markdown_report(results: list[dict], modes: list[str], categories: list[str], settings: dict,
                    plot: str | None) -> str:
    table = score_table(results, modes, categories)
    head = "| mode | " + " | ".join(categories) + " | all | missing judgements |"
    lines = ["# Spoken MT-Bench", "", "Scores (1-10) by an LLM judge of what the assistant *said* "
             "(its audio transcribed), first turns.", "", head, "|---" * (len(categories) + 3) + "|"]
    for mode in modes:
        row = table[mode]
        lines.append(f"| {mode} | " + " | ".join(_cell(row[c]) for c in categories) +
                     f" | {_cell(row['all'])} | {row['missing']} |")
    lines += ["", "The paper's figures (reasoning + STEM + humanities):", "",
              "| system | score |", "|---|---:|"] + [f"| {k} | {v} |" for k, v in PAPER_SCORES.items()]
    lines += ["", "## Latency", "", "| mode | speech end -> first speech s | first partial -> first oracle s | "
              "words heard for the oracle used | resets mid-answer |", "|---|---:|---:|---:|---:|"]
    for mode in modes:
        rows = [r["latency"] for r in results if r["mode"] == mode]
        lines.append(f"| {mode} | " + " | ".join(_cell(_median([x[k] for x in rows])) for k in (
            "speech_end_to_first_speech_s", "first_partial_to_first_oracle_s", "words_heard_for_used_oracle",
            "resets_mid_answer")) + " |")
    if plot:
        lines += ["", f"![score against oracle delay]({plot})"]
    lines += ["", "## Settings", "", "```json", json.dumps(settings, indent=2), "```", ""]
    return "\n".join(lines)


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def _cell(value) -> str:
    return "-" if value is None else str(value)


def delay_plot(results: list[dict], path: Path) -> Path | None:
    """Score against oracle delay (the latency-versus-knowledge curve), if the run swept delays."""
    points = sorted({(r["delay_s"], r["mode"]) for r in results if r.get("delay_s") is not None})
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, ys = [], []
    for delay, mode in points:
        scores = [r["score"] for r in results if r["mode"] == mode and r["score"] is not None]
        if scores:
            xs.append(delay)
            ys.append(statistics.mean(scores))
    figure, axis = plt.subplots(figsize=(5, 3.5))
    axis.plot(xs, ys, marker="o")
    axis.set_xlabel("oracle held back (s)")
    axis.set_ylabel("mean judge score (1-10)")
    axis.set_title("Spoken MT-Bench: score against oracle delay")
    axis.set_ylim(0, 10)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
