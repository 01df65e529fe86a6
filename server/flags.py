"""The command-line flags that set server settings, each declared once: `kame serve` and `kame doctor` take the
same ones (doctor says what serve would do with them). A flag names the setting it sets, and its choices and type
are the setting's: tests/test_flags.py checks them against the settings schema (`ServerSettings`), which this
module does not import (it imports torch, and `kame` registers its commands without it)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kame.flags import DEVICE_HELP, FRONTEND_HELP


@dataclass(frozen=True)
class Flag:
    name: str  # --name
    setting: str  # the ServerSettings field (a load_settings key: end_of_turn and knowledge_dir are folded in)
    help: str = ""
    metavar: str | None = None
    choices: tuple[str, ...] | None = None  # the setting's Literal values
    type: type | None = None  # int for an int setting
    repeat: bool = False  # given again, it adds (a list setting)


MODEL_FLAGS = (
    Flag("frontend", "frontend", FRONTEND_HELP),  # the words of every command's --frontend (kame/flags.py)
    Flag("device", "device", DEVICE_HELP, choices=("auto", "cpu", "cuda")),
    Flag(
        "quantize",
        "quantize",
        choices=("none", "int8"),
        help="int8: the front-end LM's weights in int8 through bitsandbytes (CUDA only; about "
        "half the memory of bf16, see docs/benchmarks.md); default none",
    ),
    Flag("max-sessions", "max_sessions", "session slots (default: 4 on CPU, 32 on GPU)", type=int),
    Flag(
        "kv-cache",
        "kv_cache",
        choices=("auto", "model", "int8"),
        help="the LM's KV cache: int8 holds half the bytes of bf16 (docs/benchmarks.md); auto (the "
        "default): the model's dtype where --max-sessions of it fit on the GPU, else int8",
    ),
    Flag("asr", "asr", choices=("whisper", "kyutai-stt", "none")),
    Flag("asr-model", "asr_model"),
    Flag(
        "end-of-turn",
        "end_of_turn",
        choices=("smart-turn", "silence"),
        help="what ends a user's turn with the whisper ASR: smart-turn, a model that judges "
        "each pause (the default where pipecat-ai is installed), or silence, 0.6 s of "
        "it (docs/turn-taking.md)",
    ),
    Flag(
        "llm",
        "llm",
        "sessions' default LLM backend profile: openai, anthropic, gemini, local, embedded, or one of "
        "the config's [profiles.NAME] (default: openai with OPENAI_API_KEY set, else embedded)",
        metavar="PROFILE",
    ),
    Flag("llm-base-url", "llm_base_url", "an ad-hoc OpenAI-compatible endpoint ..."),
    Flag("llm-model", "llm_model", "... and its model (together: profile 'custom')"),
    Flag("llm-api-key-env", "llm_api_key_env", "env var holding its key (default OPENAI_API_KEY; '' for none)"),
)
SERVE_FLAGS = (
    Flag("host", "host", "bind address (default 127.0.0.1)"),
    Flag("port", "port", "port (default 8998)", type=int),
    *MODEL_FLAGS,
    Flag(
        "fronts",
        "fronts",
        "N front processes (the sockets, codecs, ASR feeds and planners) sharing one engine "
        "process (the model and its batch) behind one port: past ~48 sessions on a GPU, one "
        "front per 48 (docs/scaling.md); default 0: one process for everything",
        metavar="N",
        type=int,
    ),
    Flag(
        "knowledge",
        "knowledge_dir",
        "answer from the documents in DIR (.txt, .md, .html, .pdf): indexed at "
        "start-up, re-indexed when they change and on SIGHUP ([knowledge] in the config)",
        metavar="DIR",
    ),
    Flag(
        "sip",
        "sip_listen",
        "answer SIP calls on HOST:PORT (UDP and TCP): a softphone, a PBX or a SIP trunk calls KAME; from "
        "loopback only unless [sip] allow_from says more ([sip] in the config, docs/telephony.md)",
        metavar="HOST:PORT",
    ),
    Flag(
        "record",
        "record_dir",
        "keep each session's audio and events in DIR (stores users' voices: off by default)",
        metavar="DIR",
    ),
    Flag(
        "auth-token",
        "auth_tokens",
        "accept clients with this bearer token (repeatable); required off loopback",
        metavar="TOKEN",
        repeat=True,
    ),
)


def add_flags(parser: argparse.ArgumentParser, flags: tuple[Flag, ...]) -> None:
    """Each flag with the choices and type of the setting it sets; every default None (the settings decide)."""
    for flag in flags:
        kwargs: dict = {"default": None, "help": flag.help or None, "metavar": flag.metavar, "dest": flag.setting}
        if flag.repeat:
            kwargs["action"] = "append"
        if flag.choices:
            kwargs["choices"] = list(flag.choices)
        if flag.type is not None:
            kwargs["type"] = flag.type
        parser.add_argument(f"--{flag.name}", **kwargs)


def given(args: argparse.Namespace, flags: tuple[Flag, ...]) -> dict[str, object]:
    """The settings the flags set, as `load_settings` takes them (flags not given: None, ignored there)."""
    return {flag.setting: getattr(args, flag.setting) for flag in flags}
