"""A GPT-Live client's function calls under Responses delegation, as the protocol counts them: a call is
announced in its response's items, its output comes in one `response.item.create`, and one `response.create`
hands every output of an attempt's round to the backend at once (rounds not whole keep waiting; a
`response.create` that continues nothing is refused: `function_call_outputs_required`). Every call announced
is one the backend waits for (GPT-Live's client tools are not shared through the per-turn cache), and ends
with `end` (answered, timed out, or its attempt superseded); a call ended takes a late output quietly."""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

from server.live.client_events import LiveError

logger = logging.getLogger(__name__)

MAX_ENDED = 256  # ended calls remembered, so that a late output is not an error


@dataclass
class _Call:
    epoch: int  # the planner's attempt that made it
    output: str | None = None


class ClientCalls:
    def __init__(self) -> None:
        self._waiting: dict[str, _Call] = {}
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._late = 0  # outputs for ended calls since the last response.create

    def announce(self, call_id: str, epoch: int) -> None:
        self._waiting[call_id] = _Call(epoch)

    def waiting_in(self, epoch: int) -> bool:
        return any(call.epoch == epoch for call in self._waiting.values())

    def output(self, call_id: str, text: str) -> None:
        """The client's output for `call_id` (one per call); LiveError for a call nobody waits for."""
        call = self._waiting.get(call_id)
        if call is not None:
            if call.output is not None:
                raise LiveError("invalid_value", f"Function call {call_id!r} has its output already.", "item.call_id")
            call.output = text
        elif call_id in self._ended:
            logger.info("the output of function call %s came after the backend stopped waiting for it: not used",
                        call_id)
            self._late += 1
        else:
            raise LiveError("invalid_value", f"No function call {call_id!r} is waiting for its output.",
                            "item.call_id")

    def release(self) -> tuple[list[tuple[str, str]], list[int]] | None:
        """`response.create`: the (call_id, output) of every attempt whose round has all its outputs, and those
        attempts, to resume; ([], []) when nothing is ready but outputs came (late ones: nothing to do); None
        when nothing waits at all (a response is asked for). The protocol's batch is one response's calls, an
        attempt's round here; KAME may run a newer attempt while the client answers an older one, so a
        `response.create` continues the rounds that are whole and the others keep waiting (the client answers
        them as it sees them, a newer round's items may have crossed its `response.create` on the wire; each
        call times out on its own). Only a `response.create` that continues nothing is refused: LiveError
        `function_call_outputs_required`, naming the missing calls of the rounds partly answered (of every
        round where none is)."""
        late, self._late = self._late, 0
        if not self._waiting:
            return ([], []) if late else None
        rounds: dict[int, list[tuple[str, _Call]]] = {}
        for call_id, call in self._waiting.items():
            rounds.setdefault(call.epoch, []).append((call_id, call))
        ready = sorted(epoch for epoch, calls in rounds.items() if all(call.output is not None for _, call in calls))
        if not ready and not late:
            partial = [call_id for calls in rounds.values() if any(call.output is not None for _, call in calls)
                       for call_id, call in calls if call.output is None]
            raise LiveError("function_call_outputs_required", "Every pending function call needs its "
                            f"function_call_output before response.create; missing: "
                            f"{', '.join(partial or self._waiting)}.", "type")
        answers = [(call_id, call.output) for epoch in ready for call_id, call in rounds[epoch]]
        for call_id, _ in answers:
            del self._waiting[call_id]
        return answers, ready

    def end(self, call_id: str) -> int | None:
        """The backend stopped waiting for `call_id` (answered, timed out or cancelled): the attempt it belonged
        to when it was the attempt's last waiting call, else None."""
        call = self._waiting.pop(call_id, None)
        self._remember(call_id, call)
        if call is None or self.waiting_in(call.epoch):
            return None
        return call.epoch

    def forget_attempt(self, epoch: int) -> None:
        """A superseded attempt's calls end with it."""
        for call_id in [c for c, call in self._waiting.items() if call.epoch == epoch]:
            self._remember(call_id, self._waiting.pop(call_id))

    def _remember(self, call_id: str, call: _Call | None = None) -> None:
        if call is not None and call.output is not None:  # its output came and is not used: a late one, so
            self._late += 1  # the client's response.create after it is no error
        self._ended[call_id] = None
        while len(self._ended) > MAX_ENDED:
            self._ended.popitem(last=False)
