"""`kame serve --fronts N`: one engine process and N front processes behind one port.

The engine process (kame/engine_process.py) holds the GPU models and steps one batch for every session; each
front process is the whole server app (websockets, WebRTC, Opus, the ASR feeds, planners, /healthz, /metrics)
with a `RemoteRunner` where its engine was. The fronts accept on one listening socket that this supervisor
binds and hands them, so clients see one endpoint; the kernel gives each new connection to whichever front
accepts first. What must hold across fronts is kept where one front cannot get it wrong:
- slots: the engine process's alone (acquire and release go through it; `/healthz` counts its free slots);
- connections per address: one count in shared memory (`SharedCounts`), under one lock;
- `/metrics`: every front's, merged (each front also listens on a loopback port of its own, and asks the
  others there); the engine's own figures come from front 0 only, once;
- a GPT-Live sideband for a session another front holds: relayed to that front's loopback port.

The supervisor restarts a front that dies (its sessions are lost; the others go on), stops everything if
the engine process dies, and on SIGTERM or SIGINT lets every front drain before the engine stops.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import secrets
import signal
import socket
import sys
import tempfile
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

from server.settings import ServerSettings

logger = logging.getLogger(__name__)

ADDRESS_BUCKETS = 4096  # per-address connection counts: addresses hash into this many (a collision shares a count)
FRONT_STOP_S = 15.0  # beyond the sessions' shutdown_timeout_s: how long a front may take to stop


class SharedCounts:
    """Connections per client address for every front: counts in shared memory under one lock, so that
    `max_connections_per_ip` holds across fronts (two addresses whose hashes collide share a count: the
    limit is then stricter, never looser)."""

    def __init__(self, context, buckets: int = ADDRESS_BUCKETS) -> None:
        self.counts = context.Array("i", buckets, lock=False)
        self.lock = context.Lock()

    def _bucket(self, address: str) -> int:
        return zlib.crc32(address.encode()) % len(self.counts)

    def admit(self, address: str, limit: int) -> bool:
        """Count one more connection from `address` unless it has `limit` already."""
        bucket = self._bucket(address)
        with self.lock:
            if self.counts[bucket] >= limit:
                return False
            self.counts[bucket] += 1
            return True

    def leave(self, address: str) -> None:
        bucket = self._bucket(address)
        with self.lock:
            self.counts[bucket] = max(0, self.counts[bucket] - 1)


@dataclass(frozen=True)
class FrontPlan:
    """What one front process is told: who it is among how many, where the engine is, and its peers."""

    index: int
    address: str  # the engine process's socket
    authkey: bytes
    private_ports: tuple[int, ...]  # each front's loopback port, by index
    counts: SharedCounts

    @property
    def count(self) -> int:
        return len(self.private_ports)

    @property
    def peers(self) -> list[int]:
        return [port for index, port in enumerate(self.private_ports) if index != self.index]


def serve_with_fronts(settings: ServerSettings, fronts: int, verbose: bool = False) -> int:
    """Run the engine process and `fronts` front processes until SIGTERM or SIGINT (blocking)."""
    context = multiprocessing.get_context("spawn")  # no fork of a process that may hold CUDA or threads
    folder = Path(tempfile.mkdtemp(prefix="kame-engine-"))
    address, authkey = str(folder / "engine.sock"), secrets.token_bytes(32)
    engine = _start_engine(context, settings, address, authkey, verbose)
    if engine is None:
        return 1
    public = _listen(settings.host, settings.port)
    privates = [_listen("127.0.0.1", 0) for _ in range(fronts)]
    counts = SharedCounts(context)
    ports = tuple(sock.getsockname()[1] for sock in privates)
    plans = [FrontPlan(index, address, authkey, ports, counts) for index in range(fronts)]

    def start_front(index: int):
        process = context.Process(target=front_main, args=(settings, public, privates[index], plans[index], verbose),
                                  name=f"kame-front-{index}", daemon=False)
        process.start()
        return process

    processes = [start_front(index) for index in range(fronts)]
    logger.info("serving on %s:%d with %d front processes and one engine process", settings.host, settings.port,
                fronts)
    stop = threading.Event()
    previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    try:
        code = _supervise(stop, engine, processes, start_front)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _stop_all(processes, engine, settings.shutdown_timeout_s + FRONT_STOP_S)
        public.close()
        for sock in privates:
            sock.close()
    return code


def _start_engine(context, settings: ServerSettings, address: str, authkey: bytes, verbose: bool):
    """The engine process, loaded and warm; None (and why, logged) if it could not start."""
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=engine_main, args=(settings.runtime_settings(), address, authkey, send, verbose),
                              name="kame-engine", daemon=False)
    process.start()
    send.close()
    while not receive.poll(1.0):
        if not process.is_alive():
            logger.error("the engine process exited (code %s) before it was ready", process.exitcode)
            return None
    message = receive.recv()
    if message != "ready":
        logger.error("%s", message)
        process.join(30)
        return None
    return process


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _supervise(stop: threading.Event, engine, processes: list, start_front) -> int:
    while not stop.wait(0.5):
        if not engine.is_alive():
            logger.error("the engine process exited (code %s): stopping the server", engine.exitcode)
            return 1
        for index, process in enumerate(processes):
            if not process.is_alive():
                logger.error("front process %d exited (code %s): starting it again (its sessions are lost)",
                             index, process.exitcode)
                processes[index] = start_front(index)
    return 0


def _stop_all(processes: list, engine, timeout_s: float) -> None:
    """Fronts first (each drains its sessions), then the engine."""
    for process in processes:
        if process.is_alive():
            process.terminate()  # SIGTERM: the front drains, as one server would
    for process in processes:
        process.join(timeout_s)
        if process.is_alive():
            logger.warning("%s did not stop in %.0f s: killed", process.name, timeout_s)
            process.kill()
            process.join(5)
    if engine.is_alive():
        engine.terminate()
        engine.join(30)
        if engine.is_alive():
            engine.kill()
            engine.join(5)


def _configure_logging(verbose: bool, name: str) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s", stream=sys.stderr)


def engine_main(settings, address: str, authkey: bytes, ready, verbose: bool) -> None:
    from kame.engine_process import serve_engine

    _configure_logging(verbose, "engine")
    serve_engine(settings, address, authkey, ready)


def front_main(settings: ServerSettings, public: socket.socket, private: socket.socket, plan: FrontPlan,
               verbose: bool) -> None:
    """One front: the app on the shared socket and its own loopback one, its runtime the engine process's."""
    from kame.frontend.remote import RemoteEngine
    from server.app import DrainingServer, create_app
    from server.cli import uvicorn_config
    from server.services import Services

    _configure_logging(verbose, f"front {plan.index}")
    logger.info("front %d of %d: its own loopback port %d, pid %d", plan.index, plan.count, private.getsockname()[1],
                os.getpid())
    remote = RemoteEngine(plan.address, plan.authkey)
    services = Services.connect(settings, remote, engine_metrics=plan.index == 0)
    try:
        server = DrainingServer(uvicorn_config(create_app(settings, services, front=plan), settings))
        # uvicorn drains on SIGTERM or SIGINT, then raises the signal again with the handler it found: ignored
        # here, so that the front ends through this function (the supervisor sends SIGTERM; a terminal's
        # Ctrl-C reaches every process of the group)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
        server.run(sockets=[public, private])
    finally:
        services.runtime.close()


# ---------------------------------------------------------------- what crosses fronts, in a front's app

RELAYED = "x-kame-relayed"  # a sideband relayed by another front: never relayed again


async def merged_metrics(plan: FrontPlan, own: bytes) -> bytes:
    """This front's metrics and its peers' (from their loopback ports), one exposition, each sample
    labelled with its front; a peer that does not answer in time is left out (and said so in the log)."""
    import asyncio
    import urllib.request

    from server.metrics import merge_metrics, parse_metrics

    def fetch(port: int) -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics?local=1", timeout=2.0) as response:
                return response.read().decode()
        except OSError as exc:
            logger.warning("front on port %d gave no metrics: %s", port, exc)
            return None

    texts = await asyncio.gather(*(asyncio.to_thread(fetch, port) for port in plan.peers))
    families = {str(plan.index): parse_metrics(own.decode())}
    for index, text in zip((i for i in range(plan.count) if i != plan.index), texts, strict=True):
        if text is not None:
            families[str(index)] = parse_metrics(text)
    return merge_metrics(families, label="front")


async def relay_sideband(ws, session_id: str, plan: FrontPlan) -> bool:
    """A sideband for a session another front holds: relay `ws` to that front's loopback port until either
    side ends. False when no peer holds the session (the caller answers 404)."""
    import asyncio

    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    headers = {RELAYED: "1"} | ({"authorization": ws.headers["authorization"]} if "authorization" in ws.headers
                                else {})
    query = f"?{ws.url.query}" if ws.url.query else ""
    for port in plan.peers:
        try:
            upstream = await connect(f"ws://127.0.0.1:{port}/v1/live/sessions/{session_id}/attach{query}",
                                     additional_headers=headers, max_size=None)
        except InvalidStatus:
            continue  # not there
        except OSError as exc:
            logger.warning("front on port %d does not answer: %s", port, exc)
            continue
        await ws.accept()
        async with upstream:
            pumps = [asyncio.create_task(_client_to_peer(ws, upstream)),
                     asyncio.create_task(_peer_to_client(upstream, ws))]
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        with contextlib.suppress(Exception):
            await ws.close(1000, "the session ended")
        return True
    return False


async def _client_to_peer(ws, upstream) -> None:
    from starlette.websockets import WebSocketDisconnect

    with contextlib.suppress(WebSocketDisconnect):
        while True:
            await upstream.send(await ws.receive_text())


async def _peer_to_client(upstream, ws) -> None:
    from websockets.exceptions import ConnectionClosed

    with contextlib.suppress(ConnectionClosed):
        async for message in upstream:
            await ws.send_text(message if isinstance(message, str) else message.decode())
