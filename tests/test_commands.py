"""Typed commands to the session (#45): each of a mapping's commands reaches the session method of the same
name through `TandemSession.apply`, nothing reaches the planner around the session, and what is not a
command is refused."""

from __future__ import annotations

import numpy as np
import pytest

from kame.commands import (
    SESSION_COMMANDS,
    AddContext,
    AddUserText,
    Configure,
    PushAudio,
    RequestAttempt,
    SetOracleDelay,
    TruncateAssistant,
    UseLLM,
)
from kame.session import TandemSession

PCM = np.zeros(480, np.float32)
LLM = object()
CASES = [(PushAudio(PCM), ("push_pcm", (PCM,))),
         (Configure("other", "Be brief."), ("configure", ("other", "Be brief."))),
         (SetOracleDelay(1.5), ("set_oracle_delay", (1.5,))), (AddUserText("hi"), ("add_user_text", ("hi",))),
         (TruncateAssistant("Paris is", "Paris"), ("truncate_assistant", ("Paris is", "Paris"))),
         (AddContext("context", "VIP"), ("add_context", ("context", "VIP"))),
         (RequestAttempt(), ("request_attempt", ())), (UseLLM(LLM), ("use_llm", (LLM,)))]


class Recorder:
    """The session's command methods, recording what they were called with."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str):
        return lambda *args: self.calls.append((name, args))

    apply = TandemSession.apply


@pytest.mark.parametrize(("command", "call"), CASES, ids=[type(c).__name__ for c, _ in CASES])
def test_each_command_is_the_session_method_of_its_kind(command, call):
    session = Recorder()
    session.apply(command)
    assert session.calls == [call]
    assert callable(getattr(TandemSession, call[0]))  # a method of the session's own API


def test_every_command_kind_is_covered_and_anything_else_is_refused():
    assert {type(c) for c, _ in CASES} == set(SESSION_COMMANDS)
    with pytest.raises(TypeError):
        Recorder().apply(("push_pcm", PCM))
