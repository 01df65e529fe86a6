"""A GPT-Live session's outbound side: numbered server events and the calls on the session, in the order
they happen (what the mapping asks its carrier to do)."""

from __future__ import annotations

from server.live.actions import Action, Send
from server.live.client_events import LiveError


class LiveOutbox:
    """Numbered server events and the session calls, in the order they happen."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self._count = 0
        self._actions: list[Action] = []

    def event(self, type_: str, client_event_id: str | None = None, **fields) -> dict:
        """A numbered server event, not queued (a sideband's own error goes to that sideband only)."""
        self._count += 1
        event = {"type": type_, "event_id": f"event_{self.session_id}_{self._count}", **fields}
        if client_event_id is not None:
            event["client_event_id"] = client_event_id
        return event

    def emit(self, type_: str, droppable: bool = False, client_event_id: str | None = None, **fields) -> dict:
        event = self.event(type_, client_event_id, **fields)
        self._actions.append(Send(event, droppable))
        return event

    def error_event(self, exc: LiveError) -> dict:
        error = {"type": exc.kind, "code": exc.code, "message": str(exc)}
        if exc.param is not None:
            error["param"] = exc.param
        if exc.client_event_id is not None:
            error["client_event_id"] = exc.client_event_id
        return self.event("error", exc.client_event_id, error=error)

    def error(self, exc: LiveError) -> None:
        self._actions.append(Send(self.error_event(exc)))

    def call(self, action: Action) -> None:
        self._actions.append(action)

    def take(self) -> list[Action]:
        actions, self._actions = self._actions, []
        return actions
