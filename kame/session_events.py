"""What a tandem session tells its transport: one frozen event type per fact, in the order they happen.

Times are seconds. `frame` is the session's own frame index (0 = its first frame). Audio times
(`start_s`, `end_s`) count the session's input audio from its first sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np


@dataclass(frozen=True)
class AssistantAudio:
    """One 80 ms frame of the assistant's speech (silence while the model's acoustic delay runs)."""

    frame: int
    pcm: np.ndarray  # float32, FRAME_SIZE samples at 24 kHz
    ready: bool  # False for the first frame(s): the LM's acoustic delay
    latency_s: float | None  # input frame pushed -> this output frame, in the session


@dataclass(frozen=True)
class AssistantText:
    """A piece of the front-end's text stream (what it says), SentencePiece's word marker as a space."""

    frame: int
    text: str


@dataclass(frozen=True)
class Transcript:
    """The user's words so far (partial) or an ended utterance (final), from the ASR."""

    final: bool
    text: str
    start_s: float
    end_s: float
    lag_s: float  # wall time from receiving the audio up to end_s to this transcript
    backchannel: bool = False  # "mm-hm" while the assistant spoke: the planner let it pass, no turn
    settled: bool = False  # a partial: the speech paused, its words will not change (the turn may go on)


@dataclass(frozen=True)
class OracleApplied:
    """An oracle update reached the front-end at `frame` (or was dropped as stale)."""

    op: Literal["reset", "append"]
    epoch: int
    text: str
    tokens: int
    frame: int
    accepted: bool
    late_tokens: int  # tokens whose frame had already passed (never seen by the LM)


@dataclass(frozen=True)
class LLMAttempt:
    """A phase of one LLM stream: started, first_token, then done, cancelled or failed."""

    phase: Literal["started", "first_token", "done", "cancelled", "failed"]
    epoch: int
    backend: str
    trigger: str
    user_text: str = ""  # with "started": the user's words it answers (data: no "user:" role to strip)
    latency_s: float | None = None  # with "first_token": request -> first words
    answer: str = ""  # with the last phase, as are:
    oracle_tokens: int = 0  # the oracle tokens it sent
    took_oracle: bool = False  # it became the oracle's owner (the newest stream with words)
    kept_oracle: bool = False  # as owner, it extended an older stream's agreeing oracle instead of resetting it
    error_kind: str | None = None
    error: str | None = None
    retry_in_s: float | None = None  # after a failure: when the next attempt may start
    oracle_epoch: int = 0  # with the last phase: the epoch of the oracle in place then (0: none); not on the wire


@dataclass(frozen=True)
class ToolCallEvent:
    """A tool call of an LLM attempt: started, then done, failed (its error went to the LLM as the
    result) or cancelled (its attempt was)."""

    phase: Literal["started", "done", "failed", "cancelled"]
    epoch: int  # the attempt
    call_id: str
    name: str
    arguments: str  # the JSON the model sent
    result: str = ""  # with done/failed: what went back to the LLM (cut to a preview)
    elapsed_s: float | None = None
    cached: bool = False  # served from the user turn's cache
    truncated: bool = False  # the result was cut to the tool's limit
    error: str | None = None


@dataclass(frozen=True)
class ToolRound:
    """An attempt's round of tool calls, before any of them runs: (call_id, name, arguments) each. A
    client that runs some of the tools (a GPT-Live client's function tools) answers them as one batch."""

    epoch: int
    calls: tuple[tuple[str, str, str], ...]


@dataclass(frozen=True)
class KnowledgeRetrieval:
    """An attempt's retrieval from the knowledge base, for its system message."""

    epoch: int
    query: str  # the search expression run
    passages: int
    sources: tuple[str, ...]
    tokens: int  # estimated tokens added to the system message
    elapsed_s: float


@dataclass(frozen=True)
class OracleLead:
    """End of the user's speech minus the time the oracle that the answer used was applied:
    positive means the front-end had its guidance before the user stopped (speak while thinking)."""

    lead_s: float
    epoch: int


@dataclass(frozen=True)
class BackendChanged:
    """The session's backend profile or system prompt is now this (the reply to `configure`)."""

    name: str
    model: str
    system_prompt: str


@dataclass(frozen=True)
class AsrFailed:
    """The ASR failed or stalled: the session goes on as the front-end alone (no oracle updates)."""

    message: str


@dataclass(frozen=True)
class FramesSkipped:
    """The engine dropped this many of the user's frames to keep the session live (a burst, a stall)."""

    count: int


@dataclass(frozen=True)
class SessionStats:
    frames_in: int
    frames_out: int
    frames_dropped: int  # input frames skipped to stay live + output audio dropped for a slow reader
    frame_latency_ms: float | None  # median of the recent frames


@dataclass(frozen=True)
class SessionFailed:
    """The session cannot go on (its engine slot failed); no event follows."""

    code: str
    message: str


SessionEvent = (AssistantAudio | AssistantText | Transcript | OracleApplied | LLMAttempt | OracleLead
                | BackendChanged | AsrFailed | FramesSkipped | SessionStats | SessionFailed | ToolCallEvent
                | ToolRound | KnowledgeRetrieval)
