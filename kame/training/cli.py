"""`kame data prepare|oracles|tokenize`: the data stages of training, one at a time, on a run folder."""

from __future__ import annotations

import argparse
from pathlib import Path

from kame.errors import KameError
from kame.flags import add_device_flag, add_frontend_flag
from kame.training.runfiles import ORACLE_STRATEGIES

CUSTOM_PROFILE = "custom"


def register_data(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="training data: prepare dialogues, simulate oracles, make token files")
    stages = data.add_subparsers(dest="stage", required=True)

    prepare = stages.add_parser("prepare", help="two-channel dialogue WAVs -> RUN/prepared/*.json (word timings)")
    prepare.add_argument("--data", required=True, help="folder of NAME.wav (left user, right assistant), each "
                                                        "with an optional NAME.json of word timings")
    _add_run(prepare)
    prepare.add_argument("--asr-model", default=None, help="Whisper model for files without timings "
                                                           "(default: the bundled tiny.en)")
    add_device_flag(prepare, what="Whisper's device: ")
    prepare.add_argument("--workers", type=int, default=None,
                         help="Whisper processes (default: one per core up to 4 on a CPU, one on a GPU)")
    prepare.set_defaults(func=_cmd_prepare)

    oracles = stages.add_parser("oracles", help="RUN/prepared -> RUN/oracles/*.json (simulated oracle events)")
    _add_run(oracles)
    oracles.add_argument("--strategy", default=None, choices=ORACLE_STRATEGIES,
                         help="random: other turns' replies, the true one last; llm: an LLM with growing hints "
                              "(default: llm when --llm is given, else random)")
    oracles.add_argument("--llm", default=None, metavar="PROFILE",
                         help="with --strategy llm: the backend profile (openai, anthropic, gemini, local, embedded)")
    oracles.add_argument("--llm-base-url", default=None, help="with --llm-model: an ad-hoc OpenAI-compatible endpoint")
    oracles.add_argument("--llm-model", default=None)
    oracles.add_argument("--llm-api-key-env", default=None, help="env var holding its key (default: none)")
    oracles.add_argument("--seed", type=int, default=0)
    oracles.add_argument("--concurrency", type=int, default=4, help="LLM requests at once (default 4)")
    oracles.set_defaults(func=_cmd_oracles)

    tokenize = stages.add_parser("tokenize", help="RUN/prepared + RUN/oracles -> RUN/tokens/*.safetensors")
    _add_run(tokenize)
    add_frontend_flag(tokenize, base=True, required=True)
    add_device_flag(tokenize)
    tokenize.add_argument("--quantize", default=None, choices=["int8"], help="int8 LM weights (CUDA only)")
    tokenize.set_defaults(func=_cmd_tokenize)


def _add_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, type=Path, help="the run folder every stage writes under")


def _report(stage: str, paths: list[Path], where: Path) -> int:
    print(f"{stage}: {len(paths)} dialogue(s) in {where}")
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    from kame.training.dialogues import prepare

    paths = prepare(Path(args.data), args.run, asr_model=args.asr_model, device=args.device,
                    workers=args.workers)
    return _report("prepared", paths, args.run / "prepared")


def _cmd_oracles(args: argparse.Namespace) -> int:
    from kame.backend.profiles import DEFAULT_PROFILES, BackendProfile
    from kame.training.oracles import simulate

    if (args.llm_base_url is None) != (args.llm_model is None):
        raise KameError("--llm-base-url and --llm-model go together")
    profiles, name = dict(DEFAULT_PROFILES), args.llm
    if args.llm_model is not None:
        if args.llm is not None:
            raise KameError("--llm or --llm-base-url/--llm-model: one or the other")
        profiles[CUSTOM_PROFILE] = BackendProfile(CUSTOM_PROFILE, args.llm_base_url, args.llm_model,
                                                  args.llm_api_key_env)
        name = CUSTOM_PROFILE
    strategy = args.strategy or ("llm" if name is not None else "random")
    if strategy == "random" and name is not None:
        raise KameError("--llm goes with --strategy llm")
    paths = simulate(args.run, strategy=strategy, llm=name, seed=args.seed, concurrency=args.concurrency,
                     profiles=profiles)
    return _report("oracles", paths, args.run / "oracles")


def _cmd_tokenize(args: argparse.Namespace) -> int:
    from kame.training.tokens import tokenize

    paths = tokenize(args.run, frontend=args.frontend, device=args.device, quantize=args.quantize)
    return _report("tokens", paths, args.run / "tokens")
