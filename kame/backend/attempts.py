"""The planner's bookkeeping of its LLM attempts (kame/backend/planner.py decides when to start one): each
attempt's record and the session events it tells, and the running streams' race for the oracle, which the
newest stream with words wins."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from kame.backend.language import ENGLISH, Language
from kame.clock import Clock
from kame.frontend.oracle import OracleOp, OracleUpdate, TextTokenizer
from kame.session_events import KnowledgeRetrieval, LLMAttempt, ToolCallEvent
from kame.tools.base import ToolCall, ToolResult


@dataclass
class AttemptRecord:
    """One LLM attempt and its timings (clock seconds): the planner's own state, which it goes on
    changing; what leaves the planner is its frozen `snapshot`."""

    epoch: int
    backend: str
    trigger: Literal["partial", "final", "deferred", "client"]
    user_text: str  # the user's words it answers (the open utterance, else the last user turn), without a role
    requested_at: float
    first_token_at: float | None = None
    finished_at: float | None = None
    status: Literal["running", "done", "cancelled", "failed"] = "running"
    text: str = ""  # the words it produced (sent to the oracle or not)
    tokens: int = 0  # oracle tokens it sent
    took_oracle: bool = False  # it became the oracle's owner (the newest stream with words)
    kept_oracle: bool = False  # as owner it extends an agreeing oracle, reset by an older stream
    error_kind: str | None = None
    error: str | None = None
    tool_calls: int = 0  # tool calls it made (cached ones included)

    @property
    def first_token_latency_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.requested_at

    def snapshot(self, phase: str, retry_in_s: float | None = None, oracle_epoch: int = 0) -> LLMAttempt:
        """The frozen event of `phase`, with what that phase tells (the record goes on changing);
        `oracle_epoch`: the oracle in place when the attempt ended."""
        started, first, last = phase == "started", phase == "first_token", phase in ("done", "cancelled", "failed")
        outcome = {"oracle_tokens": self.tokens, "took_oracle": self.took_oracle, "kept_oracle": self.kept_oracle,
                   "oracle_epoch": oracle_epoch} if last else {}
        return LLMAttempt(phase, self.epoch, self.backend, self.trigger,
                          user_text=self.user_text if started else "",
                          latency_s=self.first_token_latency_s if first else None,
                          answer=self.text if last else "", **outcome,
                          error_kind=self.error_kind, error=self.error, retry_in_s=retry_in_s)


PlannerEvent = LLMAttempt | ToolCallEvent | KnowledgeRetrieval  # the session events the planner emits
RESULT_PREVIEW_CHARS = 500  # of a tool's result, in events and recordings


def tool_event(epoch: int, call: ToolCall, result: ToolResult | None, started: bool = False) -> ToolCallEvent:
    """A tool call's event: started, then done or failed with its result, or cancelled (no result)."""
    if started or result is None:
        return ToolCallEvent("started" if started else "cancelled", epoch, call.id, call.name, call.arguments)
    return ToolCallEvent("done" if result.ok else "failed", epoch, call.id, call.name, call.arguments,
                         result.content[:RESULT_PREVIEW_CHARS], round(result.elapsed_s, 4), result.cached,
                         result.truncated, result.error)


def knowledge_event(epoch: int, retrieval: Any) -> KnowledgeRetrieval:
    """An attempt's retrieval (a kame.knowledge.Retrieval) as its event: the sources once each, in order."""
    sources = tuple(dict.fromkeys(p.source for p in retrieval.passages))
    return KnowledgeRetrieval(epoch, retrieval.query, len(retrieval.passages), sources, retrieval.tokens,
                              round(retrieval.elapsed_s, 6))


@dataclass
class Stream:
    """One running LLM stream: its record, the user turn it answers, and the words it produced."""

    record: AttemptRecord
    turn: int
    task: asyncio.Task | None = None
    words: list[str] = field(default_factory=list)


@dataclass
class _Oracle:
    """The oracle in place: the epoch and user turn of its reset, and every word (or chunk) it holds."""

    epoch: int = 0  # 0: none yet
    turn: int = 0
    words: list[str] = field(default_factory=list)

    def agrees(self, words: list[str], turn: int, language: Language) -> bool:
        """`words` repeat this oracle from its start (as far as both go), in the same user turn."""
        return self.epoch != 0 and turn == self.turn and language.agrees(words, self.words)


class Streams:
    """The running streams, oldest first, and the oracle they race for: the newest stream that has produced
    words owns it, every older one is cancelled, and the owner's words extend the oracle in place or reset it."""

    def __init__(self, tokenizer: TextTokenizer, send_oracle: Callable[[OracleUpdate], None],
                 on_event: Callable[[PlannerEvent], None], clock: Clock, keep_agreeing: bool,
                 language: Language = ENGLISH) -> None:
        self.tokenizer, self.clock, self.keep_agreeing, self.language = tokenizer, clock, keep_agreeing, language
        self._send_oracle, self._on_event = send_oracle, on_event
        self.running: dict[int, Stream] = {}  # by epoch, oldest first
        self.owner = 0  # epoch of the stream that owns the oracle (0: none)
        self.oracle = _Oracle()

    def make_room(self, cap: int) -> None:
        """Cancel the oldest streams that do not own the oracle (the owner last) to stay under `cap`."""
        while self.running and len(self.running) >= cap:
            streams = list(self.running.values())
            self.cancel(next((s for s in streams if s.record.epoch != self.owner), streams[0]))

    def cancel(self, stream: Stream) -> None:
        self.running.pop(stream.record.epoch, None)
        if stream.task is not None:
            stream.task.cancel()
        self.finish(stream.record, "cancelled")

    def emit_words(self, stream: Stream, words: list[str]) -> None:
        record = stream.record
        if not words or record.status != "running":
            return
        stream.words += words
        record.text = self.language.join(stream.words)
        if record.first_token_at is None:
            record.first_token_at = self.clock.now()
            self._on_event(record.snapshot("first_token"))
            if record.epoch > self.owner:
                self._take_over(stream)
        if record.epoch != self.owner:  # older than the owner: it never takes the oracle back
            self.cancel(stream)
            return
        self._update_oracle(stream)

    def _take_over(self, stream: Stream) -> None:
        """The newest stream with words owns the oracle; every older one stops."""
        self.owner = stream.record.epoch
        stream.record.took_oracle = True
        for older in [s for epoch, s in self.running.items() if epoch < self.owner]:
            self.cancel(older)

    def _update_oracle(self, stream: Stream) -> None:
        """Extend the oracle in place while the owner's words agree with it, else reset it with them."""
        record, oracle = stream.record, self.oracle
        own = oracle.epoch == record.epoch
        if own or (self.keep_agreeing and oracle.agrees(stream.words, stream.turn, self.language)):
            record.kept_oracle = not own
            new = self.language.extension(stream.words, oracle.words, own)
            oracle.words += new
            if new:
                self._send(record, OracleOp.APPEND, oracle.epoch, new)
            return
        record.kept_oracle = False
        self.oracle = _Oracle(record.epoch, stream.turn, list(stream.words))
        self._send(record, OracleOp.RESET, record.epoch, stream.words)

    def _send(self, record: AttemptRecord, op: OracleOp, epoch: int, words: list[str]) -> None:
        text = self.language.join(words)
        tokens = self.language.tokenize(self.tokenizer, words, first_since_reset=op is OracleOp.RESET)
        update = OracleUpdate(epoch, op, tuple(tokens), text)
        record.tokens += len(update.tokens)
        self._send_oracle(update)

    def finish(self, record: AttemptRecord, status: str, retry_in_s: float | None = None) -> None:
        if record.status != "running":  # cancelled already
            return
        record.status, record.finished_at = status, self.clock.now()
        self._on_event(record.snapshot(status, retry_in_s, self.oracle.epoch))
