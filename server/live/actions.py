"""What the GPT-Live mapping asks for beyond the Realtime mapping's `Send` and the session's own commands
(kame/commands.py): the adapter carries them out, in order."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kame.backend.decide import Question
from kame.commands import SessionCommand
from kame.tools.base import ToolSpec
from server.realtime.actions import AnswerCall, Send


@dataclass(frozen=True)
class Delegate:
    """Client delegation: the planner's LLM becomes the client (`delegation.ClientBackend`), whose
    delegations the adapter announces through `mapping.delegated(id)`."""


@dataclass(frozen=True)
class Commentary:
    """The client's speakable text for its delegation (None: the newest open one, or a new one)."""

    delegation_id: str | None
    text: str


@dataclass(frozen=True)
class ClientTools:
    """The client's function tools of Responses delegation (replacing those it declared before) and how the
    backend's first round may call tools (`tool_choice`, as Chat Completions takes it; None: the model's)."""

    specs: tuple[ToolSpec, ...]
    tool_choice: str | dict | None


@dataclass(frozen=True)
class Decide:
    """Evaluate Decision questions on the conversation and `inputs` (the Decision items), for a delegation, a
    trigger's transcript delta, or a client's `decision.create`; the mapping sends the result (`decided`)."""

    questions: tuple[Question, ...]
    inputs: tuple[str, ...]
    delegation_id: str | None = None
    trigger_id: str | None = None
    source_event_id: str | None = None
    source_event_type: str | None = None
    client_event_id: str | None = None
    profile: str | None = None  # the backend profile that evaluates them (the session's: Decisions delegation's model)


@dataclass(frozen=True)
class Play:
    """One frame of the assistant's audio for the media track (WebRTC), float32 at 24 kHz."""

    pcm: np.ndarray
    frame: int  # the session's frame it answers


@dataclass(frozen=True)
class Heard:
    """The user's audio as it came (float32 at 24 kHz), before muting and whether or not the session is paused:
    what a sideband's `session.input_audio.append` reflects."""

    pcm: np.ndarray


@dataclass(frozen=True)
class Finish:
    """The session ends normally (after session.closed): close the connection with `code`."""

    code: int
    reason: str


Action = (Send | SessionCommand | Delegate | Commentary | ClientTools | AnswerCall | Decide | Play
          | Heard | Finish)
