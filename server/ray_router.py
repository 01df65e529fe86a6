"""The request router of `kame serve --ray`: a new session goes to the replica that holds the fewest.

Serve's default router ("power of two choices") compares two random replicas by queue lengths it
caches, and the cache lags for seconds after sessions end: it could send a session to a full
replica while another had room, where the session was refused busy. Sessions are few and long,
so this router can afford to ask every replica for its live count of ongoing requests (one small
RPC each, answered by the replica at once) each time it places one. It also keeps its own count
of what it sent each replica: from the moment it ranks a replica first (before the request even
reaches it) until the replica turns the request down or the request ends. A replica's load is the
larger of the two: its own count is exact for this router's requests, sent or held, so sessions
arriving together spread out; the live count adds what other routers (other nodes' proxies) sent.
Adding the two instead counted a request twice once the replica held it, and a burst of sessions
opened just as a cluster became ready was refused although a replica had room.

Ranking, not filtering: a replica whose slots are all taken stays last in the order, so when every
replica is full the session still reaches one, whose app refuses it with its own 503 at once.

It runs inside Serve's proxy (and any deployment handle), so it imports nothing of the project.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import deque

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

PROBE_DEADLINE_S = 1.0  # a replica that does not answer this fast is ranked by this router's own count
FORGET_S = 10.0  # a placement its replica has not answered this long is forgotten (an answer lost); a
# loaded machine's replica may take seconds to answer, and a placement forgotten before then no longer
# spreads a burst


class Placements:
    """This router's requests on one replica: placed (ranked first, the replica's answer not back
    yet) and held (the replica took them; they have not ended)."""

    def __init__(self, forget_s: float = FORGET_S) -> None:
        self.forget_s = forget_s
        self._unanswered: deque[float] = deque()  # when each was placed, oldest first
        self.held = 0

    def placed(self, now: float) -> None:
        self._unanswered.append(now)

    def answered(self) -> None:
        """The replica took or turned down the oldest placement (a taken one is `took` next)."""
        if self._unanswered:
            self._unanswered.popleft()

    def took(self) -> None:
        self.held += 1

    def ended(self) -> None:
        self.held = max(0, self.held - 1)

    def count(self, now: float) -> int:
        while self._unanswered and now - self._unanswered[0] > self.forget_s:
            self._unanswered.popleft()
        return len(self._unanswered) + self.held


class FewestSessionsRouter(FIFOMixin, RequestRouter):
    """Ranks every replica by the larger of its live ongoing requests and this router's own count."""

    def initialize_state(self, forget_s: float = FORGET_S, probe_deadline_s: float = PROBE_DEADLINE_S,
                         **_: object) -> None:
        self.forget_s, self.probe_deadline_s = forget_s, probe_deadline_s
        self._placements: dict[ReplicaID, Placements] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        counts = await asyncio.gather(*(self._ongoing(r) for r in candidate_replicas))
        now = time.monotonic()
        # a replica that did not answer in time is ranked by this router's own count (exact for what this
        # proxy sent it), after one that answered with as few: on a loaded machine a probe runs out of time
        # now and then, and ranking such a replica after every one that answered put a burst of sessions on
        # a full replica while the silent one had room (refused busy). A replica that died is not lost
        # time: Serve retries the request elsewhere (ActorDiedError) and drops it from the candidates.
        load = {}
        for replica, count in zip(candidate_replicas, counts, strict=True):
            own = self._of(replica.replica_id).count(now)
            load[replica.replica_id] = (own, True) if count is None else (max(count, own), False)
        ranked = sorted(candidate_replicas, key=lambda r: (*load[r.replica_id], random.random()))
        # counted at once (no await between here and the next ranking's reading of it): requests
        # ranked together see each other
        self._of(ranked[0].replica_id).placed(now)
        return [[r] for r in ranked]

    def on_new_queue_len_info(self, replica_id: ReplicaID, queue_len_info) -> None:
        """The replica's answer to a request sent to it (taken or turned down)."""
        self._of(replica_id).answered()
        super().on_new_queue_len_info(replica_id, queue_len_info)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        """The replica took the request: it is held until it ends (a websocket: until it closes)."""
        placements = self._of(replica_id)
        placements.took()
        result.add_done_callback(_on_loop(asyncio.get_running_loop(), placements.ended))
        super().on_request_routed(pending_request, replica_id, result)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self._placements.pop(replica_id, None)
        super().on_replica_actor_died(replica_id)

    def _of(self, replica_id: ReplicaID) -> Placements:
        return self._placements.setdefault(replica_id, Placements(self.forget_s))

    async def _ongoing(self, replica: RunningReplica) -> int | None:
        """The replica's ongoing requests now; None when it cannot say in time."""
        try:
            return await asyncio.wait_for(replica.get_queue_len(deadline_s=self.probe_deadline_s),
                                          self.probe_deadline_s)
        except Exception:  # slow, restarting or gone: ranked by this router's count; Serve retries a dead one
            return None


def _on_loop(loop: asyncio.AbstractEventLoop, call) -> object:
    """A done callback (Ray calls it from a thread of its own) that runs `call()` on the router's loop."""
    def callback(_: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: the proxy is gone, nothing to count
            loop.call_soon_threadsafe(call)
    return callback
