"""What the Realtime mapping asks for: wire events to send, and calls on the tandem session.

The mapping (`mapping.py`) never touches a socket or a session: each of its methods returns a list
of these, in order, and the adapter (`adapter.py`) carries them out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kame.tools.base import ToolSpec


@dataclass(frozen=True)
class Send:
    """A server event for the client. Droppable ones (audio deltas) may be dropped for a slow
    reader, and are not recorded."""

    event: dict
    droppable: bool = False


@dataclass(frozen=True)
class PushAudio:
    """The front-end hears this (the client's audio, or silence fed in real time)."""

    pcm: np.ndarray  # float32 at 24 kHz


@dataclass(frozen=True)
class Flush:
    """The client committed an utterance in progress: the ASR finishes it now. When it has, the
    adapter calls `mapping.on_flushed(token, now)`."""

    token: str


@dataclass(frozen=True)
class Configure:
    """Switch the backend profile and/or the system prompt (None: unchanged)."""

    backend: str | None
    system_prompt: str | None


@dataclass(frozen=True)
class SetOracleDelay:
    seconds: float


@dataclass(frozen=True)
class SetClientTools:
    """The client's function tools, replacing those it declared before; each call waits at most
    `timeout_s` for the client's output."""

    specs: tuple[ToolSpec, ...]
    timeout_s: float


@dataclass(frozen=True)
class AddUserText:
    text: str


@dataclass(frozen=True)
class TruncateAssistant:
    """Only `heard` of the assistant's words `said` reached the user."""

    said: str
    heard: str


@dataclass(frozen=True)
class AnswerCall:
    """The client's output for function call `call_id`: the LLM waiting on it gets it."""

    call_id: str
    output: str


@dataclass(frozen=True)
class End:
    """The session cannot go on (after the error event before it)."""

    reason: str


Action = Send | PushAudio | Flush | Configure | SetOracleDelay | SetClientTools | AddUserText | TruncateAssistant \
    | AnswerCall | End
