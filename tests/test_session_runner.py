"""The runner every transport shares (server/runner.py), with no socket and no engine: a link made of
queues, a carrier that logs what it is told, and a manual clock. Its limits run on the session's
clock: no real second passes in these tests."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kame.clock import ManualClock, settle
from kame.protocol import ProtocolError
from server.metrics import Metrics
from server.runner import Disconnected, Ended, SessionRunner
from server.settings import ServerSettings


class QueueLink:
    """A link whose client is the test: `client_sends`, `client_goes`; `stuck`: sends never finish."""

    unopened = "no channel"

    def __init__(self, idle_limited: bool = True, opens: bool = True) -> None:
        self.idle_limited = idle_limited
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.sent: list = []
        self.closed: tuple[int, str] | None = None
        self.stuck = False
        self._open = asyncio.Event()
        if opens:
            self._open.set()

    def client_sends(self, message) -> None:
        self.inbox.put_nowait(message)

    def client_goes(self) -> None:
        self.inbox.put_nowait(None)

    async def opened(self) -> None:
        await self._open.wait()

    async def receive(self):
        message = await self.inbox.get()
        if message is None:
            raise Disconnected
        return message

    async def send(self, message) -> None:
        if self.stuck:
            await asyncio.Event().wait()
        self.sent.append(message)

    async def flush(self, messages) -> None:
        self.sent += messages

    async def close(self, code: int, reason: str) -> None:
        self.closed = (code, reason)

    def tasks(self) -> list:
        return []


class LogCarrier:
    """Echoes each message back; `bad` messages are refused, `bug` ones raise a bug."""

    def __init__(self, runner: SessionRunner) -> None:
        self.runner = runner
        self.log: list = []

    async def greet(self) -> None:
        self.runner.send("hello")

    async def on_message(self, message) -> None:
        if message == "bad":
            raise ProtocolError("a bad message")
        if message == "bug":
            raise KeyError("a bug")
        self.runner.send(f"echo {message}")

    def refuse(self, exc: Exception) -> None:
        self.log.append(("refused", str(exc)))
        self.runner.send(f"error {exc}")

    async def on_event(self, event) -> None:
        self.log.append(("event", event))

    def report(self, code: str, message: str) -> None:
        self.log.append(("report", code, message))
        self.runner.send(f"{code}: {message}")

    def tasks(self) -> list:
        return []

    async def aclose(self) -> None:
        self.log.append("aclosed")


class Tandem:
    """Sends no events until `end()`; remembers being closed."""

    dropped_events = 0

    def __init__(self) -> None:
        self.closed = False
        self._end = asyncio.Event()

    def end(self) -> None:
        self._end.set()

    def __aiter__(self):
        return self

    async def __anext__(self):
        await self._end.wait()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.closed = True


def rig(link: QueueLink, **settings):
    clock = ManualClock()
    services = SimpleNamespace(settings=ServerSettings(**settings), metrics=Metrics())
    runner = SessionRunner(services, link, "test", clock)
    carrier, tandem = LogCarrier(runner), Tandem()
    task = asyncio.create_task(runner.run(tandem, carrier))
    return clock, runner, carrier, tandem, task


def test_a_silent_client_is_closed_after_the_idle_limit_of_the_sessions_clock():
    async def go():
        link = QueueLink()
        clock, runner, carrier, tandem, task = rig(link, idle_timeout_s=60)
        await settle()
        await clock.advance(50)
        link.client_sends("ping")  # a message restarts the wait
        await settle()
        await clock.advance(50)
        alive = link.closed is None
        await clock.advance(10.5)
        await asyncio.wait_for(task, 1)
        return link, carrier, tandem, runner, alive

    link, carrier, tandem, runner, alive = asyncio.run(go())
    assert alive
    assert link.closed == (1001, "no message for 60 s")
    assert ("report", "limit", "no message for 60 s") in carrier.log
    assert link.sent == ["hello", "echo ping", "limit: no message for 60 s"]  # the error flushed before closing
    assert tandem.closed and "aclosed" in carrier.log and runner.ended.is_set()


def test_a_client_that_does_not_read_is_closed_after_the_send_limit():
    async def go():
        link = QueueLink()
        clock, runner, carrier, tandem, task = rig(link, send_timeout_s=10, idle_timeout_s=600)
        await settle()
        link.stuck = True
        link.client_sends("one")
        await settle()
        await clock.advance(9.9)
        alive = link.closed is None
        await clock.advance(0.2)
        await asyncio.wait_for(task, 1)
        return link, alive

    link, alive = asyncio.run(go())
    assert alive
    assert link.closed == (1008, "the client has not read for 10 s")


def test_the_session_length_limit_and_the_servers_shutdown():
    async def go():
        link = QueueLink(idle_limited=False)
        clock, runner, carrier, tandem, task = rig(link, max_session_s=120)
        await settle()
        await clock.advance(119)
        alive = link.closed is None
        await clock.advance(1)
        await asyncio.wait_for(task, 1)
        ended_by_length = link.closed

        link = QueueLink()
        clock, runner, carrier, tandem, task = rig(link)
        await settle()
        runner.shutdown("the server is shutting down")
        await asyncio.wait_for(task, 1)
        return alive, ended_by_length, link, carrier

    alive, ended_by_length, link, carrier = asyncio.run(go())
    assert alive and ended_by_length == (1000, "the session reached its 120 s limit")
    assert link.closed == (1001, "the server is shutting down")
    assert ("report", "shutdown", "the server is shutting down") in carrier.log


def test_a_link_without_idle_limit_must_open_in_time():
    """WebRTC's data channel: a quiet channel is fine (the audio comes on the track), one that never
    opens is not."""
    async def go():
        quiet = QueueLink(idle_limited=False)
        clock, _, _, _, task = rig(quiet, idle_timeout_s=30, max_session_s=1000)
        await settle()
        await clock.advance(100)
        quiet_alive = quiet.closed is None
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

        never = QueueLink(idle_limited=False, opens=False)
        clock, _, _, _, task = rig(never, idle_timeout_s=30, max_session_s=1000)
        await settle()
        await clock.advance(30)
        await asyncio.wait_for(task, 1)
        return quiet_alive, never.closed

    quiet_alive, closed = asyncio.run(go())
    assert quiet_alive
    assert closed == (1001, "no channel")


def test_a_flood_is_closed_on_the_sessions_clock():
    async def go():
        link = QueueLink()
        clock, runner, carrier, tandem, task = rig(link, max_messages_per_s=10)
        await settle()
        for _ in range(7):  # 20 messages in each of 7 seconds of the session's time
            for _ in range(20):
                link.client_sends("x")
            await settle()
            await clock.advance(1)
        await asyncio.wait_for(task, 1)
        return link

    link = asyncio.run(go())
    assert link.closed == (1008, "more than 10 messages/s for 5 s")


def test_a_bad_message_is_refused_and_a_bug_ends_only_its_session():
    async def go():
        link = QueueLink()
        clock, runner, carrier, tandem, task = rig(link)
        await settle()
        link.client_sends("bad")
        link.client_sends("fine")
        await settle()
        refused = list(carrier.log)
        errors = runner.services.metrics.protocol_errors._value.get()
        link.client_sends("bug")
        await asyncio.wait_for(task, 1)
        return link, refused, errors, tandem

    link, refused, errors, tandem = asyncio.run(go())
    assert refused == [("refused", "a bad message")] and errors == 1
    assert link.sent[:3] == ["hello", "error a bad message", "echo fine"]
    assert link.closed == (1011, "internal error") and tandem.closed


def test_the_session_ends_when_the_tandem_does_and_when_the_client_goes():
    async def go():
        link = QueueLink()
        _, _, _, tandem, task = rig(link)
        await settle()
        tandem.end()
        await asyncio.wait_for(task, 1)
        ended = link.closed

        link = QueueLink()
        _, runner, _, tandem, task = rig(link)
        await settle()
        link.client_goes()
        await asyncio.wait_for(task, 1)
        return ended, link.closed, tandem.closed, runner.ended.is_set()

    ended, gone, closed, runner_ended = asyncio.run(go())
    assert ended == (1011, Ended("the session ended").args[0])
    assert gone is None and closed and runner_ended  # a client that went is not closed again


def test_a_wait_on_the_sessions_clock_ends_when_that_clock_says():
    """A client function's call waits on the session's clock (kame.clock.wait_for), not the wall's."""
    from kame.clock import wait_for

    async def go():
        clock = ManualClock()
        answered = asyncio.get_running_loop().create_future()
        waiting = asyncio.create_task(wait_for(clock, answered, 15))
        await settle()  # the wait has begun
        await clock.advance(14)
        answered.set_result("42")
        first = await waiting

        never = asyncio.get_running_loop().create_future()
        waiting = asyncio.create_task(wait_for(clock, never, 15))
        await settle()
        await clock.advance(14.9)
        pending = not waiting.done()
        await clock.advance(0.1)
        try:
            await waiting
        except TimeoutError:
            return first, pending, never.cancelled()
        return first, pending, None

    assert asyncio.run(go()) == ("42", True, True)
