"""The engine process of `kame serve --fronts N`: the models that run on engine threads (the front-end's
batch, and kyutai-stt's where it is the ASR), loaded and warmed once, then served to the front processes
over a Unix socket (kame/frontend/engine_host.py). It runs until SIGTERM or SIGINT, or until its parent goes.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from multiprocessing.connection import Connection

from kame.frontend.engine_host import EngineHost
from kame.runtime import RemoteFrontend, RuntimeSettings, load_asr, load_engine

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 1.0  # how often the host looks whether the process that started it is still there


def serve_engine(settings: RuntimeSettings, address: str, authkey: bytes, ready: Connection) -> None:
    """Load, warm, then serve until stopped; `ready` gets "ready" once fronts may connect, or the error."""
    try:
        frontend, engine, runner, cuda = load_engine(settings)
    except Exception as exc:
        ready.send(f"the engine could not start: {exc}")
        raise
    runners, extra, asr = {"engine": runner}, RemoteFrontend.describe(frontend), None
    try:
        if settings.resolved_asr(cuda) == "kyutai-stt":  # a GPU batch: it belongs where the GPU is
            asr = load_asr(settings, cuda, engine.batch_size)
            runners["asr"], extra["asr"] = asr.runner, asr.describe()
        host = EngineHost(runners, address, authkey, extra)
    except Exception as exc:
        ready.send(f"the engine could not start: {exc}")
        runner.stop()
        engine.close()
        raise
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    threading.Thread(target=_watch, args=(stop, host), name="kame-host-watch", daemon=True).start()
    ready.send("ready")
    logger.info("engine process ready at %s: %s", address, ", ".join(f"{name} ({slots} slots)"
                                                                     for name, slots in host.info.runners.items()))
    try:
        host.serve_forever()
    finally:
        if asr is not None:
            asr.close()
        runner.stop()
        engine.close()
        logger.info("engine process stopped")


def _watch(stop: threading.Event, host: EngineHost) -> None:
    """Close the host on a signal, or once the parent (the server) is gone: never an orphan on a GPU."""
    parent = os.getppid()
    while not stop.wait(PARENT_CHECK_S):
        if os.getppid() != parent:
            logger.warning("the server process is gone: the engine process stops")
            break
    host.close()
