"""Responses delegation as GPT-Live shows it: each planner attempt is a delegation whose progress goes out as
`response.event`s (created, in progress, the answer, completed, or superseded), and the client's function
tools: a round's calls as the response's function_call items, their outputs handed back by `response.create`
(server/live/calls.py counts them), the attempt going on in a response of its own."""

from __future__ import annotations

import collections
import json
from collections.abc import Callable

from kame.commands import AddContext, RequestAttempt
from kame.session_events import LLMAttempt, ToolRound
from server.live.actions import AnswerCall
from server.live.calls import ClientCalls
from server.live.client_events import LiveError
from server.live.config import LiveConfig
from server.live.delegation import new_id
from server.live.outbox import LiveOutbox

MAX_ATTEMPTS = 256  # attempts remembered (their delegation and response ids)


class ResponsesEvents:
    def __init__(self, outbox: LiveOutbox, delegated: Callable[..., None], tool_timeout_s: float) -> None:
        self.outbox, self._delegated, self.tool_timeout_s = outbox, delegated, tool_timeout_s
        self._attempts: collections.OrderedDict[int, tuple[str, str]] = collections.OrderedDict()  # ids by epoch
        self.calls = ClientCalls()  # the client's function calls: announced, answered, ended
        self._config: LiveConfig | None = None

    def on_session(self, event: LLMAttempt | ToolRound, config: LiveConfig) -> None:
        self._config = config
        if isinstance(event, ToolRound):
            self._tool_round(event)
        else:
            self._attempt(event)

    def _attempt(self, event: LLMAttempt) -> None:
        """A planner attempt of responses delegation: a delegation, its progress as `response.event`."""
        if event.phase == "started":
            delegation_id, response_id = new_id("deleg"), new_id("resp")
            self._delegated(delegation_id, "responses", response_id)
            self._attempts[event.epoch] = (delegation_id, response_id)
            while len(self._attempts) > MAX_ATTEMPTS:
                self._attempts.popitem(last=False)
            self._response(event.epoch, "response.created", response=self._response_object(
                event.epoch, "in_progress", event.backend))
            return
        if event.epoch not in self._attempts:
            return
        if event.phase == "first_token":
            self._response(event.epoch, "response.in_progress",
                           response=self._response_object(event.epoch, "in_progress", event.backend))
        elif event.phase == "done":
            if event.answer:  # the answer's words reach the front-end as oracle updates; here, in one piece
                self._response(event.epoch, "response.output_text.delta", delta=event.answer, output_index=0,
                               content_index=0)
            self._response(event.epoch, "response.output_text.done", text=event.answer, output_index=0,
                           content_index=0)
            self._response(event.epoch, "response.completed", response=self._response_object(
                event.epoch, "completed", event.backend, event.answer))
        elif event.phase == "cancelled" and self.calls.waiting_in(event.epoch):  # its calls' response is over
            self.calls.forget_attempt(event.epoch)
        elif event.phase == "cancelled":  # superseded: routine in KAME (a newer attempt took over), not a
            # failure; clients (Pipecat) report response.incomplete/failed as errors, so it ends "completed"
            # with the status that says what happened
            self._response(event.epoch, "response.completed", response={
                **self._response_object(event.epoch, "cancelled", event.backend, event.answer),
                "incomplete_details": {"reason": "superseded"}})
        else:  # failed: the next attempt may still answer; the session goes on
            self._response(event.epoch, "response.failed", response={
                **self._response_object(event.epoch, "failed", event.backend),
                "error": {"code": event.error_kind or "server_error", "message": event.error or "failed"}})

    def _response_object(self, epoch: int, status: str, backend: str, text: str | None = None) -> dict:
        response = {"id": self._attempts[epoch][1], "object": "response", "status": status,
                    "model": self._config.responses.get("model") or backend}
        if text is not None:
            response["output"] = [{"type": "message", "role": "assistant", "status": "completed",
                                   "content": [{"type": "output_text", "text": text}]}] if text else []
        return response

    def _response(self, epoch: int, kind: str, **fields) -> None:
        self.outbox.emit("response.event", delegation_id=self._attempts[epoch][0], event={"type": kind, **fields})

    # ---------------------------------------------------------------- the client's function tools

    def _tool_round(self, event: ToolRound) -> None:
        """A round of the backend's tool calls: the client's functions among them come out as the response's
        function_call items, and the response completes, waiting for their outputs (`response.create`)."""
        mine = [(call_id, name, arguments) for call_id, name, arguments in event.calls
                if any(spec.name == name for spec in self._config.tools)]
        if not mine or event.epoch not in self._attempts:
            return
        for index, (call_id, name, arguments) in enumerate(mine):
            item = {"type": "function_call", "id": new_id("fc"), "call_id": call_id, "name": name,
                    "arguments": arguments, "status": "in_progress"}
            self._response(event.epoch, "response.output_item.added", output_index=index, item=item)
            self._response(event.epoch, "response.function_call_arguments.done", output_index=index,
                           item_id=item["id"], arguments=arguments)
            self._response(event.epoch, "response.output_item.done", output_index=index,
                           item={**item, "status": "completed"})
            self.calls.announce(call_id, event.epoch)
        self._response(event.epoch, "response.completed", response={
            **self._response_object(event.epoch, "completed", self._config.backend), "output": []})

    def call_ended(self, call_id: str, outcome: str, config: LiveConfig) -> None:
        """The backend stopped waiting for a call: "answered", "timeout" (an error event says so, and the attempt
        goes on without it) or "cancelled" (its attempt was superseded: a late output is taken quietly)."""
        self._config = config
        epoch = self.calls.end(call_id)
        if outcome != "timeout":
            return
        self.outbox.error(LiveError("function_call_output_timeout", f"No output came for function call {call_id} "
                                    f"within {self.tool_timeout_s:g} s: the backend answers without it.",
                                    kind="server_error"))
        if epoch is not None and epoch in self._attempts:
            self._continue(epoch)

    def item_create(self, item) -> None:
        if item.type == "function_call_output":
            self.calls.output(item.call_id, item.output if isinstance(item.output, str) else json.dumps(
                [part.model_dump(exclude_none=True) for part in item.output]))
        elif item.type == "message" and item.role in ("user", "system", "developer"):
            text = " ".join(part.text for part in item.content if hasattr(part, "text")) if not isinstance(
                item.content, str) else item.content
            self.outbox.call(AddContext("user" if item.role == "user" else "context", text))
        else:
            raise LiveError("unsupported_parameter", f"response.item.create takes function_call_output items and "
                            f"messages here, not {item.type!r}.", "item.type")

    def response_create(self, config: LiveConfig) -> None:
        """Continue the responses waiting for the outputs (all of them, or an error naming the missing), or, with
        none waiting, ask the backend for a response now."""
        self._config = config
        released = self.calls.release()
        if released is None:
            self.outbox.call(RequestAttempt())
            return
        answers, resumed = released
        for call_id, output in answers:
            self.outbox.call(AnswerCall(call_id, output))
        for epoch in resumed:
            if epoch in self._attempts:
                self._continue(epoch)

    def _continue(self, epoch: int) -> None:
        """The attempt goes on after its function calls: a response of its own, in the same delegation."""
        delegation_id, _ = self._attempts[epoch]
        self._attempts[epoch] = (delegation_id, new_id("resp"))
        self._response(epoch, "response.created", response=self._response_object(epoch, "in_progress",
                                                                                 self._config.backend))
