"""Every session's Opus streams in child processes, off the event loop and off its GIL.

sphn's Opus binding holds the GIL while it works: about 0.9 ms to encode one 80 ms frame here
(it resamples to 48 kHz first). On one thread, at 64 sessions, the server's GIL was held in 56 % of
py-spy's samples, 60 % of those in the encode, and at 32 the event loop lagged up to 160 ms
(docs/benchmarks-history.md, "The host side"). In a child process that time is the child's. A stream
lives in one child (streams are spread over `processes` by id), so its packets stay in order; the
parent only sends a frame's bytes (7.7 KB of PCM) there and gets the packet back.

A child that dies fails the calls it had and is started again; its streams start over in the new
one (a decoder waits for the next Ogg page; an encoder sends a new stream header), so a session
loses a frame or two, not its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np

from kame.protocol import ProtocolError

logger = logging.getLogger(__name__)

_STOP = None  # sent to a child (and to a sender thread): finish


class CodecError(RuntimeError):
    """The codec process could not answer (it stopped or is being restarted)."""


def _serve(conn) -> None:
    """The child: run each request on its stream, answer (request id, ok, result or message)."""
    import signal

    from kame.codec import OpusDecoder, OpusEncoder

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C is the parent's: it stops us
    makers: dict[str, Callable] = {"decode": OpusDecoder, "encode": OpusEncoder}
    streams: dict[tuple[str, int], object] = {}
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is _STOP:
            return
        rid, op, stream, payload = request
        if op == "ping":  # answered once the imports above are done: the child is ready
            conn.send((rid, True, None))
            continue
        if op == "close":
            streams.pop(("decode", stream), None)
            streams.pop(("encode", stream), None)
            continue
        try:
            coder = streams.get((op, stream))
            if coder is None:
                coder = streams[(op, stream)] = makers[op]()
            # raw bytes both ways (float32 PCM as its bytes): a pickled array costs the parent's GIL more
            if op == "decode":
                result = coder.decode(payload).tobytes()
            else:
                result = coder.encode(np.frombuffer(payload, np.float32))
            conn.send((rid, True, result))
        except ProtocolError as exc:
            conn.send((rid, False, str(exc)))
        except Exception as exc:  # a bug of one stream: that call fails, the child goes on
            conn.send((rid, False, f"{type(exc).__name__}: {exc}"))


class _Child:
    """One child process, a thread that sends to it and one that reads its answers.

    A plain `python -m server.codec_process FD` over a socket pair: multiprocessing's spawn would
    import the parent's __main__ again in the child (the CLI, or Ray's worker), and fork would copy
    the server's threads and models."""

    def __init__(self, index: int) -> None:
        parent_end, child_end = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, "-m", "server.codec_process", str(child_end.fileno())],
                                        pass_fds=(child_end.fileno(),), stdin=subprocess.DEVNULL)
        child_end.close()
        self._conn = Connection(parent_end.detach())
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._lock = threading.Lock()
        self.alive = True
        self._sender = threading.Thread(target=self._send_loop, name=f"kame-codec-{index}-send", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name=f"kame-codec-{index}-read", daemon=True)
        self._sender.start()
        self._reader.start()

    def submit(self, rid: int, op: str, stream: int, payload: object, future: asyncio.Future | None) -> None:
        if future is not None:
            with self._lock:
                if not self.alive:
                    raise CodecError("the codec process stopped")
                self._pending[rid] = (future.get_loop(), future)
        self._outbox.put((rid, op, stream, payload))

    def _send_loop(self) -> None:
        """The only writer of the pipe: requests in order, then the stop (the child ends once it has
        answered what came before)."""
        while True:
            request = self._outbox.get()
            try:
                self._conn.send(request)
            except (OSError, ValueError):
                return
            if request is _STOP:
                return

    def _read_loop(self) -> None:
        while True:
            try:
                rid, ok, result = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                waiter = self._pending.pop(rid, None)
            if waiter is not None:
                loop, future = waiter
                loop.call_soon_threadsafe(_settle, future, ok, result)
        with self._lock:  # the child is gone: nobody may wait for it
            self.alive = False
            pending, self._pending = self._pending, {}
        for loop, future in pending.values():
            loop.call_soon_threadsafe(_settle, future, False, CodecError("the codec process stopped"))

    def close(self, timeout: float = 2.0) -> None:
        self._outbox.put(_STOP)
        self._sender.join(timeout)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout)
        with contextlib.suppress(OSError):
            self._conn.close()


def _settle(future: asyncio.Future, ok: bool, result: object) -> None:
    if future.done():  # its caller gave up (cancelled)
        return
    if ok:
        future.set_result(result)
    elif isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_exception(ProtocolError(result))


class CodecPool:
    """`processes` codec children; `stream()` gives a session its Opus decoder and encoder there."""

    def __init__(self, processes: int = 1) -> None:
        if processes < 1:
            raise ValueError("a codec pool needs at least one process")
        self._children = [_Child(index) for index in range(processes)]  # started now
        self._streams, self._requests = itertools.count(1), itertools.count(1)
        self._lock = threading.Lock()
        self.restarts = 0
        self._closed = False

    def stream(self) -> OpusStream:
        return OpusStream(self, next(self._streams))

    def _child(self, stream: int) -> _Child:
        index = stream % len(self._children)
        with self._lock:
            if self._closed:
                raise CodecError("the codec pool is closed")
            child = self._children[index]
            if not child.alive:
                self.restarts += 1
                logger.warning("codec process %d stopped (exit code %s): starting it again; its sessions' "
                               "Opus streams start over", index, child.process.poll())
                child.close(0.5)
                child = self._children[index] = _Child(index)
            return child

    async def call(self, op: str, stream: int, payload: object) -> object:
        future = asyncio.get_running_loop().create_future()
        self._child(stream).submit(next(self._requests), op, stream, payload, future)
        return await future

    async def ready(self, timeout_s: float = 30.0) -> None:
        """Wait until every child has started (its imports take ~0.15 s: a session opened before would
        wait that long for its first frame)."""
        await asyncio.wait_for(asyncio.gather(*(self.call("ping", index, None)
                                                for index in range(len(self._children)))), timeout_s)

    def forget(self, stream: int) -> None:
        """The stream's state goes in its child (no answer awaited)."""
        with self._lock:
            child = None if self._closed else self._children[stream % len(self._children)]
        if child is not None and child.alive:
            child.submit(0, "close", stream, None, None)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for child in self._children:
            child.close()


class OpusStream:
    """One session's Opus: Ogg/Opus bytes in -> float32 PCM, PCM frames out -> Ogg/Opus bytes."""

    def __init__(self, pool: CodecPool, stream: int) -> None:
        self._pool, self.id = pool, stream

    async def decode(self, data: bytes) -> np.ndarray:
        """PCM of whatever whole Ogg pages `data` completes; ProtocolError on corrupt audio."""
        return np.frombuffer(await self._pool.call("decode", self.id, bytes(data)), np.float32)

    async def encode(self, pcm: np.ndarray) -> bytes:
        return await self._pool.call("encode", self.id, np.asarray(pcm, dtype=np.float32).tobytes())

    def close(self) -> None:
        self._pool.forget(self.id)


if __name__ == "__main__":  # a child of CodecPool: the socket's file descriptor is the argument
    _serve(Connection(int(sys.argv[1])))
