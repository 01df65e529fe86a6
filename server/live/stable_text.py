"""The user's transcript as GPT-Live sends it: append-only deltas (`session.input_transcript.delta`
has no "done" event and no way to take a word back), from an ASR whose partials may still revise
their last words.

A word is sent once two partials in a row agree on it and it is not among the newest `hold` words
of the latest one; a final sends the rest. Words already sent stay sent: when a later partial
revises one of them anyway, the deltas go on from the same word count, so the client's text is the
words as first sent followed by the newer ones (a revision this deep is rare: with `hold` words
held back, only an ASR that rewrites more than that many words of its past does it).
"""

from __future__ import annotations

import re

_NOT_WORD = re.compile(r"[^\w']+")


def _key(word: str) -> str:
    """A word as compared between partials: its case and punctuation may still change."""
    return _NOT_WORD.sub("", word.lower())


class StableWords:
    """Partial and final transcripts in, append-only text deltas out (one session's user speech)."""

    def __init__(self, hold: int = 2) -> None:
        if hold < 0:
            raise ValueError("hold must be >= 0")
        self.hold = hold
        self._sent = 0  # words of the current utterance sent
        self._previous: list[str] = []  # the last partial's words, by key
        self._spoken = False  # a word was sent in this session: the next delta starts with a space

    def partial(self, text: str) -> str:
        """The delta a partial transcript of the current utterance allows now ("" for none)."""
        words = text.split()
        keys = [_key(w) for w in words]
        agreed = 0
        for new, old in zip(keys, self._previous, strict=False):  # the shorter decides
            if new != old:
                break
            agreed += 1
        self._previous = keys
        return self._send(words, min(agreed, len(words) - self.hold))

    def final(self, text: str) -> str:
        """The rest of the utterance; the next transcript starts a new one."""
        words = text.split()
        delta = self._send(words, len(words))
        self._sent, self._previous = 0, []
        return delta

    def _send(self, words: list[str], upto: int) -> str:
        if upto <= self._sent:
            return ""
        fresh = " ".join(words[self._sent:upto])
        delta = (" " if self._spoken else "") + fresh
        self._sent, self._spoken = upto, True
        return delta
