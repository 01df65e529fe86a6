"""`kame serve --ray`: the same app on Ray Serve, one replica = one engine process (one GPU).

Ray Serve proxies HTTP and websockets to the replicas of one deployment whose ingress is the
app `create_app` builds (inside each replica: the builder runs there, and so does the app's
lifespan, which loads and warms the models). `max_ongoing_requests` counts a websocket for its
whole life, so it is each replica's slots plus `HEADROOM`: the router sends a new session to a
replica with room, and a replica whose slots are all taken still takes a few requests, so that a
session beyond them is refused at once with the app's own HTTP 503 (not Ray's bare 500, not a
wait in Ray's queue) and `/healthz`, `/metrics` and the page still answer.

Readiness is Serve's own: a replica is RUNNING (routable) only once its constructor, which runs the
app's lifespan to its end, and its first `check_health` are done; `/healthz` says ready when the
deployment has as many RUNNING replicas as it wants (`readiness`), and 503 while fewer are warm.

A fixed count is changed with `scale` (Serve's external scaling API), which keeps the running replicas
and their sessions: Ray 2.60 dropped the deployment `version` that once made a `serve.run` of a new
count a light update, and now replaces every replica. Checked with Ray 2.60: docs/scaling.md.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from server.metrics import merge_metrics
from server.settings import ServerSettings

logger = logging.getLogger(__name__)

HEADROOM = 4  # requests a replica takes beyond its slots: refusals, /healthz, /metrics, the page
APP_NAME = "kame"
REGISTRY = "kame-registry"  # the named actor where replicas report their free slots ...
NAMESPACE = "kame"  # ... in a namespace of its own (Serve's replicas run in "serve")
REPORT_S = 1.0  # how often a replica reports (and looks for a drain)


class Registry:
    """A small Ray actor for what Serve does not know: each replica's last figures (free slots,
    sessions) and metric families, and the drain flag that SIGTERM of `kame serve --ray` sets so that
    every replica tells its sessions, as one server would. Which replicas exist is Serve's to say:
    a reader passes the replica ids Serve's controller lists (`live`), and a replica Serve no longer
    lists is forgotten; without them (the controller did not answer), every replica that reported."""

    def __init__(self) -> None:
        self.replicas: dict[str, dict] = {}
        self.families: dict[str, list] = {}  # replica -> its prometheus_client metric families
        self.draining = False

    def report(self, replica: str, figures: dict, families: list | None = None) -> bool:
        """A replica's figures and its metric families (`registry.collect()`); the answer: drain?"""
        self.replicas[replica] = figures | {"replica": replica}
        self.families[replica] = families or []
        return self.draining

    def snapshot(self, live: list[str] | None = None) -> list[dict]:
        return [self.replicas[name] for name in self._live(live)]

    def metrics_text(self, live: list[str] | None = None) -> bytes:
        """Every live replica's metrics in one exposition, each sample labelled with its replica."""
        return merge_metrics({name: self.families[name] for name in self._live(live)})

    def _live(self, live: list[str] | None) -> list[str]:
        if live is None:
            return sorted(self.replicas)
        for name in set(self.replicas) - set(live):  # gone from Serve: dead, or stopped
            del self.replicas[name], self.families[name]
        return sorted(self.replicas)

    def drain(self) -> None:
        self.draining = True


_registry = None  # the driver's handle of the Registry actor


def readiness(deployment: dict | None) -> dict:
    """The cluster's readiness from Serve's details of the deployment (the controller's
    `get_serve_instance_details()`: `target_num_replicas`, `deployment_config`, `replicas`).

    Warm replicas are the RUNNING ones: Serve marks a replica RUNNING only after its constructor,
    which runs the app's lifespan (models loaded and warmed), so only those take sessions. Wanted:
    Serve's target for a fixed count (`--replicas N`: N); with autoscaling its `min_replicas` (or
    the target, when lower), so that a scale-up, during which the warm replicas serve on, does not
    mark the whole endpoint unready for the minute a new replica loads."""
    if deployment is None:
        return {"status": "unknown", "warm_replicas": None, "wanted_replicas": None}
    wanted = deployment["target_num_replicas"]
    autoscaling = (deployment.get("deployment_config") or {}).get("autoscaling_config")
    if autoscaling:
        wanted = min(wanted, autoscaling.get("min_replicas", 1))
    warm = sum(1 for replica in deployment.get("replicas", []) if replica.get("state") == "RUNNING")
    return {"status": "ready" if warm >= wanted else "warming", "warm_replicas": warm, "wanted_replicas": wanted}


class Replica:
    """The deployment's class around the app: Serve calls `check_health` after the constructor, before
    the replica is RUNNING (routable), then every `health_check_period_s`; a replica whose app has not
    finished its start-up fails it, so it never takes a session (`self.app`: serve.ingress's wrapper)."""

    def check_health(self) -> None:
        if not getattr(self.app.state, "warm", False):
            raise RuntimeError("the app's start-up (loading and warming the models) has not finished")


def deployment_details(details: dict, app_name: str, deployment: str) -> dict | None:
    """The deployment's part of Serve's controller's `get_serve_instance_details()` (one small RPC,
    the one `serve.status()` makes too; docs/scaling.md has its time); None: not deployed."""
    app = details.get("applications", {}).get(app_name) or {}
    return app.get("deployments", {}).get(deployment)


def replica_ids(deployment: dict | None) -> list[str] | None:
    """The replicas Serve lists for the deployment, in any state (starting, running, stopping with
    sessions to finish), by the id each replica names itself with; None: unknown."""
    if deployment is None:
        return None
    return [replica["replica_id"] for replica in deployment.get("replicas", [])]


@dataclass(frozen=True)
class RayOptions:
    replicas: int = 1  # fixed replicas, or:
    autoscale: tuple[int, int] | None = None  # (min, max) replicas, scaled on held sessions
    upscale_delay_s: float = 30.0  # with autoscale: how long the load must stay high / low ...
    downscale_delay_s: float = 600.0  # ... before a replica is added / taken away (Serve's defaults)
    address: str | None = None  # a running Ray cluster ("auto", "ray://..."); None: start a local one
    num_cpus: float = 1.0  # per replica on a CPU
    local_cpus: int | None = None  # the local instance's CPUs (None: the machine's)


def slots_of(settings: ServerSettings, cuda: bool) -> int:
    from kame.runtime import default_max_sessions

    return default_max_sessions(settings.max_sessions, cuda)


def build_app(settings: ServerSettings):
    """The ingress builder: runs in each replica, where it names the replica in the settings."""
    import ray
    from ray import serve
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    from server.app import create_app

    context = serve.get_replica_context()
    replica = context.replica_id.unique_id if context is not None else "local"
    # behind the proxy every client has the proxy's address: the per-address limit would count them
    # all as one (Ray Serve passes no client address on)
    settings = settings.model_copy(update={"replica": replica, "max_connections_per_ip": 1_000_000})
    registry = ray.get_actor(REGISTRY, namespace=NAMESPACE)
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)

    def on_ready(app) -> None:
        app.state.warm = True  # Replica.check_health
        app.state.reporter = asyncio.get_running_loop().create_task(_report(app, replica, registry))

    async def serve_details() -> dict | None:
        """The deployment as Serve's controller describes it; None when it does not answer in time."""
        try:
            details = await asyncio.wait_for(controller.get_serve_instance_details.remote(), 2.0)
        except Exception as exc:  # Serve's controller gone or slow: readiness cannot be told
            logger.warning("Serve's controller did not answer: %s", exc)
            return None
        return deployment_details(details, context.app_name, context.deployment)

    async def cluster() -> dict:
        """/healthz: the cluster's readiness (its "status" makes a 503 unless ready), and the figures
        of the replicas Serve lists, from the registry."""
        deployment = await serve_details()
        try:
            replicas = await asyncio.wait_for(registry.snapshot.remote(replica_ids(deployment)), 2.0)
        except Exception as exc:  # the registry gone or slow: this replica's own health still answers
            logger.warning("the replica registry did not answer: %s", exc)
            replicas = None
        return readiness(deployment) | {"replicas": replicas}

    async def cluster_metrics() -> bytes:
        deployment = await serve_details()
        try:
            return await asyncio.wait_for(registry.metrics_text.remote(replica_ids(deployment)), 2.0)
        except Exception as exc:
            logger.warning("the replica registry did not answer: %s", exc)
            return b"# the cluster's figures are unavailable: the registry did not answer\n"

    return create_app(settings, on_ready=on_ready, health_extra=cluster, metrics_source=cluster_metrics)


async def _report(app, replica: str, registry) -> None:
    """Every REPORT_S: this replica's free slots and metric families to the registry; when it says
    drain, drain."""
    drained = False
    while True:
        services = app.state.services
        figures = {"free_slots": services.runtime.runner.free_slots,
                   "max_sessions": services.runtime.engine.batch_size, "sessions": len(app.state.sessions)}
        try:
            families = list(services.metrics.registry.collect())
            if await registry.report.remote(replica, figures, families) and not drained:
                drained = True
                logger.info("replica %s: the server is stopping, telling its sessions", replica)
                await app.state.drain()
        except Exception as exc:  # keep serving sessions whatever happens to the registry
            logger.warning("replica %s could not report: %s", replica, exc)
        await asyncio.sleep(REPORT_S)


def deployment(settings: ServerSettings, options: RayOptions, cuda: bool):
    """The Serve application: replicas of the app, sized by the engine's slots."""
    from ray import serve

    slots = slots_of(settings, cuda)
    scaling: dict = {"num_replicas": options.replicas}
    if options.autoscale is not None:
        low, high = options.autoscale
        # held sessions are ongoing requests: scale to keep each replica at most ~3/4 full
        scaling = {"autoscaling_config": {"min_replicas": low, "max_replicas": high,
                                          "target_ongoing_requests": max(1, int(slots * 0.75)),
                                          "upscale_delay_s": options.upscale_delay_s,
                                          "downscale_delay_s": options.downscale_delay_s}}
    actor = {"num_gpus": 1} if cuda else {"num_cpus": options.num_cpus}

    def builder():
        return build_app(settings)

    return serve.deployment(
        serve.ingress(builder)(Replica), name=APP_NAME, max_ongoing_requests=slots + HEADROOM,
        ray_actor_options=actor,
        # a new session goes to the replica with the fewest, by a live count (server/ray_router.py)
        request_router_config={"request_router_class": "server.ray_router.FewestSessionsRouter"},
        # a replica going away waits for its sessions: up to the longest a session may last
        graceful_shutdown_timeout_s=settings.max_session_s + settings.shutdown_timeout_s,
        **scaling,
    ).bind()


def start(settings: ServerSettings, options: RayOptions, cuda: bool) -> None:
    """Connect to (or start) Ray, start Serve's proxy on the settings' host and port, deploy."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address=options.address, num_cpus=options.local_cpus if options.address is None else None,
                 include_dashboard=False, log_to_driver=False)
    global _registry  # held here: an actor nobody holds a handle to is collected
    _registry = ray.remote(num_cpus=0)(Registry).options(name=REGISTRY, namespace=NAMESPACE,
                                                        get_if_exists=True).remote()
    start_proxy(lambda: serve.start(http_options={"host": settings.host, "port": settings.port}))
    run(settings, options, cuda)
    logger.info("ready on Ray Serve: ws://%s:%d/api/chat and /v1/realtime, %s", settings.host, settings.port,
                f"{options.autoscale[0]}-{options.autoscale[1]} replicas (autoscaling)" if options.autoscale
                else f"{options.replicas} replicas")


def start_proxy(start: Callable[[], object], attempts: int = 3) -> None:
    """`serve.start`, again when the proxy it waited on was replaced: Serve's controller gives a new proxy
    RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S (5 s) to say it is ready, then replaces it with one given longer,
    and `serve.start` was waiting on the first (ActorDiedError: "killed by ray.kill"); on a loaded machine
    the first can take longer than that to start (seen in a clean-clone test run with a CPU hog beside it).
    Called again, `serve.start` joins the running controller, whose new proxy is on its way."""
    from ray.exceptions import RayActorError

    for attempt in range(1, attempts + 1):
        try:
            start()
            return
        except RayActorError as exc:
            if attempt == attempts:
                raise
            logger.warning("Serve's proxy was replaced while it started (%s); waiting for the next one",
                           str(exc).splitlines()[0])


def run(settings: ServerSettings, options: RayOptions, cuda: bool) -> None:
    """Deploy (or redeploy, which replaces every replica) the application; a fixed count takes `scale`
    later (Serve's external scaler: it and Serve's autoscaling exclude each other)."""
    from ray import serve

    serve.run(deployment(settings, options, cuda), name=APP_NAME, route_prefix="/",
              external_scaler_enabled=options.autoscale is None)


def scale(replicas: int) -> None:
    """A fixed-count deployment to `replicas`, returning once Serve's controller took the target: the
    running replicas stay, and one scaled away keeps its sessions until they end (up to its
    graceful_shutdown_timeout_s) before it stops."""
    import ray
    from ray.serve._private.common import DeploymentID

    controller = _controller()
    if controller is None:
        raise RuntimeError("Serve's controller cannot be found: is the application deployed from here?")
    ray.get(controller.update_deployment_replicas.remote(DeploymentID(name=APP_NAME, app_name=APP_NAME), replicas))


def stop(drain_s: float | None = None) -> None:
    """Stop like the single server: every replica tells its sessions the server is stopping and gives
    them `drain_s` (default: the settings' shutdown_timeout_s, known to the replicas) to end; then the
    application, Serve and Ray go."""
    import time

    import ray
    from ray import serve

    if not ray.is_initialized():
        return  # stopped already
    try:  # the handle this driver holds: looking the actor up again can hang while Ray stops
        registry = _registry or ray.get_actor(REGISTRY, namespace=NAMESPACE)
        ray.get(registry.drain.remote(), timeout=5)
        deadline = time.monotonic() + (drain_s if drain_s is not None else 15.0)
        controller = _controller()
        while (left := deadline - time.monotonic()) > 0 and _sessions_held(registry, controller, min(5.0, left)):
            time.sleep(0.2)
    except Exception as exc:  # Ray itself going away: stop what is left
        logger.warning("could not drain through the registry: %s", exc)
    serve.delete(APP_NAME)
    serve.shutdown()
    _forget_registry()
    ray.shutdown()


def _controller():
    """Serve's controller, by the handle the driver's Serve client holds (serve.start made it); None:
    none."""
    from ray.serve.context import _get_global_client

    try:
        client = _get_global_client(raise_if_no_controller_running=False)
    except Exception as exc:
        logger.warning("Serve's controller cannot be found: %s", exc)
        return None
    return None if client is None else client._controller


def _sessions_held(registry, controller, timeout_s: float) -> int:
    """The sessions that the replicas Serve lists still hold, by the registry's figures; when the
    controller is gone or does not answer within `timeout_s`, those of every replica that reported
    (a replica that died meanwhile then counts until the deadline: stop() waits no longer than that)."""
    import ray

    live = None
    if controller is not None:
        try:
            details = ray.get(controller.get_serve_instance_details.remote(), timeout=timeout_s)
            live = replica_ids(deployment_details(details, APP_NAME, APP_NAME))
        except Exception as exc:
            logger.warning("Serve's controller did not answer: %s", exc)
    return sum(replica["sessions"] for replica in ray.get(registry.snapshot.remote(live), timeout=timeout_s))


def _forget_registry() -> None:
    global _registry
    _registry = None


def serve_until_signalled(settings: ServerSettings, options: RayOptions, cuda: bool) -> int:
    """`kame serve --ray`: run until SIGINT/SIGTERM, then drain like the single server."""
    done = threading.Event()
    start(settings, options, cuda)
    for signum in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs handlers of its own
        signal.signal(signum, lambda *_: done.set())
    done.wait()
    logger.info("stopping: sessions are told and given time to end")
    stop(settings.shutdown_timeout_s + 2 * REPORT_S)
    return 0


def app(args: dict):
    """The application builder for `serve deploy` and KubeRay (deploy/ray/serve.yaml): `args` are
    {"config": TOML path (optional), "replicas": N | "autoscale": [MIN, MAX], with autoscale optionally
    "upscale_delay_s" and "downscale_delay_s"}; the rest of the settings
    come from the config file and KAME_* variables, as for `kame serve`."""
    import ray

    from kame.frontend.loader import resolve_device
    from server.settings import load_settings

    settings = load_settings(args.get("config"))
    autoscale = tuple(args["autoscale"]) if args.get("autoscale") else None
    delays = {key: float(args[key]) for key in ("upscale_delay_s", "downscale_delay_s") if key in args}
    options = RayOptions(replicas=int(args.get("replicas", 1)), autoscale=autoscale, **delays)
    if ray.is_initialized():  # no driver holds the registry here: it lives on its own
        ray.remote(num_cpus=0)(Registry).options(name=REGISTRY, namespace=NAMESPACE, get_if_exists=True,
                                                 lifetime="detached").remote()
    return deployment(settings, options, cuda=resolve_device(settings.device).type == "cuda")
