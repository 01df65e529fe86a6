"""What crosses the fronts of `kame serve --fronts N` (server/fronts.py), in a front's app: its plan, connections
per address in shared memory, `/metrics` merged from every front's, a sideband relayed to the front that holds it."""

from __future__ import annotations

import contextlib
import logging
import zlib
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ADDRESS_BUCKETS = 4096  # per-address connection counts: addresses hash into this many (a collision shares a count)
RELAYED = "x-kame-relayed"  # a sideband relayed by another front: never relayed again


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
