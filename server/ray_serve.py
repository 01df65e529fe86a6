"""`kame serve --ray`: the same app on Ray Serve, one replica = one engine process (one GPU).

Ray Serve proxies HTTP and websockets to the replicas of one deployment whose ingress is the
app `create_app` builds (inside each replica: the builder runs there, and so does the app's
lifespan, which loads and warms the models). `max_ongoing_requests` counts a websocket for its
whole life, so it is each replica's slots plus `HEADROOM`: the router sends a new session to a
replica with room, and a replica whose slots are all taken still takes a few requests, so that a
session beyond them is refused at once with the app's own HTTP 503 (not Ray's bare 500, not a
wait in Ray's queue) and `/healthz`, `/metrics` and the page still answer.

Checked with Ray 2.53 (the newest whose `serve` extra installs beside moshi's aiohttp pin; it
needs protobuf < 7): docs/scaling.md.
"""

from __future__ import annotations

import hashlib
import logging
import signal
import threading
from dataclasses import dataclass

from server.settings import ServerSettings

logger = logging.getLogger(__name__)

HEADROOM = 4  # requests a replica takes beyond its slots: refusals, /healthz, /metrics, the page
APP_NAME = "kame"


@dataclass(frozen=True)
class RayOptions:
    replicas: int = 1  # fixed replicas, or:
    autoscale: tuple[int, int] | None = None  # (min, max) replicas, scaled on held sessions
    address: str | None = None  # a running Ray cluster ("auto", "ray://..."); None: start a local one
    num_cpus: float = 1.0  # per replica on a CPU
    local_cpus: int | None = None  # the local instance's CPUs (None: the machine's)


def slots_of(settings: ServerSettings, cuda: bool) -> int:
    return settings.max_sessions or (32 if cuda else 4)


def build_app(settings: ServerSettings):
    """The ingress builder: runs in each replica, where it names the replica in the settings."""
    from ray import serve

    from server.app import create_app

    context = serve.get_replica_context()
    replica = context.replica_id.unique_id if context is not None else "local"
    # behind the proxy every client has the proxy's address: the per-address limit would count them
    # all as one (Ray Serve passes no client address on)
    settings = settings.model_copy(update={"replica": replica, "max_connections_per_ip": 1_000_000})
    return create_app(settings)


def deployment(settings: ServerSettings, options: RayOptions, cuda: bool):
    """The Serve application: replicas of the app, sized by the engine's slots."""
    from ray import serve

    slots = slots_of(settings, cuda)
    scaling: dict = {"num_replicas": options.replicas}
    if options.autoscale is not None:
        low, high = options.autoscale
        # held sessions are ongoing requests: scale to keep each replica at most ~3/4 full
        scaling = {"autoscaling_config": {"min_replicas": low, "max_replicas": high,
                                          "target_ongoing_requests": max(1, int(slots * 0.75))}}
    actor = {"num_gpus": 1} if cuda else {"num_cpus": options.num_cpus}

    def builder():
        return build_app(settings)

    # a fixed version: a change of the replica count (a downscale, `serve deploy` of the same code)
    # is then a light update that keeps the running replicas and their sessions
    version = hashlib.sha256(settings.model_dump_json().encode()).hexdigest()[:16]
    return serve.deployment(
        serve.ingress(builder)(), name=APP_NAME, version=version, max_ongoing_requests=slots + HEADROOM,
        ray_actor_options=actor,
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
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(deployment(settings, options, cuda), name=APP_NAME, route_prefix="/")
    logger.info("ready on Ray Serve: ws://%s:%d/api/chat and /v1/realtime, %s", settings.host, settings.port,
                f"{options.autoscale[0]}-{options.autoscale[1]} replicas (autoscaling)" if options.autoscale
                else f"{options.replicas} replicas")


def stop() -> None:
    """Remove the application (each replica waits for its sessions, then drains), then Serve and Ray."""
    import ray
    from ray import serve

    serve.delete(APP_NAME)
    serve.shutdown()
    ray.shutdown()


def serve_until_signalled(settings: ServerSettings, options: RayOptions, cuda: bool) -> int:
    """`kame serve --ray`: run until SIGINT/SIGTERM, then drain like the single server."""
    done = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: done.set())
    start(settings, options, cuda)
    done.wait()
    logger.info("stopping: sessions are told and given time to end")
    stop()
    return 0
