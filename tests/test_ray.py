"""`kame serve --ray` on a real local Ray instance: 2 replicas x 2 slots of tiny-copy behind Serve's
proxy. Sessions land on both replicas and each hears its own frames back; a fifth is refused at once
with the app's own 503; /healthz answers while every slot is held; a replica scaled away keeps its
session until the session ends."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import numpy as np
import pytest

pytest.importorskip("ray.serve", reason="needs the ray extra: pip install -e '.[ray]'")

from client.client import AudioMessage, EventMessage, KameClient, ServerBusy, send_paced
from server import ray_serve
from server.settings import load_settings

from .server_harness import free_port, wait_until

pytestmark = pytest.mark.slow
FRAMES = 25


@pytest.fixture(scope="module")
def cluster():
    port = free_port()
    settings = load_settings(None, frontend="tiny-copy", device="cpu", asr="none", llm="local", max_sessions=2,
                             port=port, engine_threads=1)
    started = time.monotonic()
    ray_serve.start(settings, ray_serve.RayOptions(replicas=2, local_cpus=4, num_cpus=0.5), cuda=False)
    print(f"local Ray + 2 replicas up in {time.monotonic() - started:.1f} s")
    yield settings, f"ws://127.0.0.1:{port}/api/chat", f"http://127.0.0.1:{port}"
    ray_serve.stop()


class Talker:
    """A session that streams silence in real time and counts the frames that come back."""

    def __init__(self, client: KameClient) -> None:
        self.client, self.back, self.replica = client, 0, None
        self.task = asyncio.ensure_future(self._receive())

    @classmethod
    async def open(cls, url: str) -> Talker:
        return cls(await KameClient.connect(url, events=True, open_timeout=20))

    async def _receive(self) -> None:
        async for message in self.client:
            if isinstance(message, AudioMessage):
                self.back += 1
            elif isinstance(message, EventMessage) and message.event.type == "ready":
                self.replica = message.event.replica

    async def talk(self, frames: int = FRAMES) -> None:
        """`frames` of silence at real-time pace, then wait for them to come back."""
        self.sent = getattr(self, "sent", 0) + frames
        await send_paced(self.client.send_pcm, np.zeros(1920 * frames, np.float32))
        await wait_until(lambda: self.back >= self.sent, f"{self.sent} frames back", 10)

    async def close(self) -> None:
        await self.client.close()
        await self.task


def healthz(base: str) -> dict:
    return json.loads(urllib.request.urlopen(f"{base}/healthz", timeout=10).read())


def test_sessions_spread_over_replicas_and_a_fifth_is_refused_at_once(cluster):
    settings, url, base = cluster

    async def go():
        talkers = [await Talker.open(url) for _ in range(4)]
        await asyncio.gather(*(t.talk(5) for t in talkers))  # the ready events have come
        refused_in = time.monotonic()
        with pytest.raises(ServerBusy) as busy:
            await KameClient.connect(url, events=True, open_timeout=20)
        refused_in = time.monotonic() - refused_in
        # every slot held: the headroom answers, and lists both replicas, full
        await wait_until(lambda: [r["free_slots"] for r in healthz(base)["replicas"]] == [0, 0],
                         "/healthz listing two full replicas", 15)
        health = await asyncio.to_thread(healthz, base)
        metrics = await asyncio.to_thread(lambda: urllib.request.urlopen(f"{base}/metrics", timeout=10).read())
        await asyncio.gather(*(t.talk() for t in talkers))
        for t in talkers:
            await t.close()
        return talkers, busy.value, refused_in, health, metrics

    talkers, busy, refused_in, health, metrics = asyncio.run(go())
    replicas = [t.replica for t in talkers]
    assert len(set(replicas)) == 2 and sorted(replicas.count(r) for r in set(replicas)) == [2, 2]
    assert all(t.back >= 5 + FRAMES for t in talkers)  # each heard every frame it sent, back
    assert "busy" in str(busy) and refused_in < 5  # the app's own 503, not Ray's 500 or its queue
    assert health["status"] == "ready" and health["replica"] in replicas and health["free_slots"] == 0
    assert {r["replica"] for r in health["replicas"]} == set(replicas)
    assert all(r["max_sessions"] == 2 and r["sessions"] == 2 for r in health["replicas"])
    # /metrics through the proxy: the whole cluster's, each sample labelled with its replica
    from prometheus_client.parser import text_string_to_metric_families

    active = {s.labels["replica"]: s.value for family in text_string_to_metric_families(metrics.decode())
              if family.name == "kame_active_sessions" for s in family.samples}
    assert active == {replica: 2.0 for replica in set(replicas)}


def test_a_replica_scaled_away_keeps_its_session_until_it_ends(cluster):
    settings, url, base = cluster

    async def go():
        # one session on each replica. Serve's router picks by its cached queue lengths, which lag:
        # it may send a session to the full replica while the other has room (refused: busy), and a
        # client's retry lands elsewhere (docs/scaling.md)
        # (after the last test's sessions ended, its cache can still say a replica is busy for seconds)
        talkers: dict[str, Talker] = {}
        deadline = time.monotonic() + 40
        while len(talkers) < 2 and time.monotonic() < deadline:
            try:
                talker = await Talker.open(url)
            except ServerBusy:
                await asyncio.sleep(1.0)
                continue
            await talker.talk(5)
            if talker.replica in talkers:
                await talker.close()
                await asyncio.sleep(1.0)  # for the router's view to catch up
            else:
                talkers[talker.replica] = talker
        talkers = list(talkers.values())
        # down to one replica while both replicas hold a session: serve.run returns once the update is
        # done, and the replica going away waits for its session first
        from ray import serve

        def states() -> dict:
            app = serve.status().applications[ray_serve.APP_NAME]
            return dict(app.deployments[ray_serve.APP_NAME].replica_states)

        options = ray_serve.RayOptions(replicas=1, num_cpus=0.5)
        update = asyncio.ensure_future(asyncio.to_thread(
            serve.run, ray_serve.deployment(settings, options, False), name=ray_serve.APP_NAME, route_prefix="/"))
        during = asyncio.ensure_future(asyncio.gather(*(t.talk() for t in talkers)))  # 2 s more for each
        await wait_until(lambda: states().get("STOPPING", 0) == 1, "a replica being scaled away", 30)
        stopping_while_talking = not during.done()
        await during
        backs = [t.back for t in talkers]
        assert not update.done()  # the replica going away still holds its session
        for t in talkers:
            await t.close()
        await asyncio.wait_for(update, 60)
        replicas = states()
        assert stopping_while_talking
        return talkers, backs, replicas

    talkers, backs, replicas = asyncio.run(go())
    assert len({t.replica for t in talkers}) == 2
    assert all(back >= 5 + FRAMES for back in backs)  # none was cut off by the downscale
    assert replicas == {"RUNNING": 1}  # and once they ended, the replica went


def test_stopping_tells_every_session_like_the_single_server(cluster):
    """What SIGTERM of `kame serve --ray` does (last in this module: the cluster is gone after it)."""
    settings, url, base = cluster

    async def go():
        talker = await Talker.open(url)
        await talker.talk(5)
        stopping = asyncio.ensure_future(asyncio.to_thread(ray_serve.stop, 10.0))
        await asyncio.wait_for(talker.task, 20)  # the server closes it
        code, reason = talker.client.close_code, talker.client.ws.close_reason
        await stopping
        return code, reason

    code, reason = asyncio.run(go())
    assert code == 1001 and "shutting down" in reason



@pytest.mark.parametrize(("flags", "message"), [
    (["--replicas", "2"], "go with --ray"),
    (["--ray", "--replicas", "2", "--autoscale", "1,2"], "not both"),
    (["--ray", "--autoscale", "three"], "two whole numbers"),
    (["--ray", "--autoscale", "3,1"], "MIN <= MAX"),
])
def test_ray_flags_are_checked_with_one_line(flags, message, capsys):
    from kame.cli import main

    assert main(["serve", "--asr", "none", *flags]) == 2
    assert message in capsys.readouterr().err
