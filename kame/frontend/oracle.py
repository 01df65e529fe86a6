"""Oracle updates and the per-slot oracle timeline: which oracle token a slot sees at each frame.

An oracle starts with a ``reset`` at the frame it is applied (start token), grows by
``append`` updates, and every frame past its end sees the text padding token. Updates carry
the epoch of the LLM stream that produced them: an append from an older stream is dropped,
a reset is never dropped.
"""

from __future__ import annotations

import codecs
import enum
import re
from dataclasses import dataclass, field
from typing import Protocol


class OracleOp(enum.Enum):
    RESET = "reset"
    APPEND = "append"


@dataclass(frozen=True)
class OracleUpdate:
    """One change to a slot's oracle, as produced by the planner."""

    epoch: int  # id of the LLM stream this came from; grows with each (re)start
    op: OracleOp
    tokens: tuple[int, ...] = ()  # text token ids; after the start token for a reset
    text: str = ""  # the words the tokens stand for: the engine ignores it, the session's events show it

    @classmethod
    def reset(cls, epoch: int, tokens: tuple[int, ...] = ()) -> OracleUpdate:
        return cls(epoch, OracleOp.RESET, tuple(tokens))

    @classmethod
    def append(cls, epoch: int, tokens: tuple[int, ...]) -> OracleUpdate:
        return cls(epoch, OracleOp.APPEND, tuple(tokens))


@dataclass(frozen=True)
class AppliedUpdate:
    """What became of an update once the engine applied it at a frame."""

    update: OracleUpdate
    frame: int  # the slot's frame index at which the update took effect
    accepted: bool  # False: a stale append, dropped
    late_tokens: int = 0  # tokens whose position had already passed (never seen by the LM)


@dataclass
class OracleTimeline:
    """The oracle of one slot, indexed by the slot's own frame counter."""

    start_token: int  # text_initial_token_id (== text_card)
    padding_token: int  # text_padding_token_id (3 for Moshi)
    epoch: int = -1
    start_frame: int | None = None  # None: no oracle yet
    tokens: list[int] = field(default_factory=list)  # start token first

    def clear(self) -> None:
        self.epoch, self.start_frame, self.tokens = -1, None, []

    def apply(self, update: OracleUpdate, frame: int) -> AppliedUpdate:
        """Apply `update` as of `frame` (the next frame the slot will step)."""
        if update.op is OracleOp.RESET:
            self.epoch, self.start_frame = update.epoch, frame
            self.tokens = [self.start_token, *update.tokens]
            return AppliedUpdate(update, frame, accepted=True)
        if self.start_frame is None or update.epoch != self.epoch:
            return AppliedUpdate(update, frame, accepted=False)
        first_position = len(self.tokens)
        self.tokens.extend(update.tokens)
        seen_until = frame - self.start_frame  # positions below this were already consumed
        late = max(0, min(len(update.tokens), seen_until - first_position))
        return AppliedUpdate(update, frame, accepted=True, late_tokens=late)

    def token_at(self, frame: int) -> int:
        if self.start_frame is None or frame < self.start_frame:
            return self.padding_token
        position = frame - self.start_frame
        return self.tokens[position] if position < len(self.tokens) else self.padding_token


class TextTokenizer(Protocol):
    """The part of SentencePiece the project relies on."""

    def encode(self, text: str) -> list[int]: ...

    def id_to_piece(self, token: int) -> str: ...

    def vocab_size(self) -> int: ...


def tokenize_words(tokenizer: TextTokenizer, text: str) -> list[int]:
    """Tokenise `text` one whole word at a time, as the oracle was trained on.

    SentencePiece marks a word start with "▁"; encoding each word alone (not arbitrary
    stream deltas) keeps those markers where the words really start.
    """
    tokens: list[int] = []
    for word in text.split():
        tokens.extend(tokenizer.encode(word))
    return tokens


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class PieceDecoder:
    """A stream of generated tokens as text. SentencePiece's byte-fallback pieces (`<0xE2>`) are
    collected until they make whole UTF-8 characters, so that clients never see `<0x..>`; bytes
    that cannot be completed become U+FFFD."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self._pieces = tokenizer.vocab_size()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        """The text this token completes ("" while a character is still incomplete, or for an id the
        tokenizer does not have: the loader lets a model's text vocabulary be larger than its tokenizer's)."""
        if not 0 <= token < self._pieces:
            return ""
        piece = self.tokenizer.id_to_piece(token)
        if byte := _BYTE_PIECE.fullmatch(piece):
            return self._utf8.decode(bytes([int(byte.group(1), 16)]))
        return self._utf8.decode(b"", final=True) + piece.replace("▁", " ")


def oracle_stream(events: list[tuple[int, tuple[int, ...]]], frames: int, start_token: int,
                  padding_token: int) -> list[int]:
    """The oracle token of every frame `0..frames-1` for a list of `(frame, tokens)` resets, built
    by the same `OracleTimeline` the engine reads at inference. Training data comes from here, so
    a later, shorter oracle clears the tail of an earlier one exactly as it does in a live session.
    Events are applied in frame order; events at the same frame apply in list order."""
    timeline = OracleTimeline(start_token, padding_token)
    pending = sorted(enumerate(events), key=lambda item: (item[1][0], item[0]))
    stream, next_event = [], 0
    for frame in range(frames):
        while next_event < len(pending) and pending[next_event][1][0] <= frame:
            timeline.apply(OracleUpdate.reset(next_event, tuple(pending[next_event][1][1])), frame)
            next_event += 1
        stream.append(timeline.token_at(frame))
    return stream
