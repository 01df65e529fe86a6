"""What the Realtime mapping asks for: wire events to send, and commands to the tandem session
(kame/commands.py).

The mapping (`mapping.py`) never touches a socket or a session: it queues these, in order, and
the adapter (`adapter.py`) carries them out.
"""

from __future__ import annotations

from dataclasses import dataclass

from kame.commands import SessionCommand
from kame.tools.base import ToolSpec


@dataclass(frozen=True)
class Send:
    """A server event for the client. Droppable ones (audio deltas) may be dropped for a slow
    reader, and are not recorded."""

    event: dict
    droppable: bool = False


@dataclass(frozen=True)
class Flush:
    """The client committed an utterance in progress: the ASR finishes it now. When it has, the
    adapter calls `mapping.on_flushed(token, now)`."""

    token: str


@dataclass(frozen=True)
class SetClientTools:
    """The client's function tools, replacing those it declared before; each call waits at most
    `timeout_s` for the client's output, which comes as an AnswerCall."""

    specs: tuple[ToolSpec, ...]
    timeout_s: float


@dataclass(frozen=True)
class AnswerCall:
    """The client's output for a function call: the LLM that waits on `call_id` gets `output`
    (the call goes out as a response of its own, `mapping.function_call`)."""

    call_id: str
    output: str


@dataclass(frozen=True)
class End:
    reason: str  # the session cannot go on (after the error event before this)


Action = Send | SessionCommand | Flush | SetClientTools | AnswerCall | End
