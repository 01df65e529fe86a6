"""`--in-process` for `kame eval mtbench` and `kame replay`: the tandem runs in this process instead of
behind a server's websocket. The flags, the `Runtime` they describe, and the conversation source.

Torch loads only once a runtime is built, so the commands register without it.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from kame.backend.profiles import DEFAULT_PROFILES, BackendProfile
from kame.errors import KameError
from kame.flags import add_device_flag, add_frontend_flag

if TYPE_CHECKING:
    from kame.eval.harness import ConversationSource, Mode
    from kame.runtime import Runtime
    from kame.session import SessionConfig

CUSTOM = "custom"  # the profile --llm-base-url/--llm-model make, as in `kame infer`
_FLAGS = ("frontend", "device", "quantize", "asr", "llm_base_url", "llm_model", "llm_api_key_env")
T = TypeVar("T")


def add_in_process_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("in process", "--in-process: run the tandem here, no server (not with --url)")
    group.add_argument("--in-process", action="store_true", help="run the tandem session in this process")
    add_frontend_flag(group)
    add_device_flag(group, default=None)  # None: not given (check_in_process_args tells), auto in the runtime
    group.add_argument("--quantize", default=None, choices=["int8"],
                       help="int8: the front-end LM's weights in int8 through bitsandbytes (CUDA only)")
    group.add_argument("--asr", default=None, choices=["whisper", "kyutai-stt", "none"],
                       help="the session's streaming ASR (default: kyutai-stt on a GPU, whisper on a CPU)")
    group.add_argument("--llm-base-url", default=None, help=f"with --llm-model: an ad-hoc OpenAI-compatible "
                                                            f"endpoint, the profile named {CUSTOM!r}")
    group.add_argument("--llm-model", default=None)
    group.add_argument("--llm-api-key-env", default=None, help="env var holding its key (default: none)")


def check_in_process_args(args: argparse.Namespace, default_url: str) -> None:
    """--url or --in-process, never both; the in-process flags only with --in-process."""
    if not args.in_process:
        given = [f"--{name.replace('_', '-')}" for name in _FLAGS if getattr(args, name) is not None]
        if given:
            raise KameError(f"{', '.join(given)} go with --in-process (a server has its own)")
        args.url = args.url or default_url
        return
    if args.url is not None:
        raise KameError("--url or --in-process: one or the other")
    if (args.llm_base_url is None) != (args.llm_model is None):
        raise KameError("--llm-base-url and --llm-model go together")


def profiles_for(args: argparse.Namespace) -> dict[str, BackendProfile]:
    """The built-in profiles, plus the ad-hoc one from --llm-base-url/--llm-model."""
    profiles = dict(DEFAULT_PROFILES)
    if args.llm_model is not None:
        profiles[CUSTOM] = BackendProfile(CUSTOM, args.llm_base_url, args.llm_model, args.llm_api_key_env)
    return profiles


def start_runtime(args: argparse.Namespace, names: Sequence[str | None], realtime: bool,
                  asr_model: str | None = None, asr_options: dict | None = None) -> Runtime:
    """One engine slot, stepped as soon as a frame comes; the first named profile is the default;
    `asr_options`: the ASR engines' option overrides (RuntimeSettings.asr_options)."""
    from kame.runtime import Runtime, RuntimeSettings

    profiles = profiles_for(args)
    unknown = [n for n in names if n is not None and n not in profiles]
    if unknown:
        raise KameError(f"unknown LLM profile {unknown[0]!r}; known: {', '.join(profiles)}")
    default = next((n for n in names if n is not None), RuntimeSettings.default_profile)
    return Runtime.start(RuntimeSettings(frontend=args.frontend, device=args.device or "auto",
                                         quantize=getattr(args, "quantize", None), max_sessions=1,
                                         asr=args.asr, asr_model=asr_model, profiles=profiles, default_profile=default,
                                         asr_realtime=realtime, engine_clock="eager",
                                         asr_options=asr_options or {},
                                         voices_dir=getattr(args, "voice_prompt_dir", None)))


def run_in_process(runtime: Runtime, main: Callable[[], Awaitable[T]]) -> T:
    """Run `main()` on a new event loop, closing the LLM clients on it, then the runtime."""
    async def closing() -> T:
        try:
            return await main()
        finally:
            await runtime.aclose_llms()  # on the loop that used them

    try:
        return asyncio.run(closing())
    finally:
        runtime.close()


def session_config(mode: Mode, realtime: bool = True, system_prompt: str | None = None) -> SessionConfig:
    from kame.session import SessionConfig

    return SessionConfig(backend=mode.backend, system_prompt=system_prompt, asr=mode.asr,
                         oracle_delay_s=mode.oracle_delay_s or 0.0, realtime=realtime)


def in_process_source(runtime: Runtime, tail_s: float, realtime: bool = True,
                      system_prompt: str | None = None) -> ConversationSource:
    """Each question through a new session of `runtime`: its `ConversationLog`."""
    from kame.converse import converse_in_process

    async def source(pcm, mode: Mode):
        config = session_config(mode, realtime, system_prompt)
        return await converse_in_process(runtime, pcm, config, tail_s=tail_s, realtime=realtime)

    return source
