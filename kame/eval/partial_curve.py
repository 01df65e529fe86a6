"""Latency against quality for answers built from partial transcripts: every LLM attempt of a
`kame eval robustness` run, by how long before the user's true end it was asked, and whether its
answer was right. The earlier an attempt starts, the more time its answer has to reach the
front-end, and the less of the question it heard: this is the curve of that trade.

Reads results.json items (`kame.eval.robustness.record`); writes a Markdown table and a plot.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kame.eval.conditions import Question, words

BINS = ((1.5, None), (1.0, 1.5), (0.5, 1.0), (0.0, 0.5), (None, 0.0))  # lead, seconds before the true end


def points(results: Sequence[dict], questions: Sequence[Question]) -> list[tuple[float, bool]]:
    """(lead, right) per attempt: lead = the question's true end minus the audio time its words were
    heard (the attempt's start less the ASR's lag, so a loaded CPU's backlog is not counted as policy);
    right = its answer holds one of the question's answer keywords."""
    keywords = {q.id: set(q.keywords) for q in questions}
    out = []
    for item in results:
        lag = item.get("asr_lag_s") or 0.0
        for attempt in item["llm"]:
            if attempt.get("answer"):
                lead = round(item["speech_end_s"] - (attempt["t"] - lag), 3)
                out.append((lead, bool(set(words(attempt["answer"])) & keywords[item["question_id"]])))
    return out


def _label(low: float | None, high: float | None) -> str:
    if low is None:
        return f"after the end (< {high:g} s)"
    return f">= {low:g} s" if high is None else f"{low:g}-{high:g} s"


def _binned(found: Sequence[tuple[float, bool]]) -> list[tuple[float | None, float | None, list[bool]]]:
    """Each of `BINS` with the rightness of the attempts whose lead falls in it."""
    return [(low, high, [right for lead, right in found
                         if (low is None or lead >= low) and (high is None or lead < high)]) for low, high in BINS]


def curve_table(found: Sequence[tuple[float, bool]]) -> str:
    lines = ["| asked before the user's end | attempts | answer right % |", "|---|---:|---:|"]
    for low, high, inside in _binned(found):
        share = f"{100 * sum(inside) / len(inside):.0f}" if inside else "-"
        lines.append(f"| {_label(low, high)} | {len(inside)} | {share} |")
    return "\n".join(lines)


def curve_plot(found: Sequence[tuple[float, bool]], path: Path) -> Path | None:
    """Share right per bin against the bin's middle lead (matplotlib, the eval extra); None: no data."""
    if not found:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, ys, ns = [], [], []
    for low, high, inside in _binned(found):
        if inside:
            xs.append(high - 0.25 if low is None else low + 0.25 if high is None else (low + high) / 2)
            ys.append(100 * sum(inside) / len(inside))
            ns.append(len(inside))
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.plot(xs, ys, marker="o")
    for x, y, n in zip(xs, ys, ns, strict=True):
        axis.annotate(f"n={n}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    axis.set_xlabel("asked this long before the user's end (s)")
    axis.set_ylabel("answers right (%)")
    axis.invert_xaxis()
    axis.set_ylim(-5, 105)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
