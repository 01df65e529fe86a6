"""`/v1/realtime`'s carrier: runs a `RealtimeMapping` over one tandem session.

It feeds the mapping the client's messages, the session's events and the clock, and carries out
what the mapping asks: server events onto the runner's queue (and into the recording), commands to
the session, and the client-function bridge (the LLM's call waits on a future that the client's
output resolves). A `DeadlineTimer` sleeps until the mapping's next deadline.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
from collections.abc import Coroutine

from kame.clock import wait_for
from kame.commands import SESSION_COMMANDS
from kame.session import TandemSession
from kame.session_events import SessionEvent
from kame.tools.base import ToolError, ToolLimits, ToolSpec
from kame.tools.client_tool import ClientTool
from server.deadline import DeadlineTimer
from server.realtime import actions as act
from server.realtime.client_events import RealtimeError
from server.realtime.config import SessionFacts
from server.realtime.mapping import RealtimeMapping
from server.runner import Ended, Message, SessionRunner

logger = logging.getLogger(__name__)

REPLAY_EVENTS = 64  # a call's recent server events a sideband gets when it attaches


def subprotocol(offered: list[str]) -> str | None:
    """Browsers cannot set headers: OpenAI's browser clients offer the "realtime" subprotocol (and their
    key as another one, which server/access.py reads)."""
    return "realtime" if "realtime" in offered else None


def realtime_facts(runner: SessionRunner, tandem: TandemSession) -> SessionFacts:
    settings, runtime = runner.settings, runner.services.runtime
    whisper = settings.whisper
    server_vad = {"type": "server_vad", "threshold": whisper.vad_threshold, "prefix_padding_ms": 300,
                  "silence_duration_ms": int(whisper.min_silence_s * 1000), "create_response": True,
                  "interrupt_response": True, "idle_timeout_ms": None}
    return SessionFacts(runner.id, runtime.frontend.source, runtime.asr.name, tuple(runtime.profiles),
                        tandem.backend, tandem.system_prompt, server_vad, settings.realtime,
                        settings.max_message_bytes * 4 // 3 + 4096,  # base64 audio of the binary limit
                        settings.echo_options())


class RealtimeCarrier:
    """`/v1/realtime`'s session; with `to_client=False`, a SIP call's (server/phone/sessions.py): its events go to
    the call's sidebands (`/v1/realtime?call_id=`) and the recording, the caller's line carries audio only."""

    def __init__(self, runner: SessionRunner, tandem: TandemSession, model: str, beta: bool, *,
                 to_client: bool = True) -> None:
        self.runner, self.tandem, self.clock = runner, tandem, runner.clock
        self.mapping = RealtimeMapping(realtime_facts(runner, tandem), model, beta, self.clock.now())
        self.to_client = to_client
        self.sidebands: set = set()  # server/live/sideband.py's Sidebands watching a call's session
        self.replay: collections.deque[dict] = collections.deque(maxlen=REPLAY_EVENTS)  # for one attaching
        self._created: dict | None = None  # the call's session.created ...
        self._snapshot: dict | None = None  # ... and its latest session.updated
        self._calls: dict[str, asyncio.Future[str]] = {}  # function calls waiting for the client's output
        self._timer = DeadlineTimer(self.clock, self.mapping.wake_at, self._on_time, f"session {runner.id}")

    async def greet(self) -> None:
        self.mapping.greet()
        self.carry_out()

    async def on_message(self, message: Message) -> None:
        try:
            self.mapping.on_client(message if isinstance(message, str) else None, self.clock.now())
        finally:
            self.carry_out()

    def refuse(self, exc: Exception) -> None:
        self.mapping.refuse(exc)
        self.carry_out()

    def report(self, code: str, message: str) -> None:
        self.mapping.outbox.error(code, message)
        self.carry_out()

    async def on_event(self, event: SessionEvent) -> None:
        self.mapping.on_session(event, self.clock.now())
        self.carry_out()

    def tasks(self) -> list[Coroutine]:
        return [self._timer.run()]

    async def aclose(self) -> None:
        for sideband in list(self.sidebands):
            sideband.end()

    # ---------------------------------------------------------------- a call's sidebands

    def replayed(self) -> list[dict]:
        """What a sideband gets on attaching: the session's session.created and latest session.updated, even
        when they are older than the recent events, then those."""
        recent = list(self.replay)
        older = [event for event in (self._created, self._snapshot) if event is not None and event not in recent]
        return [*older, *recent]

    def steer(self, text: str | None, sideband) -> None:
        """A sideband's event: it acts on the session as a client's would (the caller's line is the input
        audio: a sideband appends none); an error goes to it alone."""
        try:
            kind, event_id = _event_type(text, self.mapping.facts.max_event_bytes)
            if kind == "input_audio_buffer.append":
                raise RealtimeError("invalid_request", "a call's sideband sends no audio: the caller's line is "
                                    "the session's input", "type", event_id if isinstance(event_id, str) else None)
            self.mapping.on_client(text, self.clock.now())
        except RealtimeError as exc:
            self.refuse_to(sideband, exc)
            return
        self.carry_out()

    def refuse_to(self, sideband, exc: RealtimeError) -> None:
        """A sideband's event refused: its error to that sideband alone (what the session had to send before
        it is everyone's)."""
        self.carry_out()
        self.mapping.refuse(exc)
        for action in self.mapping.take():
            if isinstance(action, act.Send):
                sideband.put(action.event, False)

    def _on_time(self, now: float) -> None:
        self.mapping.on_time(now)
        self.carry_out()

    # ---------------------------------------------------------------- carrying out

    def carry_out(self) -> None:
        tandem = self.tandem
        for action in self.mapping.take():
            match action:
                case act.Send(event=event, droppable=droppable):
                    if not droppable:
                        self.runner.record({"realtime": event})
                    if self.to_client:
                        self.runner.send(json.dumps(event), droppable)
                    self._reflect(event, droppable)
                case command if isinstance(command, SESSION_COMMANDS):
                    tandem.apply(command)
                case act.Flush(token=token):
                    self.runner.spawn(self._flush(token), "flush")
                case act.SetClientTools(specs=specs, timeout_s=timeout_s):
                    self._set_tools(tandem, specs, timeout_s)
                case act.AnswerCall(call_id=call_id, output=output):
                    waiting = self._calls.get(call_id)
                    if waiting is not None and not waiting.done():
                        waiting.set_result(output)
                case act.End(reason=reason):
                    raise Ended(reason)
        self._timer.nearer()

    def _reflect(self, event: dict, droppable: bool) -> None:
        if self.to_client:
            return  # a socket's own session: no sideband attaches to it
        if not droppable:
            self.replay.append(event)
            if event["type"] == "session.created":
                self._created = event
            elif event["type"] == "session.updated":
                self._snapshot = event
        for sideband in self.sidebands:
            sideband.put(event, droppable)

    def _set_tools(self, tandem: TandemSession, specs: tuple[ToolSpec, ...], timeout_s: float) -> None:
        tools = [ClientTool(spec, ToolLimits(timeout_s, 8000), self._send_call) for spec in specs]
        tandem.set_client_tools(tools)
        if tools and not tandem.tools_on:  # no error event: frameworks end their session on one
            logger.info("session %s: %d tools stored; backend %s calls no tools, so it answers without them",
                        self.runner.id, len(tools), tandem.backend)

    async def _flush(self, token: str) -> None:
        await self.tandem.flush()
        self.mapping.on_flushed(token, self.clock.now())
        self.carry_out()

    # ---------------------------------------------------------------- client functions

    async def _send_call(self, context, name: str, arguments: dict) -> str:
        return await self.call_client_function(name, arguments)

    async def call_client_function(self, name: str, arguments: dict) -> str:
        """The backend LLM calls the client's function `name`: send the call, wait for the client's
        function_call_output at most `tool_timeout_s` (then a ToolError, which the LLM reads)."""
        call_id = self.mapping.function_call(name, arguments, self.clock.now())
        self.carry_out()
        waiting = self._calls[call_id] = asyncio.get_running_loop().create_future()
        answered = False
        timeout_s = self.runner.settings.realtime.tool_timeout_s
        try:
            output = await wait_for(self.clock, waiting, timeout_s)
            answered = True
            return output
        except TimeoutError:
            raise ToolError(f"the client did not answer {name} within {timeout_s:g} s") from None
        finally:
            self._calls.pop(call_id, None)
            self.mapping.call_ended(call_id, answered)


def _event_type(text: str | None, limit_bytes: int) -> tuple[object, object]:
    """A sideband event's `type` and `event_id` (None where it has none, or is over the limit: the mapping
    refuses it as usual)."""
    if text is not None and len(text) <= limit_bytes:
        with contextlib.suppress(ValueError, TypeError, AttributeError, RecursionError):
            event = json.loads(text)
            return event.get("type"), event.get("event_id")
    return None, None
