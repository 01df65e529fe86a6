"""A user's partial spoken transcript -> a safe SQLite FTS5 query (quoted terms, OR, a prefix last word)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

MAX_TERMS = 24  # the newest words of a long turn: a bounded query stays fast
MIN_PREFIX_CHARS = 3  # a cut-off "th" or "a" would match half the index

# Fillers of speech and English function words: they carry no topic, and BM25 would only add
# noise for them (or, in a small corpus, let them decide the ranking).
_FILLERS = "um umm uh uhh er erm ah ahh eh hmm hm mm mhm oh ooh okay ok yeah yes yep no nope hey hi hello"
_STOP_WORDS = """
    a about above after again against all also am an and any are aren as at be because been before being
    below between both but by can cannot could couldn did didn do does doesn doing don down during each
    either else ever few for from further get gets getting got had hadn has hasn have haven having he her
    here hers herself him himself his how however i if in into is isn it its itself just let lets like me
    might more most much must mustn my myself need neither nor not now of off on once only or other
    ought our ours ourselves out over own please quite rather really same shall shan she should shouldn so
    some such than that the their theirs them themselves then there these they thing things think this
    those though through to too under until up upon us very want was wasn way we well were weren what
    whats when where whether which while who whom whose why will with would wouldn you your yours
    yourself yourselves s t d ll m re ve tell know say said going gonna wanna kind sort maybe actually many
    basically something anything
"""
IGNORED = frozenset(_FILLERS.split()) | frozenset(_STOP_WORDS.split())

_WORD = re.compile(r"[^\W_]+")


def query_terms(transcript: str) -> tuple[list[str], str | None]:
    """The topic words of `transcript` (lower case, deduplicated, in order) and, if the text ends
    inside a word that may be cut off, that last word (also in the list)."""
    words = [match.group(0).casefold() for match in _WORD.finditer(transcript)]
    cut_off = words[-1] if words and _WORD.match(transcript[-1:] or " ") else None
    terms: list[str] = []
    for word in words:
        if word not in IGNORED and (len(word) > 1 or word.isdigit()) and word not in terms:
            terms.append(word)
    terms = terms[-MAX_TERMS:]
    if cut_off is None or cut_off in IGNORED or len(cut_off) < MIN_PREFIX_CHARS or cut_off not in terms:
        cut_off = None
    return terms, cut_off


def vocabulary(text: str) -> set[str]:
    """The words of `text` that a cut-off word can be completed to (lower case, 4 letters or more)."""
    words = (match.group(0).casefold() for match in _WORD.finditer(text))
    return {word for word in words if len(word) > MIN_PREFIX_CHARS}


def fts_query(transcript: str, complete: Callable[[str], list[str]] | None = None) -> str:
    """An FTS5 MATCH expression for `transcript`, or "" when it has no topic words.

    Every term is a quoted string, so nothing the user says is FTS syntax. The words are OR-ed
    (BM25 ranks the passages that have more of them, and rarer ones, first). The last word may
    be cut off mid-word: it matches as a prefix and, through `complete` (the index's words that
    start with it), as each of its completions, because the index stores Porter stems, which can
    be shorter than the cut-off word ("restaura" is no prefix of "restaur", the stem of
    "restaurants"; the completion "restaurants" is stemmed to it)."""
    terms, cut_off = query_terms(transcript)
    completions = complete(cut_off) if complete is not None and cut_off is not None else []
    return build_query(terms, cut_off, completions)


def build_query(terms: list[str], cut_off: str | None, completions: Iterable[str] = ()) -> str:
    """OR of the quoted terms; the cut-off one as a prefix, followed by its completions."""
    parts = []
    for term in terms:
        parts.append(_quote(term) + ("*" if term == cut_off else ""))
        if term == cut_off:
            parts += [_quote(word) for word in completions if word not in terms]
    return " OR ".join(parts)


def _quote(term: str) -> str:
    return '"' + term.replace('"', '""') + '"'
