"""`kame serve`: registered into the `kame` command through the `kame.commands` entry point."""

from __future__ import annotations

import argparse
import logging
import signal
import warnings

logger = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run the websocket server")
    serve.add_argument("--config", default=None, help="TOML config file (see configs/default.toml)")
    serve.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default 8998)")
    serve.add_argument("--frontend", default=None,
                       help="preset, local directory or HF repo (default: SakanaAI/kame with a GPU, tiny-copy without)")
    serve.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"])
    serve.add_argument("--quantize", default=None, choices=["none", "int8"],
                       help="int8: the front-end LM's weights in int8 through bitsandbytes (CUDA only; about half "
                            "the memory of bf16, see docs/benchmarks.md); default none")
    serve.add_argument("--max-sessions", type=int, default=None, help="session slots (default: 4 on CPU, 32 on GPU)")
    serve.add_argument("--fronts", type=int, default=None, metavar="N",
                       help="N front processes (the sockets, codecs, ASR feeds and planners) sharing one engine "
                            "process (the model and its batch) behind one port: past ~48 sessions on a GPU, one "
                            "front per 48 (docs/scaling.md); default 0: one process for everything")
    serve.add_argument("--kv-cache", default=None, choices=["auto", "model", "int8"],
                       help="the LM's KV cache: int8 holds half the bytes of bf16 (docs/benchmarks.md); auto (the "
                            "default): the model's dtype where --max-sessions of it fit on the GPU, else int8")
    serve.add_argument("--asr", default=None, choices=["whisper", "kyutai-stt", "none"])
    serve.add_argument("--asr-model", default=None)
    serve.add_argument("--end-of-turn", default=None, choices=["smart-turn", "silence"],
                       help="what ends a user's turn with the whisper ASR: smart-turn, a model that judges each "
                            "pause (the default where pipecat-ai is installed), or silence, 0.6 s of it "
                            "(docs/turn-taking.md)")
    serve.add_argument("--llm", default=None, metavar="PROFILE",
                       help="sessions' default LLM backend profile: openai, anthropic, gemini, local, embedded, or one "
                            "of the config's [profiles.NAME] (default: openai with OPENAI_API_KEY set, else embedded)")
    serve.add_argument("--llm-base-url", default=None, help="an ad-hoc OpenAI-compatible endpoint ...")
    serve.add_argument("--llm-model", default=None, help="... and its model (together: profile 'custom')")
    serve.add_argument("--llm-api-key-env", default=None, help="env var holding its key (default OPENAI_API_KEY)")
    serve.add_argument("--knowledge", default=None, metavar="DIR",
                       help="answer from the documents in DIR (.txt, .md, .html, .pdf): indexed at start-up, "
                            "re-indexed when they change and on SIGHUP ([knowledge] in the config)")
    serve.add_argument("--record", default=None, metavar="DIR",
                       help="keep each session's audio and events in DIR (stores users' voices: off by default)")
    serve.add_argument("--auth-token", action="append", default=None, metavar="TOKEN",
                       help="accept clients with this bearer token (repeatable); required off loopback")
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
    from server.app import DrainingServer, create_app
    from server.services import Services
    from server.settings import load_settings

    settings = load_settings(
        args.config, host=args.host, port=args.port, frontend=args.frontend, device=args.device,
        quantize=args.quantize, max_sessions=args.max_sessions, kv_cache=args.kv_cache, fronts=args.fronts,
        asr=args.asr, asr_model=args.asr_model, llm=args.llm, end_of_turn=args.end_of_turn,
        llm_base_url=args.llm_base_url, llm_model=args.llm_model, llm_api_key_env=args.llm_api_key_env,
        auth_tokens=args.auth_token, record_dir=args.record, knowledge_dir=args.knowledge)
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


def uvicorn_config(app, settings):
    """uvicorn's settings for the app (one process, or each front process)."""
    import uvicorn

    # uvicorn's legacy websockets implementation: its sans-io successor logs a spurious error after
    # the HTTP 503 denial response that refuses a session when all slots are busy
    warnings.filterwarnings("ignore", message=".*websockets.* implementation is deprecated")
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info", ws="websockets",
                          lifespan="on",
                          # no permessage-deflate: Opus does not compress, and deflating every
                          # frame cost both ends CPU (it showed in the host-side profile)
                          ws_per_message_deflate=False,
                          # Realtime events carry audio as base64 (4/3 the bytes); a frame up
                          # to 4x that gets a clear error event, beyond it the socket closes
                          ws_max_size=4 * (settings.max_message_bytes * 4 // 3 + 4096))


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

