"""The request router of `kame serve --ray`: a new session goes to the replica that holds the fewest.

Serve's default router ("power of two choices") compares two random replicas by queue lengths it
caches, and the cache lags for seconds after sessions end: it could send a session to a full
replica while another had room, where the session was refused busy. Sessions are few and long,
so this router can afford to ask every replica for its live count of ongoing requests (one small
RPC each, answered by the replica at once) each time it places one, and rank them by it. Its own
placements of the last moment count too (from the moment it ranks, before the session even
reaches the replica), so that sessions arriving together spread out instead of all taking the
same free replica before its count catches up.

Ranking, not filtering: a replica whose slots are all taken stays last in the order, so when every
replica is full the session still reaches one, whose app refuses it with its own 503 at once.

It runs inside Serve's proxy (and any deployment handle), so it imports nothing of the project.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

PROBE_DEADLINE_S = 1.0  # a replica that does not answer this fast ranks last
RECENT_S = 2.0  # a send this recent may not be in the replica's count yet: count it too


class FewestSessionsRouter(FIFOMixin, RequestRouter):
    """Ranks every replica by its live ongoing requests plus this router's very recent sends."""

    def initialize_state(self, recent_s: float = RECENT_S, probe_deadline_s: float = PROBE_DEADLINE_S,
                         **_: object) -> None:
        self.recent_s, self.probe_deadline_s = recent_s, probe_deadline_s
        self._sent: dict[ReplicaID, deque[float]] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        counts = await asyncio.gather(*(self._ongoing(r) for r in candidate_replicas))
        now = time.monotonic()
        load = {r.replica_id: count + self._recent(r.replica_id, now)
                for r, count in zip(candidate_replicas, counts, strict=True)}
        ranked = sorted(candidate_replicas, key=lambda r: (load[r.replica_id], random.random()))
        # counted at once (no await between here and the next ranking's reading of it): requests
        # ranked together see each other
        self._sent.setdefault(ranked[0].replica_id, deque()).append(now)
        return [[r] for r in ranked]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self._sent.pop(replica_id, None)
        super().on_replica_actor_died(replica_id)

    async def _ongoing(self, replica: RunningReplica) -> float:
        """The replica's ongoing requests now; infinity when it cannot say in time."""
        try:
            return await asyncio.wait_for(replica.get_queue_len(deadline_s=self.probe_deadline_s),
                                          self.probe_deadline_s)
        except Exception:  # slow, restarting or gone: rank it last, Serve's own checks handle the rest
            return float("inf")

    def _recent(self, replica_id: ReplicaID, now: float) -> int:
        sent = self._sent.get(replica_id)
        if not sent:
            return 0
        while sent and now - sent[0] > self.recent_s:
            sent.popleft()
        return len(sent)
