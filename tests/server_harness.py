"""Run the real server (uvicorn on loopback) in a thread, and stream audio to it like a user."""

from __future__ import annotations

import asyncio
import io
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import uvicorn

from client.client import AudioMessage, EventMessage, KameClient, TextMessage, send_paced
from client.loadgen import LatencyRun, load_level, percentile_ms, soak
from kame.audio import FRAME_S
from server.app import DrainingServer, create_app
from server.services import Services
from server.settings import load_settings


class _TestServer(DrainingServer):
    """The server as `kame serve` runs it, keeping its event loop for `server_stacks`."""

    loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)


_LOOPS: dict[int, asyncio.AbstractEventLoop] = {}  # id(services) -> the loop of the server serving them


def server_stacks(services, frames: int = 6) -> str:
    """Where the server's tasks and threads are now: what a failed wait names, so that a session that
    never ends on CI says where it is stuck."""
    lines = []
    loop = _LOOPS.get(id(services))

    async def tasks() -> str:
        out = []
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                text = io.StringIO()
                task.print_stack(limit=frames, file=text)
                out.append(f"task {task.get_name()}: {text.getvalue().strip()}")
        return "\n".join(sorted(out))

    if loop is not None and not loop.is_closed():
        try:
            lines.append(asyncio.run_coroutine_threadsafe(tasks(), loop).result(5))
        except Exception as exc:  # a diagnostic: say why there is none
            lines.append(f"(the server's loop did not answer within 5 s: {exc!r})")
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        if ident != threading.get_ident():
            stack = "".join(traceback.format_stack(frame, limit=frames))
            lines.append(f"thread {names.get(ident, ident)}:\n{stack.rstrip()}")
    return "\n".join(lines)


@contextmanager
def running_server(**settings_kw):
    defaults = {"frontend": "tiny-copy", "device": "cpu", "port": 0, "llm": "local"}
    settings = load_settings(None, **(defaults | settings_kw))
    services = Services.start(settings)
    app = create_app(settings, services)
    server = _TestServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                        ws="websockets", lifespan="on", ws_per_message_deflate=False))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    _LOOPS[id(services)] = server.loop
    try:
        yield f"ws://127.0.0.1:{port}", services
    finally:
        server.should_exit = True
        thread.join(15)
        services.runtime.close()
        _LOOPS.pop(id(services), None)


class Recording:
    """Everything a client received, with its arrival times."""

    def __init__(self) -> None:
        self.audio: list[AudioMessage] = []
        self.text: list[TextMessage] = []
        self.events: list[EventMessage] = []

    @property
    def text_stream(self) -> str:
        return "".join(m.text for m in self.text)

    def of(self, kind: str) -> list:
        return [m.event for m in self.events if m.event.type == kind]


async def record(client: KameClient, into: Recording) -> None:
    async for message in client:
        if isinstance(message, AudioMessage):
            into.audio.append(message)
        elif isinstance(message, TextMessage):
            into.text.append(message)
        elif isinstance(message, EventMessage):
            into.events.append(message)


async def stream_realtime(client: KameClient, pcm: np.ndarray, chunk: int = 1920) -> tuple[float, float]:
    """Send `pcm` in 80 ms chunks at real-time pace (absolute schedule, no drift); (start, end) times."""
    return await send_paced(client.send_pcm, pcm, chunk)


def received_samples(got: Recording) -> int:
    return sum(len(m.pcm) for m in got.audio)


def audio_accounted_for(got: Recording, sent_samples: int, in_flight: int = 2) -> bool:
    """Every frame sent came back as audio or was reported dropped (the latest stats event: a loaded
    machine skips a lagging session to live), but for the last `in_flight` frames."""
    stats = got.of("stats")
    dropped = stats[-1].frames_dropped if stats else 0
    return received_samples(got) + dropped * 1920 >= sent_samples - in_flight * 1920


def few_dropped(dropped: int, frames: int) -> bool:
    """At most a quarter of `frames` dropped: what a loaded machine may skip to live while the
    server still counts as serving the session (checks that forgive reported drops cap them so)."""
    return dropped <= frames // 4


async def wait_until(predicate: Callable[[], object], what: str, timeout_s: float = 10.0,
                     found: Callable[[], str] | None = None) -> None:
    """Return once `predicate()` is true, checking every 20 ms; fail naming `what` after `timeout_s` (and what
    `found()` says was there instead). For a state with nothing to await (a message received, a counter
    reached): a loaded machine only makes it wait longer."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"still waiting after {timeout_s} s for {what}{found() if found else ''}")
        await asyncio.sleep(0.02)


def wait_until_all_slots_free(services, limit_s: float = 10.0) -> None:
    """Sessions of earlier tests on a shared server give their slots back once their planner and
    ASR stream are closed: wait for that before a test that counts slots."""
    runner, slots = services.runtime.runner, services.runtime.engine.batch_size
    try:
        asyncio.run(wait_until(lambda: runner.free_slots == slots, f"all {slots} engine slots to be free", limit_s))
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the server now:\n{server_stacks(services)}") from None


# a frame's round trip (sent by the client -> its audio back) that a working server stays under on a
# loaded 2-core machine (seen there in the short soak: p50 40-190 ms, p99 140-760 ms); a server
# that buffers, falls behind or blocks its event loop does not
ROUND_TRIP_P50_S = 5 * FRAME_S
ROUND_TRIP_P99_S = 20 * FRAME_S


async def soak_with_probe(url: str, speech: np.ndarray, seconds: float, good: int, seed: int = 0
                          ) -> tuple[dict, LatencyRun]:
    """`client.loadgen.soak` plus one more real-time session that times every frame's round trip."""
    report, probe = await asyncio.gather(soak(url, speech, seconds, good=good, seed=seed),
                                         load_level(url, 1, seconds, seed=seed))
    return report, probe


def round_trip_ms(run: LatencyRun) -> dict[str, float | None]:
    return {f"p{q}": percentile_ms(run.round_trips, q) for q in (50, 95, 99)}


def free_port() -> int:
    """A loopback port nobody listens on (for a server to start on, or to be refused by)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_mb() -> float:
    """This process's resident memory."""
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
