"""`kame serve`: registered into the `kame` command through the `kame.commands` entry point."""

from __future__ import annotations

import argparse
import logging
import signal

logger = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    from server.flags import SERVE_FLAGS, add_flags

    serve = sub.add_parser("serve", help="run the websocket server")
    serve.add_argument("--config", default=None, help="TOML config file (see configs/default.toml)")
    add_flags(serve, SERVE_FLAGS)
    ray = serve.add_argument_group("Ray Serve", "--ray: one engine replica per GPU behind one endpoint "
                                   "(pip install -e '.[ray]'; docs/scaling.md)")
    ray.add_argument("--ray", action="store_true", help="serve on Ray Serve; every other flag means what it "
                     "means without it, per replica (--max-sessions: slots per replica)")
    ray.add_argument("--replicas", type=int, default=None, help="engine replicas (default 1)")
    ray.add_argument("--autoscale", default=None, metavar="MIN,MAX", help="autoscale between MIN and MAX replicas "
                     "on held sessions, instead of --replicas")
    ray.add_argument("--ray-address", default=None, help="a running Ray cluster (default: start a local one)")
    serve.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from server.app import DrainingServer, create_app, uvicorn_config
    from server.flags import SERVE_FLAGS, given
    from server.services import Services
    from server.settings import load_settings

    settings = load_settings(args.config, **given(args, SERVE_FLAGS))
    if args.ray or args.replicas or args.autoscale or args.ray_address:
        if settings.fronts:
            from kame.errors import KameError

            raise KameError("--fronts is for one machine's server; with --ray, each replica is one process")
        return _run_ray(args, settings)
    if settings.fronts:
        from server.fronts import serve_with_fronts

        return serve_with_fronts(settings, settings.fronts, verbose=getattr(args, "verbose", False))
    services = Services.start(settings)  # load and warm everything before the port opens
    try:
        server = DrainingServer(uvicorn_config(create_app(settings, services), settings))
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal: let both end
        # here as a KeyboardInterrupt, so that the models are released and the exit code is 0
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            server.run()
        except KeyboardInterrupt:
            logger.info("stopped by a signal")
        return 0 if server.started else 1
    finally:
        services.runtime.close()  # the LLM clients were closed on the server's loop


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _run_ray(args: argparse.Namespace, settings) -> int:
    from kame.errors import KameError

    if not args.ray:
        raise KameError("--replicas, --autoscale and --ray-address go with --ray")
    if args.replicas is not None and args.autoscale is not None:
        raise KameError("--replicas or --autoscale, not both")
    autoscale = None
    if args.autoscale is not None:
        try:
            low, high = (int(x) for x in args.autoscale.split(","))
        except ValueError as exc:
            raise KameError(f"--autoscale is MIN,MAX, two whole numbers, not {args.autoscale!r}") from exc
        if not 0 <= low <= high or high < 1:
            raise KameError(f"--autoscale needs 0 <= MIN <= MAX and MAX >= 1, not {args.autoscale!r}")
        autoscale = (low, high)
    if args.replicas is not None and args.replicas < 1:
        raise KameError("--replicas must be at least 1")
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise KameError("--ray needs Ray Serve: pip install -e '.[ray]'") from exc
    from kame.frontend.loader import resolve_device
    from server.ray_serve import RayOptions, serve_until_signalled

    cuda = resolve_device(settings.device).type == "cuda"
    options = RayOptions(replicas=args.replicas or 1, autoscale=autoscale, address=args.ray_address)
    return serve_until_signalled(settings, options, cuda)

