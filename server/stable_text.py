"""The user's transcript as GPT-Live sends it: append-only deltas (`session.input_transcript.delta`
has no "done" event and no way to take a word back), from an ASR whose partials may still revise
their last words.

A word is sent once two partials in a row agree on it and it is not among the newest `hold` words
of the latest one; a settled partial (the speech paused: the ASR says so, kame/asr/) or a final sends
the rest. Words already sent stay sent: when a later partial
revises one of them anyway, the deltas go on from the same word count, so the client's text is the
words as first sent followed by the newer ones (a revision this deep is rare: with `hold` words held
back, only an ASR that rewrites more than that many words of its past does it). A final, which may
decode the whole utterance again with more or fewer words, is aligned word by word with what was
sent: the words after the last one sent go out, none twice.

Clients split the user's speech into turns on a gap between deltas (Pipecat and LiveKit: 0.8 s), so
the mapping sends a space (`space()`) while an utterance that has sent words is `open` and no word
came for a while (on its own clock: mapping.py): the separator of the next word, sent ahead (the word
then comes without one), or one more space in a long pause.
"""

from __future__ import annotations

import difflib
import re

_NOT_WORD = re.compile(r"[^\w']+")


def _key(word: str) -> str:
    """A word as compared between partials: its case and punctuation may still change."""
    return _NOT_WORD.sub("", word.lower())


class StableWords:
    """Partial and final transcripts in, append-only text deltas out (one session's user speech)."""

    def __init__(self, hold: int = 1) -> None:
        if hold < 0:
            raise ValueError("hold must be >= 0")
        self.hold = hold
        self._sent_keys: list[str] = []  # the current utterance's words sent, by key (a final is aligned with them)
        self._previous: list[str] = []  # the last partial's words, by key
        self._spoken = False  # a word was sent in this session: the next delta starts with a space
        self._spaced = False  # the last delta ended with a space (a keepalive): the next word needs none

    @property
    def open(self) -> bool:
        """Words of the current utterance went out and its final has not come: the client's user turn is open."""
        return bool(self._sent_keys)

    def space(self) -> str:
        """A delta of one space that keeps an open turn open: the next word's separator, sent ahead."""
        self._spaced = True
        return " "

    def partial(self, text: str, settled: bool = False) -> str:
        """The delta a partial transcript of the current utterance allows now ("" for none); `settled`: the
        speech paused, its words so far go out."""
        words = text.split()
        keys = [_key(w) for w in words]
        agreed = 0
        for new, old in zip(keys, self._previous, strict=False):  # the shorter decides
            if new != old:
                break
            agreed += 1
        self._previous = keys
        return self._send(words, len(words) if settled else min(agreed, len(words) - self.hold))

    def final(self, text: str) -> str:
        """The rest of the utterance, after the words already sent as aligned with it; the next transcript
        starts a new one."""
        words = text.split()
        start = self._aligned([_key(w) for w in words])
        delta = self._say(words[start:])
        self.drop()
        return delta

    def drop(self) -> None:
        """The utterance ends (without its words, where its final was a backchannel): the next starts afresh."""
        self._sent_keys, self._previous = [], []

    def _aligned(self, keys: list[str]) -> int:
        """Where in a final's words (by key) the words sent so far end: after the last run of them the final
        has too, skipping as many of its words as were sent after that run (words the final revised)."""
        sent = self._sent_keys
        if not sent:
            return 0
        runs = [m for m in difflib.SequenceMatcher(None, sent, keys, autojunk=False).get_matching_blocks() if m.size]
        if not runs:
            return min(len(sent), len(keys))
        last = runs[-1]
        return min(len(keys), last.b + last.size + len(sent) - (last.a + last.size))

    def _send(self, words: list[str], upto: int) -> str:
        sent = len(self._sent_keys)
        return self._say(words[sent:upto]) if upto > sent else ""

    def _say(self, fresh: list[str]) -> str:
        if not fresh:
            return ""
        self._sent_keys += [_key(w) for w in fresh]
        delta = (" " if self._spoken and not self._spaced else "") + " ".join(fresh)
        self._spoken, self._spaced = True, False
        return delta


class Keepalive:
    """When an open user turn needs a space to stay open at the client: `every_s` after the last delta, and
    for `for_s` after the last word at most (an ASR that never ends the utterance does not hold a turn open
    for ever), on the mapping's clock: a slow decode delays the words, not the spaces."""

    def __init__(self, every_s: float = 0.3, for_s: float = 5.0) -> None:
        self.every_s, self.for_s = every_s, for_s
        self._due: float | None = None
        self._last_word = 0.0

    def sent(self, now: float, words: bool, open_turn: bool) -> None:
        """A delta went out (with words or not); `open_turn`: its utterance goes on."""
        if words:
            self._last_word = now
        self._due = now + self.every_s if open_turn else None

    def due(self) -> tuple[float, ...]:
        return () if self._due is None else (self._due,)

    def fire(self, now: float, open_turn: bool) -> bool:
        """Whether a space is due now (the next is then scheduled by `sent`)."""
        if self._due is None or now < self._due:
            return False
        self._due = None
        return open_turn and now - self._last_word <= self.for_s

