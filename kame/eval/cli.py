"""`kame eval mtbench`: spoken MT-Bench through a running server's websocket (`--url`, through
`client/`'s wire client), or a tandem session in this process (`--in-process`, `kame.eval.inprocess`).
The harness itself (modes, judge, resumable results, report) is `kame.eval.harness`; this module
turns the flags into its settings and gives it its conversation source.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from client.cli import DEFAULT_URL, add_llm_arg
from kame.errors import KameError
from kame.eval.inprocess import add_in_process_args, check_in_process_args

if TYPE_CHECKING:  # the harness loads the ASR and the judge's client: only when a run starts
    from kame.eval.harness import ConversationSource, EvalSettings, Mode


def register(sub: argparse._SubParsersAction) -> None:
    evaluate_ = sub.add_parser("eval", help="evaluations")
    evals = evaluate_.add_subparsers(dest="eval", required=True)
    mt = evals.add_parser("mtbench", help="spoken MT-Bench against a running server, or in this process")
    mt.add_argument("--url", default=None, help=f"the server's websocket (default {DEFAULT_URL})")
    mt.add_argument("--out", default="eval-out", help="folder for results.json, report.md, plot (default eval-out)")
    mt.add_argument("--categories", default="reasoning,stem,humanities")
    mt.add_argument("--limit", type=int, default=None, help="first N questions only")
    add_llm_arg(mt, "comma list of LLM profiles to compare: the server's, or with --in-process the built-in ones "
                    "and 'custom' (default: the server's default; in process 'custom' with --llm-model, else "
                    "embedded)", metavar="PROFILES")
    mt.add_argument("--no-baseline", action="store_true", help="skip the front-end alone (Moshi) mode")
    mt.add_argument("--delays", default="", help="oracle delay sweep in seconds, e.g. 0,0.5,1,2")
    mt.add_argument("--fast", action="store_true", help="stream as fast as the server (or engine) answers")
    mt.add_argument("--tail", type=float, default=10.0, help="seconds of silence after a question (default 10)")
    mt.add_argument("--judge-base-url", required=True, help="OpenAI-compatible endpoint of the judge")
    mt.add_argument("--judge-model", default="gpt-4.1")
    mt.add_argument("--judge-api-key-env", default="OPENAI_API_KEY")
    mt.add_argument("--judge-retries", type=int, default=2, help="re-asks for an unparseable judgement")
    mt.add_argument("--asr-model", default="tiny.en", help="Whisper model transcribing the assistant")
    add_in_process_args(mt)
    mt.set_defaults(func=run_mtbench)


def modes_of(args: argparse.Namespace) -> tuple[Mode, ...]:
    from kame.eval.harness import modes_for

    profiles = [p for p in (args.llm or "").split(",") if p]
    if not profiles and args.in_process and args.llm_model is not None:
        profiles = ["custom"]
    delays = [float(d) for d in args.delays.split(",") if d.strip()]
    return modes_for(profiles or [None], baseline=not args.no_baseline, delays=delays)


def settings_of(args: argparse.Namespace) -> EvalSettings:
    from kame.eval.harness import EvalSettings, JudgeSettings

    judge = JudgeSettings(args.judge_base_url, args.judge_model, args.judge_api_key_env or None, args.judge_retries)
    return EvalSettings(Path(args.out), judge, modes_of(args), tuple(c for c in args.categories.split(",") if c),
                        args.limit, args.asr_model, {k: v for k, v in vars(args).items() if k != "func"})


def websocket_source(url: str, realtime: bool, tail_s: float) -> ConversationSource:
    """Each question as a new websocket session; a mode becomes the session's query options."""
    from client.conversation import converse

    async def source(pcm, mode: Mode):
        options: dict = {} if mode.asr else {"asr": "off"}
        if mode.oracle_delay_s is not None:
            options["oracle_delay"] = mode.oracle_delay_s
        return await converse(url, pcm, realtime=realtime, tail_s=tail_s, backend=mode.backend, options=options)

    return source


def run_mtbench(args: argparse.Namespace) -> int:
    from kame.eval.harness import evaluate
    from kame.eval.mtbench import load_questions

    check_in_process_args(args, DEFAULT_URL)
    settings = settings_of(args)
    try:
        load_questions(settings.categories)  # unknown categories: said before any model loads
    except ValueError as exc:
        raise KameError(str(exc)) from exc
    if args.in_process:
        out = _in_process(args, settings)
    else:
        out = asyncio.run(evaluate(websocket_source(args.url, not args.fast, args.tail), settings))
    print(f"wrote {out / 'report.md'} and {out / 'results.json'}")
    return 0


def _in_process(args: argparse.Namespace, settings: EvalSettings) -> Path:
    from kame.eval.harness import evaluate
    from kame.eval.inprocess import in_process_source, run_in_process, start_runtime

    runtime = start_runtime(args, [m.backend for m in settings.modes], realtime=not args.fast)
    source = in_process_source(runtime, args.tail, realtime=not args.fast)
    return run_in_process(runtime, lambda: evaluate(source, settings))
