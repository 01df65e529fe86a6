"""The request router of `kame serve --ray`, without a Ray instance: its own count of what it sent
each replica (driven here as Serve's router drives it: rank, send, the replica's answer, the
request's end)."""

from __future__ import annotations

import asyncio
import threading

import pytest


def test_placements_count_from_the_ranking_to_the_end():
    pytest.importorskip("ray.serve")
    from server.ray_router import Placements

    placements = Placements(forget_s=2.0)
    placements.placed(0.0)
    assert placements.count(0.1) == 1  # on its way
    placements.answered()
    placements.took()
    assert placements.count(0.2) == 1  # held
    placements.ended()
    placements.ended()  # a second end (never below zero)
    assert placements.count(0.3) == 0
    placements.placed(1.0)
    placements.answered()  # turned down: the replica was full
    assert placements.count(1.1) == 0
    placements.placed(2.0)  # an answer that never comes
    assert placements.count(3.9) == 1 and placements.count(4.1) == 0


class FakeReplica:
    """A replica as the router sees it: its live count, which holds a request once it has arrived."""

    def __init__(self, name: str, ongoing: int = 0) -> None:
        self.replica_id, self.ongoing, self.taken = name, ongoing, 0

    async def get_queue_len(self, deadline_s: float) -> int:
        return self.ongoing


class FakeResult:
    """A request's result: Ray calls the done callbacks from a thread of its own."""

    def __init__(self) -> None:
        self.callbacks: list = []

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def end(self) -> None:
        thread = threading.Thread(target=lambda: [callback(None) for callback in self.callbacks])
        thread.start()
        thread.join()


def make_router():
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from server.ray_router import FewestSessionsRouter

    router = FewestSessionsRouter(DeploymentID(name="kame", app_name="kame"), DeploymentHandleSource.PROXY)
    router.initialize_state()
    return router


async def place(router, replicas: list[FakeReplica], travel_s: float) -> tuple[FakeReplica, FakeResult]:
    """One request, as Serve's router handles it: rank, send to the first, the replica's answer."""
    from ray.serve._private.common import ReplicaQueueLengthInfo

    chosen = (await router.choose_replicas(replicas))[0][0]
    await asyncio.sleep(travel_s)  # on its way: the replica's count does not hold it yet
    chosen.ongoing += 1
    chosen.taken += 1
    router.on_new_queue_len_info(chosen.replica_id, ReplicaQueueLengthInfo(True, chosen.ongoing))
    result = FakeResult()
    router.on_request_routed(None, chosen.replica_id, result)
    return chosen, result


@pytest.mark.parametrize("travel_s", [0.0, 0.01])
@pytest.mark.parametrize("phantom", [0, 1])
def test_a_burst_fills_every_slot_once(travel_s, phantom):
    """Four sessions at once onto two empty replicas land 2 + 2, whether the replicas' counts lag
    (requests on their way) or have caught up, and with a request the router did not send still in
    one count (a /healthz just answered): counting a request both live and as sent, as the router
    did, sent three to one replica, and the third was refused although the other had a free slot."""
    pytest.importorskip("ray.serve")

    async def go():
        for _ in range(20):  # ties are broken at random
            router, replicas = make_router(), [FakeReplica("a", phantom), FakeReplica("b")]
            await asyncio.gather(*(place(router, replicas, travel_s) for _ in range(4)))
            assert sorted(r.taken for r in replicas) == [2, 2]

    asyncio.run(go())


def test_slots_freed_by_ended_sessions_are_filled_next():
    pytest.importorskip("ray.serve")

    async def go():
        router, replicas = make_router(), [FakeReplica("a"), FakeReplica("b")]
        held = [await place(router, replicas, 0.0) for _ in range(4)]
        for replica, result in held:
            if replica.replica_id == "a":
                replica.ongoing -= 1
                result.end()
        await asyncio.sleep(0.01)  # the ends reach the router's loop
        after = [await place(router, replicas, 0.0) for _ in range(2)]
        return [replica.replica_id for replica, _ in after]

    assert asyncio.run(go()) == ["a", "a"]
