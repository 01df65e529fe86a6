"""GPT-Live's Decisions, as a state machine: Decisions delegation (each delegation's questions evaluated and sent
as a `decision.event`), transcript triggers (their questions on each transcript delta of their type), the client's
`decision.create`, and the Decision items (`decision.item.create`/`delete`) every evaluation reads beside the
conversation. The evaluations themselves run in the carrier (`Decide` actions; kame/backend/decide.py)."""

from __future__ import annotations

import collections
import json

from kame.backend.decide import Question, parts_text
from server.live.actions import Decide
from server.live.client_events import LiveError
from server.live.delegation import new_id
from server.live.outbox import LiveOutbox

MAX_ITEMS = 64  # Decision items kept (the oldest go first)
MAX_EVENT_IDS = 1024  # decision.create event ids remembered (a reused one is refused)


class Decisions:
    def __init__(self, outbox: LiveOutbox) -> None:
        self.outbox = outbox
        self._items: collections.OrderedDict[str, dict] = collections.OrderedDict()  # by id, as created
        self._used: collections.OrderedDict[str, None] = collections.OrderedDict()  # decision.create event ids
        # a trigger's evaluation running, by transcript event type: the newest delta that came meanwhile, if any
        self._triggered: dict[str, tuple[tuple[Question, ...], dict, str] | None] = {}

    def inputs(self) -> tuple[str, ...]:
        """The Decision items as lines of text, oldest first."""
        return tuple(_line(item) for item in self._items.values())

    def delegated(self, questions: tuple[Question, ...], delegation_id: str, profile: str) -> None:
        if questions:
            self.outbox.call(Decide(questions, self.inputs(), delegation_id=delegation_id, profile=profile))

    def transcript(self, questions: tuple[Question, ...], delta_event: dict, profile: str) -> None:
        """A transcript delta went out: its trigger's questions, if any, are evaluated for it. One evaluation
        a trigger at a time (deltas come several a second, each an LLM call): those that come while one runs
        wait, and once it ends the newest of them is evaluated."""
        if not questions:
            return
        kind = delta_event["type"]
        if kind in self._triggered:
            self._triggered[kind] = (questions, delta_event, profile)
            return
        self._triggered[kind] = None
        self.outbox.call(Decide(questions, self.inputs(), trigger_id=new_id("trig"), profile=profile,
                                source_event_id=delta_event["event_id"], source_event_type=kind))

    def triggers_changed(self) -> None:
        """`session.update` replaced the triggers: deltas waiting for the old ones are not evaluated."""
        for kind in self._triggered:
            self._triggered[kind] = None

    def create(self, questions: tuple[Question, ...], event_id: str, profile: str) -> None:
        """`decision.create`: the delegation's questions, now (its event_id once per session)."""
        if not questions:
            raise LiveError("invalid_request", "decision.create evaluates Decisions delegation's questions; this "
                            "session has none.", "type")
        if event_id in self._used:
            raise LiveError("invalid_value", f"event_id {event_id!r} was used by a decision.create already.",
                            "event_id")
        self._used[event_id] = None
        while len(self._used) > MAX_EVENT_IDS:
            self._used.popitem(last=False)
        self.outbox.call(Decide(questions, self.inputs(), client_event_id=event_id, profile=profile))

    def item_create(self, item, event_id: str | None) -> None:
        stored = {**item.model_dump(exclude_none=True), "id": item.id or new_id("ditem")}
        self._items[stored["id"]] = stored
        while len(self._items) > MAX_ITEMS:
            self._items.popitem(last=False)
        self.outbox.emit("decision.item.created", client_event_id=event_id, item=stored)

    def item_delete(self, item_id: str, event_id: str | None) -> None:
        if self._items.pop(item_id, None) is None:
            raise LiveError("invalid_value", f"No Decision item {item_id!r}.", "item_id")
        self.outbox.emit("decision.item.deleted", client_event_id=event_id, item_id=item_id)

    def decided(self, action: Decide, decision: dict | None, error: str | None = None) -> None:
        """An evaluation ended: its `decision.event`, or an error (the session goes on); then a trigger's next."""
        waiting = None
        if action.trigger_id is not None and action.source_event_type in self._triggered:
            waiting = self._triggered.pop(action.source_event_type)
        if decision is None:
            self.outbox.error(LiveError("decision_failed", f"The decision could not be made: {error}.",
                                        client_event_id=action.client_event_id, kind="server_error"))
        else:
            self.outbox.emit("decision.event", client_event_id=action.client_event_id,
                             delegation_id=action.delegation_id, trigger_id=action.trigger_id,
                             source_event_id=action.source_event_id, source_event_type=action.source_event_type,
                             event={"type": "decision.completed", "decision": decision})
        if waiting is not None:
            self.transcript(*waiting)


def _line(item: dict) -> str:
    """One Decision item as a line the model reads."""
    kind = item.get("type") or "message"
    if kind == "message":
        content = item.get("content")
        text = content if isinstance(content, str) else parts_text(content)
        return f"{item.get('role', 'user')}: {text}"
    if kind.endswith("_output"):
        output = item.get("output")
        return f"tool result {item.get('call_id')}: {output if isinstance(output, str) else json.dumps(output)}"
    return f"tool call {item.get('name', '')}({item.get('arguments', item.get('input', ''))})"
