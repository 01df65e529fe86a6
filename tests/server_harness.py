"""Run the real server (uvicorn on loopback) in a thread, and stream audio to it like a user."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import uvicorn

from client.client import AudioMessage, EventMessage, KameClient, TextMessage
from server.app import DrainingServer, create_app
from server.services import Services
from server.settings import load_settings


@contextmanager
def running_server(**settings_kw):
    defaults = {"frontend": "tiny-copy", "device": "cpu", "port": 0, "llm": "local"}
    settings = load_settings(None, **(defaults | settings_kw))
    services = Services.start(settings)
    app = create_app(settings, services)
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           ws="websockets", lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"ws://127.0.0.1:{port}", services
    finally:
        server.should_exit = True
        thread.join(15)
        services.runtime.close()


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
    start = time.monotonic()
    for index in range(0, len(pcm), chunk):
        await client.send_pcm(pcm[index:index + chunk])
        delay = start + (index + chunk) / 24000 - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
    return start, time.monotonic()


def wait_until_all_slots_free(services, limit_s: float = 10.0) -> None:
    """Sessions of earlier tests on a shared server give their slots back once their planner and
    ASR stream are closed: wait for that before a test that counts slots."""
    runner, slots = services.runtime.runner, services.runtime.engine.batch_size
    deadline = time.monotonic() + limit_s
    while runner.free_slots < slots and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runner.free_slots == slots, f"{slots - runner.free_slots} slots still taken after {limit_s} s"


def free_port() -> int:
    """A loopback port nobody listens on (for a server to start on, or to be refused by)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_mb() -> float:
    """This process's resident memory."""
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
