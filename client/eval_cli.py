"""`kame eval mtbench` and `kame eval robustness`: spoken MT-Bench through a running server's websocket
(`--url`, `client.conversation`), or a tandem session in this process (`--in-process`,
`kame.eval.inprocess`). The harness itself (modes, judge, resumable results, report) is the library's
`kame.eval.harness`, which reads the session's typed events whatever ran it; this module, above both the
library and the wire, turns the flags into its settings and gives it its conversation source.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
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
    _register_robustness(evals)


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
        conversation = await converse(url, pcm, realtime=realtime, tail_s=tail_s, backend=mode.backend,
                                      options=options)
        return conversation.log()

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


# ----------------------------------------------------------------------------- kame eval robustness


def _register_robustness(evals: argparse._SubParsersAction) -> None:
    rb = evals.add_parser("robustness", help="short questions said as real users say them (pauses, fillers, "
                                             "background speech, a phone line, echo), in this process")
    rb.add_argument("--out", default="eval-robustness", help="folder for results.json, report.md (default "
                                                             "eval-robustness)")
    rb.add_argument("--conditions", default=None, help="comma list (default: all; see docs/evaluation.md)")
    rb.add_argument("--voices", default=None, help="comma list of voices (default piper:joe,flite:slt,flite:rms)")
    rb.add_argument("--limit", type=int, default=None, help="first N questions only")
    rb.add_argument("--tail", type=float, default=4.0, help="seconds of silence after a question (default 4)")
    rb.add_argument("--echo-delay-ms", type=float, default=120.0, help="echo: speaker to mic (default 120)")
    rb.add_argument("--echo-gain-db", type=float, default=-6.0, help="echo: its level (default -6)")
    rb.add_argument("--assistant-voice", default="auto",
                    help="echo: what the speaker plays: 'audio' (the front-end's own), a voice that says the "
                         "front-end's text, or auto (flite:kal16 for an untrained preset, whose audio is noise)")
    rb.add_argument("--grace", type=float, default=None, help="the answer in place this long after the user "
                                                              "stops is the one judged (default 1.0 s)")
    rb.add_argument("--seed", type=int, default=0)
    rb.add_argument("--end-of-turn", default=None, choices=["smart-turn", "silence"],
                    help="whisper's end of a user turn: the Smart Turn model, or the silence rule alone "
                         "(default: whisper's own default)")
    rb.add_argument("--input-processor", default=None, metavar="MODULE:FACTORY",
                    help="called once per session; returns process_input(mic_frame, played_frame) -> frame, or "
                         "an object with that method (an echo canceller, e.g. kame.aec:EchoCanceller); it runs "
                         "on every input frame of every condition")
    rb.add_argument("--scripted-llm", action="store_true",
                    help="the LLM is a scripted one on loopback that answers a question only once it heard "
                         "its last words (CPU runs; not with --llm-model)")
    rb.add_argument("--scripted-llm-first-token", type=float, default=0.0, metavar="S",
                    help="its first-token delay in seconds (default 0)")
    add_llm_arg(rb, "LLM profile (built-in, or 'custom' with --llm-model; default embedded)")
    judging = rb.add_argument_group("judge", "with --judge-base-url: each answer scored as spoken MT-Bench scores "
                                             "it (meaningful with a trained front-end and a real LLM)")
    judging.add_argument("--judge-base-url", default=None, help="OpenAI-compatible endpoint of the judge")
    judging.add_argument("--judge-model", default="gpt-4.1")
    judging.add_argument("--judge-api-key-env", default="OPENAI_API_KEY")
    judging.add_argument("--judge-retries", type=int, default=2, help="re-asks for an unparseable judgement")
    judging.add_argument("--judge-hears", default="auto", choices=["auto", "audio", "text"],
                         help="what is judged: the assistant's audio through Whisper, or its text stream "
                              "(auto: text for an untrained preset, whose audio is noise)")
    add_in_process_args(rb)  # --in-process is implied: the loop is closed frame by frame in this process
    rb.set_defaults(func=run_robustness)


def run_robustness(args: argparse.Namespace) -> int:
    from kame.eval.conditions import pick as pick_conditions
    from kame.eval.robustness import load_questions

    args.in_process, args.url = True, None
    check_in_process_args(args, DEFAULT_URL)
    if args.scripted_llm and args.llm_model is not None:
        raise KameError("--scripted-llm or --llm-model: one or the other")
    try:
        conditions = pick_conditions(args.conditions)
    except ValueError as exc:
        raise KameError(str(exc)) from exc
    from kame.eval.voices import pick as pick_voices

    voices, questions = pick_voices(args.voices), load_questions(args.limit)  # said before any model loads
    processor = _factory(args.input_processor) if args.input_processor else None
    server = _scripted_llm(args, questions) if args.scripted_llm else None
    try:
        results, settings = _robustness_in_process(args, conditions, voices, questions, processor)
    finally:
        if server is not None:
            server.stop_thread()
    from kame.eval.robustness_metrics import table

    print(table(results, [c.name for c in settings.conditions]))
    print(f"wrote {settings.out / 'report.md'} and {settings.out / 'results.json'}")
    return 0


def _factory(spec: str):
    """MODULE:FACTORY -> a function making one session's process_input (the object's method if it has one)."""
    import importlib

    module, _, name = spec.partition(":")
    try:
        make = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise KameError(f"--input-processor {spec}: {exc}") from exc

    def processor():
        made = make()
        return getattr(made, "process_input", made)

    return processor


def _scripted_llm(args: argparse.Namespace, questions):
    from kame.eval.robustness import scripted_reply
    from kame.testing.openai_server import ScriptedOpenAIServer

    server = ScriptedOpenAIServer(scripted_reply(questions, args.scripted_llm_first_token))
    server.start_in_thread()
    args.llm_base_url, args.llm_model, args.llm_api_key_env = server.base_url, "scripted", None
    return server


def _robustness_in_process(args, conditions, voices, questions, processor):
    from kame.eval.inprocess import CUSTOM, run_in_process, start_runtime
    from kame.eval.robustness import RobustnessSettings, converse_closed_loop, evaluate
    from kame.eval.voices import ASSISTANT_VOICE, voice
    from kame.frontend.presets import PRESET_NAMES
    from kame.session import SessionConfig

    backend = args.llm or (CUSTOM if args.llm_model is not None else None)
    asr_options = {"whisper": {"end_of_turn": args.end_of_turn}} if args.end_of_turn else None
    runtime = start_runtime(args, [backend], realtime=True, asr_options=asr_options)
    spoken = args.assistant_voice
    if spoken == "auto":
        spoken = ASSISTANT_VOICE if runtime.frontend.source in PRESET_NAMES else "audio"
    assistant = None if spoken == "audio" else voice(spoken)
    flags = {k: v for k, v in vars(args).items() if k not in ("func", "llm_base_url")}
    settings = RobustnessSettings(Path(args.out), tuple(conditions), tuple(voices), tuple(questions),
                                  args.echo_delay_ms / 1000, args.echo_gain_db, seed=args.seed,
                                  assistant_voice=assistant, input_processor=processor,
                                  report_settings=flags | {"frontend_source": runtime.frontend.source,
                                                           "assistant_voice": spoken})
    if args.grace is not None:
        settings = dataclasses.replace(settings, grace_s=args.grace)
    config = SessionConfig(backend=backend, realtime=True)
    speak = assistant.speaker(settings.out / "tts") if assistant else None

    async def source(pcm, echo, process_input):
        return await converse_closed_loop(runtime, pcm, config, args.tail, echo, process_input, speak)

    async def main():
        judge = None
        if args.judge_base_url:
            from kame.eval.harness import JudgeSettings
            from kame.eval.robustness import Judge

            hears = args.judge_hears
            if hears == "auto":
                hears = "text" if runtime.frontend.source in PRESET_NAMES else "audio"
            judge = Judge(JudgeSettings(args.judge_base_url, args.judge_model, args.judge_api_key_env or None,
                                        args.judge_retries), hears)
        try:
            return await evaluate(source, dataclasses.replace(settings, judge=judge))
        finally:
            if judge is not None:
                await judge.aclose()

    return run_in_process(runtime, main), settings
