"""Turn-taking measures of `kame eval robustness`, beside its core ones: backchannels the session let
pass, barge-ins, and oracles that contradict what the front-end was already saying.

Pure functions of one session's events, each stamped with the audio time it came out at (as in
`kame.eval.robustness_metrics`). docs/evaluation.md defines them.
"""

from __future__ import annotations

from collections.abc import Sequence

from kame.eval.conditions import words
from kame.session_events import AssistantText, OracleApplied, Transcript

TimedEvent = tuple[float, object]
SPEAKING_S = 0.5  # the assistant is "speaking" at t when its text stream said a word at most this long before


def _said_at(events: Sequence[TimedEvent]) -> list[float]:
    return [t for t, e in events if isinstance(e, AssistantText) and e.text.strip()]


def _utterances(events: Sequence[TimedEvent]) -> list[Transcript]:
    """The finals, one per user utterance."""
    return [e for _, e in events if isinstance(e, Transcript) and e.final]


def turn_metrics(events: Sequence[TimedEvent], speech_end_s: float) -> dict:
    """`backchannels`: finals the session marked as backchannels (no turn); `barge_ins`: utterances
    after the question, not backchannels, that began while the assistant spoke; `turns_after`: every
    utterance after the question that was taken as a turn (a backchannel or an echo taken as one lands
    here); `contradictions` / `resets_while_speaking`: see `contradictions`."""
    said = _said_at(events)
    after = [u for u in _utterances(events) if u.start_s >= speech_end_s]
    turns = [u for u in after if not u.backchannel]
    barge = [u for u in turns if any(u.start_s - SPEAKING_S <= t <= u.start_s for t in said)]
    heard, resets = contradictions(events)
    return {"backchannels": sum(1 for u in after if u.backchannel), "turns_after": len(turns),
            "barge_ins": len(barge), "contradictions": len(heard), "resets_while_speaking": resets,
            "contradiction_heard": heard[:2]}


def contradictions(events: Sequence[TimedEvent], context: int = 6) -> tuple[list[str], int]:
    """Oracle resets that reached the front-end while it was saying an earlier oracle's words, and the
    ones among them whose words contradict what it had said since that earlier reset (neither's first
    words are the other's). Returns what the listener heard at each contradiction (the last `context`
    words said, ' || ', the first words after) and the count of resets while speaking. The text stream
    comes in word pieces (a piece without a leading space continues the word before it)."""
    heard: list[str] = []
    resets = 0
    said = ""  # the text said since the oracle in place was reset
    after: str | None = None  # the text said after a contradicting reset, until `context` words
    for _, event in events:
        if isinstance(event, AssistantText):
            said += event.text
            if after is not None:
                after += event.text
                if len(words(after)) > context:  # the last word is complete once another one began
                    heard[-1] += " " + " ".join(words(after)[:context])
                    after = None
        elif isinstance(event, OracleApplied) and event.accepted and event.op == "reset":
            before = words(said)
            if before:
                resets += 1
                oracle = words(event.text)
                overlap = min(len(before), len(oracle), 3)
                if overlap and before[:overlap] != oracle[:overlap]:
                    heard.append(" ".join(before[-context:]) + " ||")
                    after = ""
            said = ""
    if after is not None and heard:
        heard[-1] += " " + " ".join(words(after)[:context])
    return heard, resets
