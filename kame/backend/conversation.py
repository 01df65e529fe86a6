"""The conversation as the planner keeps it for its LLM (kame/backend/planner.py): closed turns, the user's
open utterance and what the assistant said, and the request an attempt sends on it."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from kame.backend.llm import ChatMessage


class Ask(NamedTuple):
    """What an attempt sends the LLM, and the user's words it answers (its `user_text`)."""

    messages: list[ChatMessage]
    user_words: str


@dataclass
class Turns:
    """The conversation: closed turns plus the user's pending words and the assistant's speech."""

    turns: deque[tuple[str, str]] = field(default_factory=lambda: deque(maxlen=20))
    pending_user: str = ""
    user_closed: bool = True  # the last user utterance ended with a final
    assistant_said: str = ""

    def begin_user(self) -> None:
        if self.user_closed:
            if self.assistant_said.strip():
                self.turns.append(("assistant", self.assistant_said.strip()))
            self.assistant_said, self.user_closed = "", False

    def user_words(self) -> str:
        """The user's words an attempt started now answers: the open utterance's, else the last user turn's."""
        if self.pending_user and not self.user_closed:
            return self.pending_user
        return next((text for role, text in reversed(self.turns) if role == "user"), "")

    def lines(self, limit: int) -> list[str]:
        turns = list(self.turns)[-limit:]
        if self.assistant_said.strip() and self.user_closed:
            turns.append(("assistant", self.assistant_said.strip()))
        if self.pending_user and not self.user_closed:
            turns.append(("user", self.pending_user))
        return [f"{role}: {text}" for role, text in turns]

