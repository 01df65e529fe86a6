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
The last three are the front's app's to keep (server/front_peers.py, which the app imports); this module is the
supervisor that starts the app in each front.

The supervisor restarts a front that dies (its sessions are lost; the others go on), stops everything if
the engine process dies, and on SIGTERM or SIGINT lets every front drain before the engine stops.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import secrets
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path

from server.front_peers import FrontPlan, SharedCounts
from server.settings import ServerSettings

logger = logging.getLogger(__name__)

FRONT_STOP_S = 15.0  # beyond the sessions' shutdown_timeout_s: how long a front may take to stop


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
    from server.app import DrainingServer, create_app, uvicorn_config
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
