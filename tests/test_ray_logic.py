"""The pure logic of `kame serve --ray`, without a Ray instance: the cluster's readiness from Serve's
details of the deployment, the registry's figures and metrics of the replicas Serve lists, and the
request router's own count of what it sent each replica (driven here as Serve's router drives it:
rank, send, the replica's answer, the request's end)."""

from __future__ import annotations

import asyncio
import pickle
import threading

import pytest

from server.metrics import merge_metrics
from server.ray_serve import Registry, readiness, replica_ids


def details(states: list[str], target: int, autoscaling: dict | None = None) -> dict:
    """A deployment as Serve's controller describes it (`get_serve_instance_details()`), cut down."""
    config = {"name": "kame"} | ({"autoscaling_config": autoscaling} if autoscaling else {"num_replicas": target})
    return {"name": "kame", "status": "HEALTHY", "target_num_replicas": target, "deployment_config": config,
            "replicas": [{"replica_id": f"r{i}", "state": state} for i, state in enumerate(states)]}


def test_a_fixed_count_is_ready_only_once_every_replica_runs():
    assert readiness(details([], 2)) == {"status": "warming", "warm_replicas": 0, "wanted_replicas": 2}
    assert readiness(details(["RUNNING", "STARTING"], 2)) == {"status": "warming", "warm_replicas": 1,
                                                              "wanted_replicas": 2}
    assert readiness(details(["RUNNING", "RUNNING"], 2)) == {"status": "ready", "warm_replicas": 2,
                                                             "wanted_replicas": 2}


def test_replicas_stopping_or_recovering_are_not_warm():
    # one replaced (the dead one recovering, its replacement starting): warming until it is warm
    assert readiness(details(["RUNNING", "RECOVERING"], 2))["status"] == "warming"
    # scaled down from 2 to 1: the one going away drains its sessions, the other is enough
    assert readiness(details(["RUNNING", "STOPPING"], 1)) == {"status": "ready", "warm_replicas": 1,
                                                              "wanted_replicas": 1}


def test_autoscaling_wants_its_minimum_warm():
    scaling = {"min_replicas": 1, "max_replicas": 4}
    # a scale-up under way: the warm replica serves on, the endpoint stays ready
    assert readiness(details(["RUNNING", "STARTING"], 2, scaling)) == {"status": "ready", "warm_replicas": 1,
                                                                       "wanted_replicas": 1}
    assert readiness(details(["STARTING", "STARTING"], 2, {"min_replicas": 2}))["status"] == "warming"
    # a target below the minimum (Serve's target_capacity): the target
    assert readiness(details(["RUNNING"], 1, {"min_replicas": 2}))["wanted_replicas"] == 1


def test_no_details_is_unknown():
    assert readiness(None) == {"status": "unknown", "warm_replicas": None, "wanted_replicas": None}


# the registry: the figures and metrics of the replicas Serve lists

def test_the_registry_lists_the_replicas_serve_lists_and_forgets_the_others():
    registry = Registry()
    for name, sessions in (("a", 2), ("b", 1)):
        assert registry.report(name, {"free_slots": 2 - sessions, "max_sessions": 2, "sessions": sessions}) is False
    # Serve's controller did not answer: every replica that reported
    assert [r["replica"] for r in registry.snapshot(None)] == ["a", "b"]
    # Serve lists "b" (dead, or stopped) no more, and "c" (starting) has not reported yet
    assert registry.snapshot(["a", "c"]) == [{"free_slots": 0, "max_sessions": 2, "sessions": 2, "replica": "a"}]
    assert [r["replica"] for r in registry.snapshot(None)] == ["a"]  # forgotten
    registry.drain()
    assert registry.report("a", {"free_slots": 2, "max_sessions": 2, "sessions": 0}) is True


def test_replica_ids_are_every_replica_serve_lists():
    assert replica_ids(details(["RUNNING", "STOPPING", "STARTING"], 2)) == ["r0", "r1", "r2"]
    assert replica_ids(details([], 1)) == []
    assert replica_ids(None) is None


def test_the_cluster_metrics_are_each_family_once_with_every_replica_labelled():
    """What /metrics through the proxy answers: the families each replica's registry collects (sent
    to the registry actor pickled, as Ray sends them), each sample labelled with its replica."""
    from prometheus_client.parser import text_string_to_metric_families

    from server.metrics import Metrics

    replicas = {"a": Metrics(), "b": Metrics()}
    for sessions, metrics in enumerate(replicas.values(), start=1):
        metrics.active_sessions.set(sessions)
        metrics.sessions_total.inc(sessions * 3)
        metrics.frames_dropped.labels("in").inc(sessions)
        metrics.frame_latency.observe(0.015)
    registry = Registry()
    for name, metrics in replicas.items():
        registry.report(name, {}, pickle.loads(pickle.dumps(list(metrics.registry.collect()))))
    text = registry.metrics_text(["a", "b"]).decode()
    assert text.count("# TYPE kame_active_sessions gauge") == 1
    assert text.count("# HELP kame_frame_latency_seconds ") == 1
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def values(family: str, sample: str, **labels) -> dict:
        return {s.labels["replica"]: s.value for s in families[family].samples
                if s.name == sample and labels.items() <= s.labels.items()}

    assert values("kame_active_sessions", "kame_active_sessions") == {"a": 1.0, "b": 2.0}
    assert values("kame_sessions", "kame_sessions_total") == {"a": 3.0, "b": 6.0}
    assert values("kame_frames_dropped", "kame_frames_dropped_total", direction="in") == {"a": 1.0, "b": 2.0}
    assert values("kame_frame_latency_seconds", "kame_frame_latency_seconds_bucket", le="0.02") == {"a": 1.0, "b": 1.0}
    assert values("kame_frame_latency_seconds", "kame_frame_latency_seconds_count") == {"a": 1.0, "b": 1.0}
    # every sample of every family, the process's own included, names its replica
    assert all(s.labels.get("replica") in ("a", "b") for f in families.values() for s in f.samples)
    # each replica's own exposition, less the label, is in the cluster's
    own = {(s.name, tuple(sorted(s.labels.items())), s.value)
           for f in text_string_to_metric_families(replicas["b"].render().decode()) for s in f.samples}
    merged_b = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "replica")), s.value)
                for f in families.values() for s in f.samples if s.labels["replica"] == "b"}
    assert {x for x in own if not x[0].startswith("process_")} <= merged_b


def test_no_replica_is_an_empty_exposition():
    assert merge_metrics({}) == b""


class _Actor:
    """An actor handle's stand-in: `handle.method.remote(*args)` is a call that `ray.get` makes."""

    def __init__(self, **methods) -> None:
        for name, method in methods.items():
            setattr(self, name, type("Method", (), {"remote": staticmethod(lambda *a, m=method: lambda: m(*a))}))


def test_the_drain_counts_the_sessions_of_the_replicas_serve_lists(monkeypatch):
    """stop()'s drain waits while the replicas Serve lists hold sessions; with Serve's controller gone
    or silent, while any replica that reported does (its deadline still bounds the wait)."""
    import ray

    from server.ray_serve import APP_NAME, _sessions_held

    registry = Registry()
    for name, sessions in (("a", 1), ("b", 2)):
        registry.report(name, {"sessions": sessions})
    handle = _Actor(snapshot=registry.snapshot)

    def silent():
        raise TimeoutError("no answer")

    listed = {"applications": {APP_NAME: {"deployments": {APP_NAME: {"replicas": [{"replica_id": "b"}]}}}}}
    monkeypatch.setattr(ray, "get", lambda call, timeout=None: call())
    assert _sessions_held(handle, None, 1.0) == 3  # no controller
    assert _sessions_held(handle, _Actor(get_serve_instance_details=silent), 1.0) == 3
    assert _sessions_held(handle, _Actor(get_serve_instance_details=lambda: listed), 1.0) == 2  # "a" is gone
    assert [r["replica"] for r in registry.snapshot(None)] == ["b"]


# the router

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
    """A replica as the router sees it: its live count, which holds a request once it has arrived (or a
    probe that runs out of time: a loaded machine)."""

    def __init__(self, name: str, ongoing: int = 0, silent: bool = False) -> None:
        self.replica_id, self.ongoing, self.taken, self.silent = name, ongoing, 0, silent

    async def get_queue_len(self, deadline_s: float) -> int:
        if self.silent:
            raise TimeoutError
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


def test_a_burst_spreads_by_the_routers_own_count_when_probes_run_out_of_time():
    """On a loaded machine a probe may run out of time: such a replica ranks by this router's own count
    (all silent, they ranked alike and four sessions at once were placed at random; one silent beside one
    that answered, the silent one ranked last and the answering one took three of four, refused busy); at
    equal counts the replica that answered goes first."""
    pytest.importorskip("ray.serve")

    async def go():
        for _ in range(20):  # ties are broken at random
            router, replicas = make_router(), [FakeReplica("a", silent=True), FakeReplica("b", silent=True)]
            await asyncio.gather(*(place(router, replicas, 0.01) for _ in range(4)))
            assert sorted(r.taken for r in replicas) == [2, 2]
            router, replicas = make_router(), [FakeReplica("a"), FakeReplica("b", silent=True)]
            await asyncio.gather(*(place(router, replicas, 0.01) for _ in range(4)))
            assert sorted(r.taken for r in replicas) == [2, 2]
        router = make_router()
        ranked = await router.choose_replicas([FakeReplica("slow", silent=True), FakeReplica("idle")])
        assert [group[0].replica_id for group in ranked] == ["idle", "slow"]
        ranked = await router.choose_replicas([FakeReplica("slow", silent=True), FakeReplica("busy", ongoing=1)])
        assert [group[0].replica_id for group in ranked] == ["slow", "busy"]

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
