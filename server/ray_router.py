"""The request router of `kame serve --ray`: a new session goes to the replica that holds the fewest.

Serve's default router ("power of two choices") compares two random replicas by queue lengths it
caches, and the cache lags for seconds after sessions end: it could send a session to a full
replica while another had room, where the session was refused busy. Sessions are few and long,
so this router can afford to ask every replica for its live count of ongoing requests (one small
RPC each, answered by the replica at once) each time it places one.

It also keeps its own count, per request: a request is *bound* to the replica this router chose
for it, from that moment (before the request even reaches the replica) until the replica took it
(then it is *held* there until it ends), or the request was chosen a replica again (a retry), or
it ended. A replica's load is the larger of its live count and this router's count: this router's
count is exact for what it sent, so sessions arriving together spread out; the live count adds what
other routers (other nodes' proxies) sent.

Two things in Serve 2.60's routing (ray/serve/_private/request_router/request_router.py) decide how
this must be built, and each put three sessions of a burst of four on one replica of two, the third
refused busy while the other replica had a free slot:
- With `FIFOMixin`, the replica a routing task chose goes to the oldest request waiting, not to the
  request it was chosen for; that request's task then goes on to the next replica of its ranking, a
  choice this router never counted. Without the mixin, Serve gives a task's choice to that task's
  own request (matched by its internal id), so a binding names the replica its request goes to.
- Serve checks a chosen replica against its own cache of queue lengths and, where that has no fresh
  entry, probes it again with a 0.1 s deadline; on a loaded machine that runs out and Serve moves on
  to the next replica ranked. So only one replica is offered per ranking (a failed check ranks
  again, rebinding the request), and the load this router chose it by goes into Serve's cache, as
  Serve's own probe's answer does, so the check reads it instead of probing again.

Ranking, not filtering: when every replica is full the session still goes to one (the least
loaded), whose app refuses it with its own 503 at once, never a wait in Serve's queue.

It runs inside Serve's proxy (and any deployment handle), so it imports nothing of the project.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

PROBE_DEADLINE_S = 1.0  # a replica that does not answer this fast is ranked by this router's own count
FORGET_S = 30.0  # a binding whose request was neither taken nor ended this long is forgotten (its routing
# was cancelled: the client went away); well beyond a loaded replica's answer, which can take seconds


class Bookings:
    """This router's requests by replica: bound (chosen for a request that has not reached it, or whose
    answer is not back) and held (the replica took them; they have not ended)."""

    def __init__(self, forget_s: float = FORGET_S) -> None:
        self.forget_s = forget_s
        self._bound: dict[str, tuple[ReplicaID, float]] = {}  # request id -> (replica, when chosen)
        self._held: dict[ReplicaID, set[str]] = {}  # replica -> the ids of the requests it holds

    def bind(self, request: str, replica: ReplicaID, now: float) -> None:
        """The replica chosen for the request (again: its earlier choice no longer counts)."""
        self._bound[request] = (replica, now)

    def took(self, request: str, replica: ReplicaID) -> None:
        self._bound.pop(request, None)
        self._held.setdefault(replica, set()).add(request)

    def ended(self, request: str, replica: ReplicaID) -> None:
        """The request ended on the replica (or was sent there and turned down): a binding to another
        replica, made by a retry meanwhile, stays."""
        if self._bound.get(request, (None,))[0] == replica:
            del self._bound[request]
        self._held.get(replica, set()).discard(request)

    def forget(self, replica: ReplicaID) -> None:
        """A replica that died: nothing it was given counts any more."""
        self._held.pop(replica, None)
        for request in [r for r, (bound, _) in self._bound.items() if bound == replica]:
            del self._bound[request]

    def counts(self, now: float, leave_out: str | None = None) -> Counter:
        """Each replica's bound and held requests (less `leave_out`, the request being placed)."""
        for request in [r for r, (_, when) in self._bound.items() if now - when > self.forget_s]:
            del self._bound[request]
        counts = Counter({replica: len(held) for replica, held in self._held.items()})
        counts.update(replica for request, (replica, _) in self._bound.items() if request != leave_out)
        return counts


class FewestSessionsRouter(RequestRouter):
    """Offers the replica with the least load: the larger of its live ongoing requests and this router's
    own count of what it sent there."""

    def initialize_state(self, forget_s: float = FORGET_S, probe_deadline_s: float = PROBE_DEADLINE_S,
                         **_: object) -> None:
        self.probe_deadline_s = probe_deadline_s
        self.bookings = Bookings(forget_s)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        live = await asyncio.gather(*(self._ongoing(r) for r in candidate_replicas))
        # no await from here to Serve's check of the replica offered: requests ranked together see each other
        now, request = time.monotonic(), _request_id(pending_request)
        own = self.bookings.counts(now, leave_out=request)
        # a replica that did not answer in time is ranked by this router's own count (exact for what this
        # proxy sent it), after one that answered with as few. A replica that died is not lost time: Serve
        # retries the request elsewhere (ActorDiedError) and drops it from the candidates.
        load = {r.replica_id: (own[r.replica_id], True) if count is None else (max(count, own[r.replica_id]), False)
                for r, count in zip(candidate_replicas, live, strict=True)}
        best = min(candidate_replicas, key=lambda r: (*load[r.replica_id], random.random()))
        if request is not None:
            self.bookings.bind(request, best.replica_id, now)
            # a round whose replica Serve finds at its limit (every slot and the headroom in use) waits Serve's
            # backoff before the next, rather than probing every replica again at once, round after round
            pending_request.routing_context.should_backoff = True
        # the load it was chosen by goes into Serve's cache, as Serve's own probe's answer would: Serve's check
        # of the replica reads it instead of probing again (a replica silent to this probe is silent to that)
        self.replica_queue_len_cache.update(best.replica_id, load[best.replica_id][0])
        return [[best]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        """The replica took the request: it is held until it ends (a websocket: until it closes)."""
        request = _request_id(pending_request)
        if request is not None:
            self.bookings.took(request, replica_id)
            result.add_done_callback(_on_loop(asyncio.get_running_loop(),
                                              lambda: self.bookings.ended(request, replica_id)))
        super().on_request_routed(pending_request, replica_id, result)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Every request sent ends here too, the ones turned down included (Serve cancels them)."""
        self.bookings.ended(internal_request_id, replica_id)
        super().on_request_completed(replica_id, internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self.bookings.forget(replica_id)
        super().on_replica_actor_died(replica_id)

    async def _ongoing(self, replica: RunningReplica) -> int | None:
        """The replica's ongoing requests now; None when it cannot say in time."""
        try:
            return await asyncio.wait_for(replica.get_queue_len(deadline_s=self.probe_deadline_s),
                                          self.probe_deadline_s)
        except Exception:  # slow, restarting or gone: ranked by this router's count; Serve retries a dead one
            return None


def _request_id(pending_request: PendingRequest | None) -> str | None:
    """The id Serve matches a routing task's choice to its request by (unique per request)."""
    return None if pending_request is None else pending_request.metadata.internal_request_id


def _on_loop(loop: asyncio.AbstractEventLoop, call) -> object:
    """A done callback (Ray calls it from a thread of its own) that runs `call()` on the router's loop."""
    def callback(_: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: the proxy is gone, nothing to count
            loop.call_soon_threadsafe(call)
    return callback
