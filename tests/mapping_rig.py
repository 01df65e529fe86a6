"""What the Realtime and GPT-Live mapping tests share: the actions a pure mapping queued, split into
the events the wire would carry (through JSON, as sent) and the calls it asked of the session."""

from __future__ import annotations

import json


class ActionLog:
    """`mapping.take()`'s actions: `events()` the sent ones since the last look, `calls` the rest.
    `send_type` is the mapping's Send action; `check(event)` may validate each event as sent."""

    def __init__(self, mapping, send_type: type) -> None:
        self.mapping, self._send_type = mapping, send_type
        self.calls: list = []
        self._sent: list[dict] = []

    def check(self, event: dict) -> None:
        """Each sent event once it went through JSON; nothing by default."""

    def _collect(self) -> None:
        for action in self.mapping.take():
            if isinstance(action, self._send_type):
                event = json.loads(json.dumps(action.event))  # what the wire carries
                self.check(event)
                self._sent.append(event)
            else:
                self.calls.append(action)

    def events(self) -> list[dict]:
        self._collect()
        sent, self._sent = self._sent, []
        return sent


def bare_runner(clock, transport: str = "live"):
    """A real `SessionRunner` with no link, no engine and default settings: what a carrier queues for the
    client waits in `runner.outbox` (`sent(runner)` reads it)."""
    from types import SimpleNamespace

    from server.metrics import Metrics
    from server.runner import SessionRunner
    from server.settings import ServerSettings

    return SessionRunner(SimpleNamespace(settings=ServerSettings(), metrics=Metrics()), None, transport, clock)


def sent(runner) -> list[dict]:
    """The JSON messages the runner has queued for the client, taken from its queue."""
    return [json.loads(runner.outbox.get_nowait()) for _ in range(len(runner.outbox))]
