"""What every websocket transport of a tandem session shares (Moshi's `/api/chat`, the OpenAI
Realtime `/v1/realtime`): the engine slot and its observers, one writer to the socket, the
session's limits, the server's shutdown, and closing.

A transport subclasses `SocketSession` and supplies `_greet` (what is sent once the session is
accepted), `_on_message` (one client message), `_forward` (session events -> the client) and
`_report` (an error the client must be told about). Its tasks run in one TaskGroup: a bug ends
this session only, with a trace in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.exceptions import ConnectionClosed

from kame.clock import Clock, MonotonicClock
from kame.errors import SessionError
from kame.protocol import ProtocolError
from kame.queues import DropOldestQueue
from kame.session import SessionConfig, TandemSession
from server.metrics import SessionMetrics
from server.recorder import SessionRecorder
from server.services import Services

logger = logging.getLogger(__name__)

CLOSED = (RuntimeError, OSError, WebSocketDisconnect, ConnectionClosed)
CLOSE_LIMIT_S = 5.0  # a connection still closing after this is left to finish alone: the slot goes back


class Disconnected(Exception):
    """The client went away."""


class Ended(Exception):
    """The tandem session ended (an engine failure): args: (reason,)."""


class Finished(Exception):
    """The transport ended the session normally (the client asked): args: (close code, reason)."""


class Limit(Exception):
    """A limit ended the session; args: (close code, reason[, error code: "limit" by default])."""


class SocketSession:
    transport = "socket"
    subprotocol: str | None = None  # the websocket subprotocol the upgrade answers with

    def __init__(self, ws: WebSocket, services: Services, clock: Clock | None = None) -> None:
        self.ws, self.services = ws, services
        # the session's time: the tandem session's, the planner's, the recorder's and the flood counter's
        self.clock = clock or MonotonicClock()
        self.settings = services.settings
        self.id = uuid.uuid4().hex[:12]
        self._send: DropOldestQueue[bytes | str] = DropOldestQueue(self.settings.send_queue_messages)
        self._recorder: SessionRecorder | None = None
        self._dropped_out = 0
        self._stop: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._group: asyncio.TaskGroup | None = None
        self.ended = asyncio.Event()

    # ---------------------------------------------------------------- lifecycle

    async def open_tandem(self, config: SessionConfig, asr: bool = True) -> TandemSession:
        """Take an engine slot for this connection (SlotsBusy, SessionError)."""
        tool_names = frozenset(tool.spec.name for tool in self.services.runtime.session_tools())
        observers = [SessionMetrics(self.services.metrics, tool_names)]
        if self.settings.record_dir is not None:
            runtime = self.services.runtime
            self._recorder = SessionRecorder(self.settings.record_dir, self.id, self.clock, {
                "frontend": runtime.frontend.source, "asr": runtime.asr.name if asr else "none",
                "backend": config.backend or runtime.default_profile, "oracle_delay_s": config.oracle_delay_s,
                "transport": self.transport})
            observers.append(self._recorder)
        try:
            return await TandemSession.open(self.services.runtime, config, observers, session_id=self.id,
                                            clock=self.clock)
        except BaseException:
            await self.discard_recording()
            raise

    async def discard_recording(self) -> None:
        """The session does not happen after all: leave no recording behind."""
        if self._recorder is not None:
            recorder, self._recorder = self._recorder, None
            await asyncio.to_thread(recorder.discard)

    async def run(self, tandem: TandemSession) -> None:
        metrics = self.services.metrics
        metrics.sessions_total.inc()
        metrics.transport_sessions.labels(self.transport).inc()
        metrics.active_sessions.inc()
        try:
            await self._greet(tandem)
            async with asyncio.TaskGroup() as tasks:
                self._group = tasks
                tasks.create_task(self._receive(tandem), name=f"ws-{self.id}-receive")
                tasks.create_task(self._forward(tandem), name=f"ws-{self.id}-forward")
                tasks.create_task(self._sender(), name=f"ws-{self.id}-send")
                tasks.create_task(self._limits(), name=f"ws-{self.id}-limits")
                for extra in self._extra_tasks(tandem):
                    tasks.create_task(extra, name=f"ws-{self.id}-{extra.__name__}")
        except* Disconnected:
            logger.info("session %s: client disconnected", self.id)
        except* Limit as group:
            code, reason, *error = group.exceptions[0].args
            logger.info("session %s closed: %s", self.id, reason)
            self._report(error[0] if error else "limit", reason)
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
            await tandem.aclose()
            metrics.active_sessions.dec()
            if self._recorder is not None:
                await asyncio.to_thread(self._recorder.close)
            self.ended.set()

    def _spawn(self, coro, name: str) -> None:
        """A task of this session, in its TaskGroup (a failure in it ends the session, logged)."""
        try:
            if self._group is None:
                raise RuntimeError("the session has ended")
            self._group.create_task(coro, name=f"ws-{self.id}-{name}")
        except RuntimeError:  # ended, or ending: nothing more is started
            coro.close()

    def shutdown(self, reason: str) -> None:
        """The server is stopping: tell the client and end the session (through its own tasks)."""
        if not self._stop.done():
            self._stop.set_result(reason)

    # ---------------------------------------------------------------- what a transport supplies

    async def _greet(self, tandem: TandemSession) -> None:
        """Sent once the socket is accepted, before anything else."""

    async def _on_message(self, message: dict, tandem: TandemSession) -> None:
        """One client message (starlette's dict: "bytes" or "text"); ProtocolError/SessionError
        for a bad one: it is reported and the session goes on."""
        raise NotImplementedError

    async def _forward(self, tandem: TandemSession) -> None:
        raise NotImplementedError

    def _report(self, code: str, message: str) -> None:
        """Tell the client about an error (a bad message, a limit, a failure)."""
        raise NotImplementedError

    def _extra_tasks(self, tandem: TandemSession) -> list:
        """More coroutines to run beside the four tasks (a transport's timers)."""
        return []

    # ---------------------------------------------------------------- tasks

    async def _next_message(self) -> dict:
        """The client's next message (starlette's dict: "bytes" or "text"); Disconnected when it has
        gone, Limit when it sent nothing for `idle_timeout_s`."""
        try:
            async with asyncio.timeout(self.settings.idle_timeout_s):
                message = await self.ws.receive()
        except TimeoutError as exc:
            raise Limit(1001, f"no message for {self.settings.idle_timeout_s:.0f} s", "limit") from exc
        except CLOSED as exc:
            raise Disconnected from exc
        if message["type"] == "websocket.disconnect":
            raise Disconnected
        return message

    async def _receive(self, tandem: TandemSession) -> None:
        flood = _Flood(self.settings.max_messages_per_s, self.clock)
        while True:
            message = await self._next_message()
            if flood.over():
                raise Limit(1008, f"more than {self.settings.max_messages_per_s:.0f} messages/s for 5 s")
            try:
                await self._on_message(message, tandem)
            except (ProtocolError, SessionError) as exc:
                self.services.metrics.protocol_errors.inc()
                self._bad_message(exc)

    def _bad_message(self, exc: Exception) -> None:
        self._report("protocol", str(exc))

    def _count_dropped(self, tandem: TandemSession) -> None:
        """Audio this client read too slowly to get, in the session's queue or the socket's."""
        dropped = tandem.dropped_events + self._send.dropped
        if dropped > self._dropped_out:
            self.services.metrics.frames_dropped.labels("out").inc(dropped - self._dropped_out)
            self._dropped_out = dropped

    async def _sender(self) -> None:
        while True:
            await self._send_now(await self._send.get())

    async def _send_now(self, message: bytes | str) -> None:
        try:
            async with asyncio.timeout(self.settings.send_timeout_s):
                if isinstance(message, bytes):
                    await self.ws.send_bytes(message)
                else:
                    await self.ws.send_text(message)
        except TimeoutError as exc:
            raise Limit(1008, f"the client has not read for {self.settings.send_timeout_s:.0f} s") from exc
        except CLOSED as exc:
            raise Disconnected from exc

    async def _limits(self) -> None:
        """The session's length limit, and the server's shutdown."""
        limit_s = self.settings.max_session_s
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(limit_s):
                raise Limit(1001, await asyncio.shield(self._stop), "shutdown")
        raise Limit(1000, f"the session reached its {limit_s:.0f} s limit")

    # ---------------------------------------------------------------- closing

    async def _flush_then_close(self, code: int, reason: str, limit_s: float = 1.0) -> None:
        """Send what is queued (the error above all), briefly, then close: the tasks are over."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(limit_s):
                while len(self._send):
                    message = self._send.get_nowait()
                    if isinstance(message, bytes):
                        await self.ws.send_bytes(message)
                    else:
                        await self.ws.send_text(message)
        await self._hang_up(code, reason)

    async def _hang_up(self, code: int, reason: str) -> None:
        """`_close`, for at most CLOSE_LIMIT_S: the session's slot and its place among the server's
        sessions go back after it, so a connection that never finishes closing must not hold them."""
        try:
            async with asyncio.timeout(CLOSE_LIMIT_S):
                await self._close(code, reason)
        except TimeoutError:
            logger.warning("session %s: the connection did not close within %.0f s; the session ends anyway",
                           self.id, CLOSE_LIMIT_S)

    async def _close(self, code: int, reason: str) -> None:
        with contextlib.suppress(*CLOSED):  # already closed
            await self.ws.close(code, reason)


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
