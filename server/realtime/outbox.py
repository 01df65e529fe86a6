"""Where the mapping's parts put what they have to say: server events (numbered, renamed for beta
clients) and session calls, in the order they happen."""

from __future__ import annotations

import uuid

from server.realtime.actions import Action, Send

# beta clients (header `OpenAI-Beta: realtime=v1`) get the beta names of the server events
BETA_NAMES = {
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
    "conversation.item.added": "conversation.item.created",
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


class Outbox:
    def __init__(self, session_id: str, beta: bool) -> None:
        self.session_id, self.beta = session_id, beta
        self._count = 0
        self._actions: list[Action] = []

    def emit(self, type_: str, droppable: bool = False, **fields) -> None:
        self._count += 1
        name = BETA_NAMES.get(type_, type_) if self.beta else type_
        self._actions.append(Send({"type": name, "event_id": f"event_{self.session_id}_{self._count}", **fields},
                                  droppable))

    def error(self, code: str, message: str, param: str | None = None, event_id: str | None = None,
              kind: str = "invalid_request_error") -> None:
        self.emit("error", error={"type": kind, "code": code, "message": message, "param": param,
                                  "event_id": event_id})

    def call(self, action: Action) -> None:
        self._actions.append(action)

    def take(self) -> list[Action]:
        actions, self._actions = self._actions, []
        return actions
