"""What `kame eval robustness` measures of one question's session, and the table of them per condition.

Everything here is pure: a session's events, each stamped with the *audio time* at which it came out
(seconds of input pushed so far; the run pushes at real-time pace), the question, and where its
last word truly ends. docs/evaluation.md defines each metric; the hooks at the end (`ITEM_METRICS`,
`COLUMNS`) are where another measure (backchannels, barge-ins) joins the same table.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from difflib import SequenceMatcher

from kame.eval.conditions import BOUNDARY, Question, words
from kame.eval.turn_metrics import turn_metrics
from kame.session_events import AssistantText, LLMAttempt, OracleApplied, OracleLead, SessionEvent, Transcript

TimedEvent = tuple[float, SessionEvent]  # (audio seconds pushed when the event came out, the event)

ANSWER_GRACE_S = 1.0  # the answer "in place when the user stops": the plan owning the oracle this long after
FUZZY = 0.8  # a heard word matches a question word at this similarity (ASR spelling: "fahrenheit"/"farenheit")
SELF_NGRAM = 3  # an attempt answers itself when it holds 3 words in a row the assistant said (not the question's)
STOP_WORDS = frozenset((  # not what makes a question whole
    "a", "an", "the", "of", "in", "on", "at", "to", "from", "for", "as", "and", "or", "is", "are", "was", "were",
    "be", "do", "does", "did", "have", "has", "what", "which", "who", "how", "many", "much", "there", "called"))


# ----------------------------------------------------------------------------- the user's words


def wer_counts(reference: str, hypothesis: str) -> tuple[int, int]:
    """(word edits, reference words): the word error rate is their ratio (Levenshtein on `words`)."""
    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1], len(ref)


def wer(reference: str, hypothesis: str) -> float:
    edits, total = wer_counts(reference, hypothesis)
    return edits / total if total else float(bool(words(hypothesis)))


def finals(events: Sequence[TimedEvent]) -> list[Transcript]:
    return [e for _, e in events if isinstance(e, Transcript) and e.final]


def user_transcript(events: Sequence[TimedEvent], speech_end_s: float) -> str:
    """The finals of utterances that began while the user spoke (later ones are the echo's or noise);
    none: the last partial, as a client would have it."""
    said = [f.text for f in finals(events) if f.start_s < speech_end_s]
    if said:
        return " ".join(said)
    partials = [e.text for _, e in events if isinstance(e, Transcript) and e.start_s < speech_end_s]
    return partials[-1] if partials else ""


def premature_finals(events: Sequence[TimedEvent], speech_end_s: float) -> int:
    """Finals that end (in audio time) before the question's last word does: the user's turn closed
    mid-question. Each is a turn closed early on /v1/realtime with server VAD (speech_stopped + a
    committed item per final: server/realtime/conversation.py)."""
    return sum(1 for f in finals(events) if f.end_s < speech_end_s)


# ----------------------------------------------------------------------------- the planner's attempts


@dataclass
class Attempt:
    epoch: int
    started_at: float  # audio time
    trigger: str
    line: str  # the user's words it was started on (LLMAttempt.user_text)
    context: list[str]  # the user's words it was built from: earlier finals, then its line
    first_token_at: float | None = None
    answer: str = ""
    said_before: list[str] = field(default_factory=list)  # the assistant's words (text, oracle) by its start


def attempts(events: Sequence[TimedEvent]) -> list[Attempt]:
    """The session's LLM attempts, each with the user text it saw. The planner sends the LLM every
    closed user turn (a final) and the pending line; one question per session, so every final before
    the attempt's start is the question's (a final-triggered attempt's line is that final: not twice)."""
    found: dict[int, Attempt] = {}
    closed: list[str] = []
    said: list[str] = []
    for t, event in events:
        if isinstance(event, Transcript) and event.final:
            closed.append(event.text)
        elif isinstance(event, AssistantText):
            said.append(event.text)
        elif isinstance(event, OracleApplied) and event.accepted:
            said.append(" " + event.text + " ")
        elif isinstance(event, LLMAttempt):
            _attempt_event(found, t, event, closed, said)
    return sorted(found.values(), key=lambda a: a.epoch)


def _attempt_event(found: dict[int, Attempt], t: float, event: LLMAttempt, closed: list[str], said: list[str]) -> None:
    if event.phase == "started":
        line = event.user_text
        earlier = closed[:-1] if closed and closed[-1].strip() == line else closed
        context = [w for text in [*earlier, line] for w in words(text)]
        found[event.epoch] = Attempt(event.epoch, t, event.trigger, line, context, said_before=words("".join(said)))
    elif event.epoch in found:
        attempt = found[event.epoch]
        if event.phase == "first_token" and attempt.first_token_at is None:
            attempt.first_token_at = t
        elif event.answer:
            attempt.answer = event.answer


def owner_at(found: Sequence[Attempt], at: float) -> Attempt | None:
    """The attempt owning the oracle at audio time `at`: the newest one with words by then (the planner's
    rule: the newest stream that has produced words takes the oracle, older ones never take it back)."""
    spoken = [a for a in found if a.first_token_at is not None and a.first_token_at <= at]
    return max(spoken, key=lambda a: a.epoch, default=None)


def cue_words(question: Question) -> list[str]:
    """The words that make the question whole: the content words after its last boundary (else its last word)."""
    tail = question.text.rsplit(BOUNDARY, 1)[-1]
    return [w for w in words(tail) if w not in STOP_WORDS] or words(question.plain)[-1:]


def covers(context: Sequence[str], cues: Sequence[str]) -> bool:
    """Every cue word is in `context`, allowing the ASR's near-misses (`FUZZY`)."""
    return all(any(c == w or SequenceMatcher(None, c, w).ratio() >= FUZZY for w in context) for c in cues)


def asr_lag(events: Sequence[TimedEvent], speech_end_s: float) -> float:
    """How far behind the audio the ASR was when it heard the question's end: the first transcript
    covering it (else the last one) came out this many seconds of audio after the audio it covers. On
    a loaded CPU that is seconds of compute, and it grows during a session; 0 without transcripts."""
    heard = [(t - e.end_s) for t, e in events if isinstance(e, Transcript) and e.end_s >= speech_end_s]
    if not heard:
        heard = [(t - e.end_s) for t, e in events if isinstance(e, Transcript)][-1:]
    return round(max(0.0, heard[0]), 3) if heard else 0.0


def whole_question(found: Sequence[Attempt], question: Question, speech_end_s: float,
                   grace_s: float = ANSWER_GRACE_S, lag_s: float = 0.0) -> dict:
    """Was the answer in place when the user stopped built from the whole question?

    Times are on the ASR's clock: `lag_s` (`asr_lag`: on a loaded CPU seconds of compute, not policy)
    is taken off every time. `whole`: the attempt owning the oracle `grace_s` after
    the question's true end saw all its cue words (None: no attempt had words by then); `whole_from_s`:
    when (seconds after the true end; negative: before it) an attempt that saw them first took the
    oracle; `answer_right`: the owner's answer holds one of the question's answer keywords."""
    cues = cue_words(question)
    end = speech_end_s + lag_s
    owner = owner_at(found, end + grace_s)
    takeovers = sorted((a for a in found if a.first_token_at is not None), key=lambda a: a.first_token_at)
    newest, whole_from = 0, None
    for a in takeovers:
        if a.epoch > newest:
            newest = a.epoch
            if whole_from is None and covers(a.context, cues):
                whole_from = round(a.first_token_at - end, 3)
    return {
        "whole": None if owner is None else covers(owner.context, cues),
        "whole_from_s": whole_from,
        "answer_right": None if owner is None else bool(set(words(owner.answer)) & set(question.keywords)),
        "answer_in_place": None if owner is None else owner.answer,
    }


def ngrams(tokens: Sequence[str], n: int = SELF_NGRAM) -> set[tuple[str, ...]]:
    return {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)}


def self_answers(found: Sequence[Attempt], question: Question) -> int:
    """Attempts whose own line holds `SELF_NGRAM` words in a row that the assistant had said (its text
    stream or an oracle applied) before the attempt began, and that are not the question's own."""
    own = ngrams(words(question.plain))
    return sum(1 for a in found if (ngrams(words(a.line)) & ngrams(a.said_before)) - own)


def oracle_lead(events: Sequence[TimedEvent], speech_end_s: float) -> float | None:
    """The session's oracle lead (kame/latency.py) for the question's end: the first one settled after it."""
    return next((e.lead_s for t, e in events if isinstance(e, OracleLead) and t >= speech_end_s), None)


# ----------------------------------------------------------------------------- one item


ItemMetric = Callable[[Sequence[TimedEvent], Question, float], dict]  # (events, question, speech end) -> fields


def core_metrics(events: Sequence[TimedEvent], question: Question, speech_end_s: float,
                 grace_s: float = ANSWER_GRACE_S) -> dict:
    heard = user_transcript(events, speech_end_s)
    edits, total = wer_counts(question.plain, heard)
    found, lag = attempts(events), asr_lag(events, speech_end_s)
    return {
        "user_transcript": heard, "wer_edits": edits, "wer_words": total,
        "premature_finals": premature_finals(events, speech_end_s), "asr_lag_s": lag,
        **whole_question(found, question, speech_end_s, grace_s, lag),
        "oracle_lead_s": oracle_lead(events, speech_end_s),
        "attempts": len(found), "self_answers": self_answers(found, question),
    }


# more per-item measures (backchannels, barge-ins: issue #27's later parts) append here; their fields
# land in each item of results.json, and a matching entry of COLUMNS shows them
ITEM_METRICS: list[ItemMetric] = [lambda events, question, speech_end_s: turn_metrics(events, speech_end_s)]


def item_metrics(events: Sequence[TimedEvent], question: Question, speech_end_s: float,
                 grace_s: float = ANSWER_GRACE_S) -> dict:
    out = core_metrics(events, question, speech_end_s, grace_s)
    for metric in ITEM_METRICS:
        out.update(metric(events, question, speech_end_s))
    return out


# ----------------------------------------------------------------------------- the table


def _share(values: list) -> str:
    known = [v for v in values if v is not None]
    return f"{100 * sum(map(bool, known)) / len(known):.0f}" if known else "-"


def _median(values: list) -> str:
    known = [v for v in values if v is not None]
    return f"{statistics.median(known):.2f}" if known else "-"


def _wer(rows: list[dict]) -> str:
    total = sum(r["wer_words"] for r in rows)
    return f"{100 * sum(r['wer_edits'] for r in rows) / total:.1f}" if total else "-"


def _self(rows: list[dict]) -> str:
    total = sum(r["attempts"] for r in rows)
    return f"{100 * sum(r['self_answers'] for r in rows) / total:.0f}" if total else "-"


@dataclass(frozen=True)
class Column:
    header: str
    cell: Callable[[list[dict]], str]  # the condition's items -> the cell


COLUMNS: list[Column] = [
    Column("n", lambda rows: str(len(rows))),
    Column("WER %", _wer),
    Column("whole-question %", lambda rows: _share([r["whole"] for r in rows])),
    Column("whole plan from s (median)", lambda rows: _median([r["whole_from_s"] for r in rows])),
    Column("answer right %", lambda rows: _share([r["answer_right"] for r in rows])),
    Column("premature finals / q", lambda rows: f"{statistics.mean(r['premature_finals'] for r in rows):.2f}"),
    Column("q with a premature final %", lambda rows: _share([r["premature_finals"] > 0 for r in rows])),
    Column("oracle lead s (median)", lambda rows: _median([r["oracle_lead_s"] for r in rows])),
    Column("self-answer %", _self),
    Column("ASR lag at the end s (median)", lambda rows: _median([r["asr_lag_s"] for r in rows])),
    Column("backchannels let pass / q", lambda rows: _mean(rows, "backchannels")),
    Column("turns after the question / q", lambda rows: _mean(rows, "turns_after")),
    Column("barge-ins / q", lambda rows: _mean(rows, "barge_ins")),
    Column("answer changed mid-speech / q", lambda rows: _mean(rows, "contradictions")),
    Column("judge score", lambda rows: _mean([r for r in rows if r.get("score") is not None], "score")),
]


def _mean(rows: list[dict], key: str) -> str:
    known = [r[key] for r in rows if key in r]
    return f"{statistics.mean(known):.2f}" if known else "-"


def table(results: list[dict], conditions: Sequence[str], by: str = "condition") -> str:
    """One Markdown row per condition (or other key `by`) over its items, in the given order."""
    lines = ["| " + " | ".join([by, *(c.header for c in COLUMNS)]) + " |", "|---" + "|---:" * len(COLUMNS) + "|"]
    for name in conditions:
        rows = [r for r in results if r[by] == name]
        if rows:
            lines.append("| " + " | ".join([name, *(c.cell(rows) for c in COLUMNS)]) + " |")
    return "\n".join(lines)
