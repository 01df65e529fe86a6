"""What a transport's mapping asks of a tandem session, as data: one frozen type per command, applied by
`TandemSession.apply` through the session's own API. A mapping (server/realtime, server/live) emits them
with no session in reach; its carrier hands each to the session, and a test reads them as they are."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kame.backend.llm import LLMClient


@dataclass(frozen=True)
class PushAudio:
    """The user's audio (float32, 24 kHz), or the silence a real-time clock feeds when none came."""

    pcm: np.ndarray


@dataclass(frozen=True)
class Configure:
    """Switch the LLM backend profile and/or the system prompt (None: as it is)."""

    backend: str | None = None
    system_prompt: str | None = None


@dataclass(frozen=True)
class SetOracleDelay:
    """Hold the oracle's updates back this long from now on."""

    seconds: float


@dataclass(frozen=True)
class AddUserText:
    """A user message typed, not spoken: answered as if it had been said now."""

    text: str


@dataclass(frozen=True)
class TruncateAssistant:
    """Only `heard` of the assistant's words `said` reached the user (a barge-in): the history keeps that."""

    said: str
    heard: str


@dataclass(frozen=True)
class AddContext:
    """A line the conversation gains without speech: earlier history, or the application's silent context."""

    role: Literal["user", "assistant", "context"]
    text: str


@dataclass(frozen=True)
class RequestAttempt:
    """Start an LLM attempt now (within the rate limit) on the conversation as it is."""


@dataclass(frozen=True)
class UseLLM:
    """The backend becomes `llm` (a client answering as the LLM: GPT-Live's client delegation)."""

    llm: LLMClient


SessionCommand = (
    PushAudio | Configure | SetOracleDelay | AddUserText | TruncateAssistant | AddContext | RequestAttempt | UseLLM
)
SESSION_COMMANDS = typing.get_args(SessionCommand)  # the same kinds, for isinstance
