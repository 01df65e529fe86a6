"""`/v1/live/sessions`' carrier, over a WebSocket or a WebRTC peer: runs a `LiveMapping` over one
tandem session.

It feeds the mapping the client's messages (and, over WebRTC, the user's audio from the track), the
session's events and the clock, and carries out what the mapping asks: server events onto the runner's
queue (and into the recording), commands to the session, client delegation (`delegation.ClientBackend`
as the session's LLM), the client's function calls, Decisions, and what sidebands see. A
`DeadlineTimer` sleeps until the mapping's next deadline (fed silence, usage reports).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import json
import logging
import time
from collections.abc import Coroutine

import numpy as np

from kame.audio import FRAME_S
from kame.backend.decide import decide
from kame.backend.llm import LLMError
from kame.clock import wait_for
from kame.commands import SESSION_COMMANDS, RequestAttempt, UseLLM
from kame.pcm import pcm16_encode
from kame.protocol import ProtocolError
from kame.session import TandemSession
from kame.session_events import AssistantAudio, SessionEvent
from kame.tools.base import ToolContext, ToolError, ToolLimits
from kame.tools.client_tool import ClientTool
from server.deadline import DeadlineTimer
from server.live import actions as act
from server.live.client_events import LiveError
from server.live.config import LiveFacts
from server.live.delegation import ClientBackend
from server.live.mapping import LiveMapping
from server.live.standby import SpeechDetector
from server.runner import Finished, Message, SessionRunner

logger = logging.getLogger(__name__)

REPLAY_EVENTS = 64  # the recent server events a sideband gets when it attaches (audio aside)
CLIENT_OUTPUT_CHARS = 8000  # of a client function's output, what the backend LLM reads


def _pcm16(pcm) -> str:
    return base64.b64encode(pcm16_encode(pcm)).decode()


def live_facts(runner: SessionRunner, tandem: TandemSession, transport: str, events: bool) -> LiveFacts:
    """What a Live mapping knows of this server and of its tandem session."""
    settings, runtime = runner.settings, runner.services.runtime
    return LiveFacts(runner.id, {name: profile.model for name, profile in runtime.profiles.items()},
                     tandem.backend, tandem.system_prompt,
                     settings.max_message_bytes * 4 // 3 + 4096,  # base64 audio of the binary limit
                     int(time.time() + settings.max_session_s), transport, events,
                     echo=settings.echo_options(), tool_timeout_s=settings.realtime.tool_timeout_s,
                     zero_silence_s=settings.realtime.live_zero_silence_s)


class LiveCarrier:
    """Runs a Live mapping on a tandem session, whatever the link: server events to the runner's queue
    (those the data channel's `permissions` let through), the assistant's audio to `play` where a media
    track carries it, the user's audio from one (`hear`), commands to the session, client delegation and
    function calls, Decisions, and the sidebands watching."""

    def __init__(self, runner: SessionRunner, tandem: TandemSession, mapping: LiveMapping, play=None,
                 permissions=None, vad_session=None) -> None:
        self.runner, self.mapping, self.tandem, self.clock = runner, mapping, tandem, runner.clock
        self._play, self.permissions, self._vad_session = play, permissions, vad_session
        self._detector: SpeechDetector | None = None  # listening for the wake, while paused
        self.backend: ClientBackend | None = None
        self.timer = DeadlineTimer(self.clock, mapping.wake_at, self._on_time,
                                   f"live session {mapping.facts.session_id}")
        self.replay: collections.deque[dict] = collections.deque(maxlen=REPLAY_EVENTS)  # for a sideband attaching
        self.sidebands: set = set()  # `sideband.Sideband`s watching this session
        self._snapshot: dict | None = None  # the latest session.started or .updated
        self._calls: dict[str, asyncio.Future[str]] = {}  # the client's function calls, by call_id
        self._tasks: set[asyncio.Task] = set()  # decisions being made
        self.finished: asyncio.Future[tuple[int, str]] = asyncio.get_running_loop().create_future()

    # ---------------------------------------------------------------- the runner's side

    async def greet(self) -> None:
        """Nothing: the client speaks first (session.start), or the POST started the mapping (WebRTC)."""

    async def on_message(self, message: Message) -> None:
        text = message if isinstance(message, str) else None
        oversized = text is not None and len(text) > self.mapping.facts.max_event_bytes  # the mapping refuses it unread
        if self.permissions is not None and not oversized and not self.permissions.may_send(kind := _event_type(text)):
            raise LiveError("event_not_allowed", f"{kind} is not among this data channel's allowed client events "
                            "(session.client.data_channel.allowed_client_events).", "type")
        try:
            self.mapping.on_client(text, self.clock.now())
        finally:
            self.carry_out()

    def refuse(self, exc: Exception) -> None:
        self.mapping.refuse(exc)
        self.carry_out()

    def report(self, code: str, message: str) -> None:
        """A limit or the server's shutdown ends the session: an error, then session.closed."""
        self.mapping.refuse(LiveError(code, message, kind="server_error"))
        self.mapping.close("expired" if "limit" in message else "connection_lost", self.clock.now())
        self.carry_out(finish=False)  # the session is ending already

    async def on_event(self, event: SessionEvent) -> None:
        self.mapping.on_session(event, self.clock.now())
        self.observe(event)
        self.carry_out()

    def tasks(self) -> list[Coroutine]:
        return [self.timer.run(), self._finished()]

    async def _finished(self) -> None:
        """A sideband closed the session: it ends here, in the session's own tasks."""
        raise Finished(*await self.finished)

    async def aclose(self) -> None:
        for task in list(self._tasks):  # decisions still being made: nobody will hear them
            task.cancel()
        for sideband in list(self.sidebands):
            sideband.end()

    def hear(self, pcm: np.ndarray) -> None:
        """The user's audio from a media track; while the session is paused, Silero listens for the wake."""
        if not self.mapping.paused:
            self._detector = None
            self.mapping.on_audio(pcm)
        else:
            if self._detector is None:
                self._detector = SpeechDetector(self._vad_session, self.mapping.standby.vad_threshold)
            self.mapping.on_audio(pcm)  # kept for the wake
            if self._detector(pcm):
                self.mapping.wake(self.clock.now())
        self.carry_out()

    def steer(self, text: str | None, sideband) -> None:
        """A sideband's event: it acts on the session as the client's would; its errors go to it alone."""
        try:
            self.mapping.on_client(text, self.clock.now(), sideband=True)
        except ProtocolError as exc:
            if not isinstance(exc, LiveError):
                exc = LiveError("invalid_request", str(exc))
            sideband.put(self.mapping.outbox.error_event(exc), False)
        finally:
            self.carry_out(finish=False)

    def send_event(self, event: dict, droppable: bool) -> None:
        """A server event for the client (where the data channel's permissions let it through)."""
        if self.permissions is None or self.permissions.may_get(event):
            self.runner.send(json.dumps(event), droppable)

    # ---------------------------------------------------------------- carrying out

    def _on_time(self, now: float) -> None:
        self.mapping.on_time(now)
        self.carry_out()

    def carry_out(self, finish: bool = True) -> None:
        """Every action the mapping asked for since the last time; `finish`: a Finish raises
        `Finished` (the session ends), else it is left to whoever ends the session."""
        tandem = self.tandem
        for action in self.mapping.take():
            match action:
                case act.Send(event=event, droppable=droppable):
                    if not droppable:  # audio deltas reach sidebands from `observe`, timed and as PCM16
                        self._reflect(event)
                    if not droppable:
                        self.runner.record({"live": event})
                    if event["type"] == "session.delegation.created":
                        self.runner.services.metrics.delegations.labels(event["delegation"]["target"]).inc()
                    self.send_event(event, droppable)
                case command if isinstance(command, SESSION_COMMANDS):
                    tandem.apply(command)
                case act.Heard(pcm=pcm):
                    if self.sidebands:  # the user's audio as it came: before muting, paused or not (no fed silence)
                        self._reflect({"type": "session.input_audio.append", "audio": _pcm16(pcm)}, True)
                case act.Delegate():
                    self.backend = ClientBackend(self.clock, self._delegated)
                    tandem.apply(UseLLM(self.backend))
                case act.ClientTools(specs=specs, tool_choice=tool_choice):
                    limits = ToolLimits(self.mapping.facts.tool_timeout_s, CLIENT_OUTPUT_CHARS)
                    tandem.set_client_tools([ClientTool(spec, limits, self._send_call, shared=False) for spec in specs],
                                            tool_choice)
                case act.AnswerCall(call_id=call_id, output=output):
                    waiting = self._calls.get(call_id)
                    if waiting is not None and not waiting.done():
                        waiting.set_result(output)
                case act.Decide():
                    self._spawn(self._decide(action), "decide")
                case act.Commentary(delegation_id=delegation_id, text=text):
                    if not self.backend.commentary(delegation_id, text):
                        tandem.apply(RequestAttempt())  # no delegation open: one starts with it
                case act.Play(pcm=pcm, frame=frame):
                    if self._play is not None:
                        self._play(pcm, frame)
                case act.Finish(code=code, reason=reason):
                    if finish:
                        raise Finished(code, reason)
                    if not self.finished.done():  # asked from a sideband: the session's own task ends it
                        self.finished.set_result((code, reason))
        self.timer.nearer()

    async def _send_call(self, context: ToolContext | None, name: str, arguments: dict) -> str:
        """A client function tool's call (the mapping announced it from the backend's round): wait for its
        output, which `response.create` releases, at most `tool_timeout_s`."""
        if context is None:
            raise ToolError(f"{name} was called outside an attempt's round")
        call_id = context.call.id
        waiting = self._calls[call_id] = asyncio.get_running_loop().create_future()
        outcome = "cancelled"
        try:
            output = await wait_for(self.clock, waiting, self.mapping.facts.tool_timeout_s)
            outcome = "answered"
            return output
        except TimeoutError:
            outcome = "timeout"
            raise ToolError(f"the client did not answer {name} within {self.mapping.facts.tool_timeout_s:g} s") \
                from None
        finally:
            self._calls.pop(call_id, None)
            self.mapping.call_ended(call_id, outcome)
            self.carry_out(finish=False)

    async def _decide(self, action: act.Decide) -> None:
        """One evaluation of Decision questions with the session's backend profile (the mapping's `decided`
        sends it); a failure is an error event, never the session's end."""
        runtime = self.tandem.runtime
        try:
            profile = runtime.profile_named(action.profile) if action.profile is not None else self.tandem.backend
            decision = await decide(runtime.llm(profile), runtime.profiles[profile].model, list(action.questions),
                                    self.tandem.conversation, list(action.inputs))
        except LLMError as exc:
            self.mapping.decided(action, None, str(exc))
        except Exception:  # our bug or the model's odd answer: an error event, the session goes on
            logger.exception("session %s: a decision failed", self.mapping.facts.session_id)
            self.mapping.decided(action, None, "its evaluation failed on the server")
        else:
            self.mapping.decided(action, decision)
        self.carry_out(finish=False)

    def _spawn(self, coro, name: str) -> None:
        """A task of this session's, kept until it ends (a decision outlives the call that asked for it)."""
        task = asyncio.get_running_loop().create_task(coro, name=f"live-{self.mapping.facts.session_id}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def observe(self, event: SessionEvent) -> None:
        """The session's audio for sidebands: the assistant's frames, timed on the session's timeline."""
        if self.sidebands and isinstance(event, AssistantAudio):
            start = round(event.frame * FRAME_S * 1000)
            self._reflect(self.mapping.outbox.event("session.output_audio.delta", delta=_pcm16(event.pcm),
                                                    start_ms=start, end_ms=start + round(FRAME_S * 1000)), True)

    def replayed(self) -> list[dict]:
        """What a sideband gets on attaching: the session's latest snapshot (session.started or
        .updated) even when it is older than the recent events, then those."""
        recent = list(self.replay)
        return recent if self._snapshot is None or self._snapshot in recent else [self._snapshot, *recent]

    def _reflect(self, event: dict, droppable: bool = False) -> None:
        if not droppable:
            self.replay.append(event)
            if event["type"] in ("session.started", "session.updated"):
                self._snapshot = event
        for sideband in self.sidebands:
            sideband.put(event, droppable)

    def _delegated(self, delegation_id: str) -> None:
        self.mapping.delegated(delegation_id)
        self.carry_out()


def _event_type(text: str | None) -> object:
    """A data channel message's `type`, for the permission check (None when it has none: the
    mapping refuses such a message as usual)."""
    with contextlib.suppress(ValueError, TypeError, AttributeError, RecursionError):
        return json.loads(text).get("type")
    return None
