"""One session on one link: the runner every transport shares.

A session is three parts. The *link* only moves messages (a WebSocket; a WebRTC data channel, with
the audio on its tracks: `Link`). The *carrier* is the protocol: it feeds a pure mapping the client's
messages, the session's events and the time, and carries out what the mapping asks (messages for
the link, typed commands for the tandem session: `Carrier`). The *runner* (`SessionRunner`) owns
what is the same for every protocol: the engine slot and its observers (metrics, the recorder), the
one writer to the link, the limits (idle, unread, session length) on the session's clock, the flood
counter, the server's shutdown and closing. Its tasks run in one TaskGroup: a bug ends this session
only, with a trace in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Coroutine
from typing import Protocol

from starlette.websockets import WebSocketDisconnect
from websockets.exceptions import ConnectionClosed

from kame.clock import Clock, MonotonicClock
from kame.errors import SessionError
from kame.protocol import ProtocolError
from kame.queues import DropOldestQueue
from kame.session import SessionConfig, TandemSession
from kame.session_events import AssistantAudio, SessionEvent
from server.deadline import DeadlineTimer
from server.metrics import SessionMetrics
from server.recorder import SessionRecorder
from server.services import Services

logger = logging.getLogger(__name__)

CLOSED = (RuntimeError, OSError, WebSocketDisconnect, ConnectionClosed)
CLOSE_LIMIT_S = 5.0  # a connection still closing after this is left to finish alone: the slot goes back
FLUSH_LIMIT_S = 1.0  # for the last messages (an error, session.closed) before the link closes

Message = str | bytes


class Disconnected(Exception):
    """The client went away."""


class Ended(Exception):
    """The tandem session ended (an engine failure): args: (reason,)."""


class Finished(Exception):
    """The protocol ended the session normally (the client asked): args: (close code, reason)."""


class Limit(Exception):
    """A limit ended the session; args: (close code, reason[, error code: "limit" by default])."""


class Link(Protocol):
    """Sends and receives a session's messages; knows nothing of the protocol."""

    idle_limited: bool  # False: the client may send no message for long (its audio comes another way)
    unopened: str  # why a link that never opens is closed ("no data channel ...")

    async def opened(self) -> None:
        """Returns once messages can be sent (at once for a WebSocket)."""

    async def receive(self) -> Message:
        """The client's next message; Disconnected when it has gone; ProtocolError for one it dropped
        unread (a WebRTC data channel's message past the announced size)."""

    async def send(self, message: Message) -> None:
        """Disconnected when the client has gone."""

    async def flush(self, messages: list[Message]) -> None:
        """The last messages, before closing (the runner bounds the time it takes)."""

    async def close(self, code: int, reason: str) -> None:
        """Close the connection (the runner bounds the time it takes)."""

    def tasks(self) -> list[Coroutine]:
        """The link's own tasks, run beside the session's (a media track's reader)."""


class Carrier(Protocol):
    """A protocol over one tandem session: messages, events and time in; messages and commands out."""

    async def greet(self) -> None:
        """Before anything else, once the session runs."""

    async def on_message(self, message: Message) -> None:
        """One client message; ProtocolError/SessionError for a bad one: `refuse`d, the session goes on."""

    def refuse(self, exc: Exception) -> None:
        """Tell the client what was wrong with its message."""

    async def on_event(self, event: SessionEvent) -> None:
        """One event of the tandem session; Ended/Finished end the session."""

    def report(self, code: str, message: str) -> None:
        """Tell the client the session is ending (a limit, the server's shutdown)."""

    def tasks(self) -> list[Coroutine]:
        """The protocol's own tasks (its deadline timer)."""

    async def aclose(self) -> None:
        """After the session: what the protocol holds (codec streams, watchers) goes."""


class SessionRunner:
    def __init__(self, services: Services, link: Link, transport: str, clock: Clock | None = None) -> None:
        self.services, self.link, self.transport = services, link, transport
        self.settings = services.settings
        self.clock = clock or MonotonicClock()  # the session's, the planner's, the recorder's, the limits'
        self.id = uuid.uuid4().hex[:12]
        self.outbox: DropOldestQueue[Message] = DropOldestQueue(self.settings.send_queue_messages)
        self.carrier: Carrier | None = None
        self.ended = asyncio.Event()
        self.closing = False  # the session's end has begun
        self._recorder: SessionRecorder | None = None
        self._dropped_out = 0
        self._stop: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._group: asyncio.TaskGroup | None = None
        self._started = self._last_message = self.clock.now()
        self._opened = False
        self._sending_since: float | None = None
        settings = self.settings
        self._reasons = {  # each limit's Limit args
            "length": (1000, f"the session reached its {settings.max_session_s:.0f} s limit"),
            "idle": (1001, f"no message for {settings.idle_timeout_s:.0f} s", "limit"),
            "unread": (1008, f"the client has not read for {settings.send_timeout_s:.0f} s")}
        self._watchdog = DeadlineTimer(self.clock, self._next_limit, self._check_limits, f"session {self.id} limits")

    # ---------------------------------------------------------------- what carriers use

    def send(self, message: Message, droppable: bool = False) -> None:
        """Queue a message for the client (droppable ones go first when it reads too slowly)."""
        self.outbox.put(message, droppable)

    @property
    def recording(self) -> bool:
        return self._recorder is not None

    def record(self, event: dict) -> None:
        if self._recorder is not None:
            self._recorder.write_event(event)

    def spawn(self, coro: Coroutine, name: str) -> None:
        """A task of this session, in its TaskGroup (a failure in it ends the session, logged)."""
        try:
            if self._group is None:
                raise RuntimeError("the session has ended")
            self._group.create_task(coro, name=f"{self.transport}-{self.id}-{name}")
        except RuntimeError:  # ended, or ending: nothing more is started
            coro.close()

    # ---------------------------------------------------------------- lifecycle

    async def open(self, config: SessionConfig, asr: bool = True) -> TandemSession:
        """Take an engine slot for this session (SlotsBusy, SessionError)."""
        runtime = self.services.runtime
        tool_names = frozenset(tool.spec.name for tool in runtime.session_tools())
        observers = [SessionMetrics(self.services.metrics, tool_names)]
        if self.settings.record_dir is not None:
            self._recorder = SessionRecorder(self.settings.record_dir, self.id, self.clock, {
                "frontend": runtime.frontend.source, "asr": runtime.asr.name if asr else "none",
                "backend": config.backend or runtime.default_profile, "oracle_delay_s": config.oracle_delay_s,
                "transport": self.transport})
            observers.append(self._recorder)
        try:
            return await TandemSession.open(runtime, config, observers, session_id=self.id, clock=self.clock)
        except BaseException:
            await self.discard_recording()
            raise

    async def discard_recording(self) -> None:
        """The session does not happen after all: leave no recording behind."""
        if self._recorder is not None:
            recorder, self._recorder = self._recorder, None
            await asyncio.to_thread(recorder.discard)

    def shutdown(self, reason: str) -> None:
        """The server is stopping: tell the client and end the session (through its own tasks)."""
        if not self._stop.done():
            self._stop.set_result(reason)

    async def run(self, tandem: TandemSession, carrier: Carrier) -> None:
        """Serve the session until the client goes, the protocol or a limit ends it, or the engine fails."""
        self.carrier = carrier
        metrics = self.services.metrics
        metrics.sessions_total.inc()
        metrics.transport_sessions.labels(self.transport).inc()
        metrics.active_sessions.inc()
        self._started = self._last_message = self.clock.now()
        try:
            async with asyncio.TaskGroup() as tasks:
                self._group = tasks
                await carrier.greet()
                for task in (self._receive(carrier), self._forward(tandem, carrier), self._sender(),
                             self._watchdog.run(), self._shutdown(), *carrier.tasks(), *self.link.tasks()):
                    tasks.create_task(task, name=f"{self.transport}-{self.id}-{task.__name__}")
        except* Disconnected:
            logger.info("session %s: client disconnected", self.id)
        except* Limit as group:
            code, reason, *error = group.exceptions[0].args
            logger.info("session %s closed: %s", self.id, reason)
            carrier.report(error[0] if error else "limit", reason)
            await self._flush_then_close(code, reason)
        except* Ended as group:
            await self._flush_then_close(1011, group.exceptions[0].args[0])
        except* Finished as group:
            await self._flush_then_close(*group.exceptions[0].args)
        except* Exception:  # a bug must end this session only, with a trace in the log
            logger.exception("session %s failed", self.id)
            await self._hang_up(1011, "internal error")
        finally:
            self._group = None
            self.closing = True  # a sideband attaching from now on is ended at once
            await tandem.aclose()
            await carrier.aclose()
            metrics.active_sessions.dec()
            if self._recorder is not None:
                await asyncio.to_thread(self._recorder.close)
            self.ended.set()

    # ---------------------------------------------------------------- tasks

    async def _receive(self, carrier: Carrier) -> None:
        flood = _Flood(self.settings.max_messages_per_s, self.clock)
        while True:
            try:
                message = await self.link.receive()  # (ProtocolError: one the link refused unread)
                self._last_message = self.clock.now()
                if flood.over():
                    raise Limit(1008, f"more than {self.settings.max_messages_per_s:.0f} messages/s for 5 s")
                await carrier.on_message(message)
            except (ProtocolError, SessionError) as exc:
                self.services.metrics.protocol_errors.inc()
                carrier.refuse(exc)

    async def _forward(self, tandem: TandemSession, carrier: Carrier) -> None:
        async for event in tandem:
            await carrier.on_event(event)
            if isinstance(event, AssistantAudio):
                self._count_dropped(tandem)
        raise Ended("the session ended")

    def _count_dropped(self, tandem: TandemSession) -> None:
        """Audio this client read too slowly to get, in the session's queue or the link's."""
        dropped = tandem.dropped_events + self.outbox.dropped
        if dropped > self._dropped_out:
            self.services.metrics.frames_dropped.labels("out").inc(dropped - self._dropped_out)
            self._dropped_out = dropped

    async def _sender(self) -> None:
        await self.link.opened()
        self._opened = True
        self._watchdog.nearer()
        while True:
            message = await self.outbox.get()
            self._sending_since = self.clock.now()
            self._watchdog.nearer()
            await self.link.send(message)
            self._sending_since = None

    async def _shutdown(self) -> None:
        raise Limit(1001, await asyncio.shield(self._stop), "shutdown")

    # ---------------------------------------------------------------- limits, on the session's clock

    def _limits(self) -> list[tuple[float, tuple]]:
        """(deadline, the Limit's args) of each limit in force: asked on every send (the watchdog's next
        deadline), so the reasons that depend on the settings alone are written once, in `_reasons`."""
        settings, reasons = self.settings, self._reasons
        limits = [(self._started + settings.max_session_s, reasons["length"])]
        if not self._opened:
            limits.append((self._started + settings.idle_timeout_s, (1001, self.link.unopened, "limit")))
        elif self.link.idle_limited:
            limits.append((self._last_message + settings.idle_timeout_s, reasons["idle"]))
        if self._sending_since is not None:
            limits.append((self._sending_since + settings.send_timeout_s, reasons["unread"]))
        return limits

    def _next_limit(self) -> float:
        return min(at for at, _ in self._limits())

    def _check_limits(self, now: float) -> None:
        for at, args in self._limits():
            if now >= at:
                raise Limit(*args)

    # ---------------------------------------------------------------- closing

    async def _flush_then_close(self, code: int, reason: str) -> None:
        """Send what is queued (the error above all), briefly, then close: the tasks are over."""
        pending = []
        while len(self.outbox):
            pending.append(self.outbox.get_nowait())
        with contextlib.suppress(Exception):
            async with asyncio.timeout(FLUSH_LIMIT_S):
                await self.link.flush(pending)
        await self._hang_up(code, reason)

    async def _hang_up(self, code: int, reason: str) -> None:
        """Close the link for at most CLOSE_LIMIT_S: the session's slot and its place among the server's
        sessions go back after it, so a connection that never finishes closing must not hold them."""
        try:
            async with asyncio.timeout(CLOSE_LIMIT_S):
                await self.link.close(code, reason)
        except TimeoutError:
            logger.warning("session %s: the connection did not close within %.0f s; the session ends anyway",
                           self.id, CLOSE_LIMIT_S)


class _Flood:
    """Counts client messages per second; `over()` is true after 5 s in a row above the limit."""

    def __init__(self, per_second: float, clock: Clock, patience_s: int = 5) -> None:
        self.per_second, self.patience_s, self.clock = per_second, patience_s, clock
        self._second, self._count, self._bad_seconds = int(clock.now()), 0, 0

    def over(self) -> bool:
        now = int(self.clock.now())
        if now != self._second:
            self._bad_seconds = self._bad_seconds + 1 if self._count > self.per_second else 0
            self._second, self._count = now, 0
        self._count += 1
        return self._bad_seconds >= self.patience_s
