"""The user's transcript as GPT-Live sends it: append-only deltas (`session.input_transcript.delta`
has no "done" event and no way to take a word back), from an ASR whose partials may still revise
their last words.

A word is sent once two partials in a row agree on it and it is not among the newest `hold` words
of the latest one; a settled partial (the speech paused) or a final sends the rest. Words already
sent stay sent: when a later partial revises one of them anyway, the deltas go on from the same word
count, so the client's text is the words as first sent followed by the newer ones (a revision this
deep is rare: with `hold` words held back, only an ASR that rewrites more than that many words of
its past does it).

Clients split the user's speech into turns on a gap between deltas (Pipecat and LiveKit: 0.8 s), so
while an utterance that has sent words is open (its partials keep coming, the end-of-turn model has
not ended it) and `keepalive_s` of audio passed without a delta, the delta is a space: the separator
of the next word sent ahead (then the word comes without one), or one more space in a long pause.
"""

from __future__ import annotations

import re

_NOT_WORD = re.compile(r"[^\w']+")
KEEPALIVE = " "


def _key(word: str) -> str:
    """A word as compared between partials: its case and punctuation may still change."""
    return _NOT_WORD.sub("", word.lower())


class StableWords:
    """Partial and final transcripts in, append-only text deltas out (one session's user speech)."""

    def __init__(self, hold: int = 1, keepalive_s: float = 0.3) -> None:
        if hold < 0:
            raise ValueError("hold must be >= 0")
        self.hold, self.keepalive_s = hold, keepalive_s
        self._sent = 0  # words of the current utterance sent
        self._previous: list[str] = []  # the last partial's words, by key
        self._spoken = False  # a word was sent in this session: the next delta starts with a space
        self._spaced = False  # the last delta ended with a space (a keepalive): the next word needs none
        self._sent_at: float | None = None  # audio time of the last delta

    def partial(self, text: str, at_s: float | None = None, settled: bool = False) -> str:
        """The delta a partial transcript of the current utterance, heard up to audio time `at_s`,
        allows now ("" for none); `settled`: the speech paused, its words so far go out."""
        words = text.split()
        keys = [_key(w) for w in words]
        agreed = 0
        for new, old in zip(keys, self._previous, strict=False):  # the shorter decides
            if new != old:
                break
            agreed += 1
        self._previous = keys
        delta = self._send(words, len(words) if settled else min(agreed, len(words) - self.hold))
        if not delta and self._sent and at_s is not None and at_s - (self._sent_at or 0.0) >= self.keepalive_s:
            delta, self._spaced = KEEPALIVE, True
        if delta:
            self._sent_at = at_s
        return delta

    def final(self, text: str) -> str:
        """The rest of the utterance; the next transcript starts a new one."""
        words = text.split()
        delta = self._send(words, len(words))
        self._sent, self._previous, self._sent_at = 0, [], None
        return delta

    def _send(self, words: list[str], upto: int) -> str:
        if upto <= self._sent:
            return ""
        fresh = " ".join(words[self._sent:upto])
        delta = (" " if self._spoken and not self._spaced else "") + fresh
        self._sent, self._spoken, self._spaced = upto, True, False
        return delta
