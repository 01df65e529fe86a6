"""A GPT-Live client's function calls under Responses delegation, as the protocol counts them: a call is
announced in its response's items, its output comes in one `response.item.create`, and one `response.create`
hands every output of an attempt's round to the backend at once (a partial round is refused:
`function_call_outputs_required`; a newer attempt's round the client may not have seen yet waits). A call the
backend stopped waiting for (timed out, or its attempt superseded) takes a late output quietly."""

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
        """`response.create`: the (call_id, output) of every attempt whose calls all have their outputs, and
        those attempts, to resume; ([], []) when nothing is ready but outputs came (late ones: nothing to do);
        None when nothing waits at all (a response is asked for). The protocol's batch is an attempt's round:
        an attempt with some outputs and not all is a partial batch, and LiveError
        `function_call_outputs_required` names its missing calls (nothing is released). An attempt none of
        whose calls has an output keeps waiting when something else was answered: its round may have crossed
        the client's `response.create` on the wire (KAME runs a newer attempt while the client answers an
        older one); the client answers it when it sees it, or the call times out. With nothing ready and no
        output at all, the `response.create` is early: the same error, naming every waiting call."""
        late, self._late = self._late, 0
        if not self._waiting:
            return ([], []) if late else None
        rounds: dict[int, list[tuple[str, _Call]]] = {}
        for call_id, call in self._waiting.items():
            rounds.setdefault(call.epoch, []).append((call_id, call))
        partial = [call_id for calls in rounds.values() if any(call.output is not None for _, call in calls)
                   for call_id, call in calls if call.output is None]
        ready = sorted(epoch for epoch, calls in rounds.items() if all(call.output is not None for _, call in calls))
        if partial or not (ready or late):
            missing = partial or list(self._waiting)
            raise LiveError("function_call_outputs_required", "Every pending function call needs its "
                            f"function_call_output before response.create; missing: {', '.join(missing)}.", "type")
        answers = [(call_id, call.output) for epoch in ready for call_id, call in rounds[epoch]]
        for call_id, _ in answers:
            del self._waiting[call_id]
        return answers, ready

    def end(self, call_id: str) -> int | None:
        """The backend stopped waiting for `call_id` (answered, timed out or cancelled): the attempt it belonged
        to when it was the attempt's last waiting call, else None."""
        call = self._waiting.pop(call_id, None)
        self._remember(call_id)
        if call is None or self.waiting_in(call.epoch):
            return None
        return call.epoch

    def forget_attempt(self, epoch: int) -> None:
        """A superseded attempt's calls end with it."""
        for call_id in [c for c, call in self._waiting.items() if call.epoch == epoch]:
            del self._waiting[call_id]
            self._remember(call_id)

    def _remember(self, call_id: str) -> None:
        self._ended[call_id] = None
        while len(self._ended) > MAX_ENDED:
            self._ended.popitem(last=False)
