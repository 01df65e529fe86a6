"""The `kame` command line: one subcommand per job (infer, bench, ...)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from kame.errors import KameError
from kame.flags import add_device_flag, add_frontend_flag
from kame.training.cli import register_data
from kame.training.train_cli import register_train


def _add_frontend_args(parser: argparse.ArgumentParser) -> None:
    add_frontend_flag(parser)
    add_device_flag(parser)
    _add_quantize_arg(parser)


def _add_quantize_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantize", default=None, choices=["int8"],
                        help="int8: the front-end LM's weights in int8 through bitsandbytes (CUDA only)")


def _cmd_infer(args: argparse.Namespace) -> int:
    from kame.frontend.loader import check_quantize, resolve_device

    check_quantize(args.quantize, resolve_device(args.device))  # the flags before the audio
    if args.seed is not None:
        _seed_all(args.seed)
    if args.llm or args.llm_model:
        return _infer_tandem(args)
    import dataclasses

    from kame.audio import read_audio, write_wav
    from kame.frontend.engine import GenerationConfig
    from kame.frontend.infer import OracleCue, run_inference
    from kame.frontend.loader import load_frontend
    from kame.frontend.voices import VoiceLibrary, frontend_voices

    if len(args.oracle_at) > len(args.oracle):
        raise KameError("each --oracle-at needs an --oracle before it")
    times = list(args.oracle_at) + [0.0] * (len(args.oracle) - len(args.oracle_at))
    cues = [OracleCue(at, text) for at, text in zip(times, args.oracle, strict=True)]
    pcm = read_audio(args.input)
    frontend = load_frontend(_default_frontend(args.frontend, args.device), args.device, quantize=args.quantize)
    gen = None
    if args.greedy:
        gen = dataclasses.replace(GenerationConfig.from_dict(frontend.lm_gen_config), use_sampling=False)
    voices = VoiceLibrary(frontend_voices(args.voice_prompt_dir, frontend)) if args.voice_prompt else None
    result = run_inference(frontend, pcm, cues, tail_s=args.tail, gen=gen, persona=args.text_prompt,
                           voice=args.voice_prompt, voices=voices)
    write_wav(args.output, result.audio)
    if args.json:
        print(json.dumps(result.to_json() | {"output": str(args.output)}))
    else:
        print(result.text)
    return 0


def _seed_all(seed: int) -> None:
    """Python's, numpy's and torch's generators (CUDA's too), as NVIDIA's offline.py seeds them."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # every CUDA device's too


def _default_frontend(source: str | None, device: str) -> str:
    """The front-end `kame serve` would pick, with the same log line."""
    if source is not None:
        return source
    from kame.frontend.loader import resolve_device
    from kame.runtime import log_default_frontend

    return log_default_frontend(resolve_device(device).type == "cuda")


def _infer_tandem(args: argparse.Namespace) -> int:
    """The recorded question through a real tandem session in this process: ASR, planner, LLM."""
    import dataclasses

    from kame.audio import read_audio, write_wav
    from kame.converse import converse_in_process
    from kame.eval.inprocess import CUSTOM, run_in_process, start_runtime
    from kame.session_config import SessionConfig
    from kame.session_events import AssistantAudio, AssistantText, SessionStats

    if args.oracle:
        raise KameError("--oracle schedules a scripted oracle; with --llm the LLM gives it: use one or the other")
    if (args.llm_base_url is None) != (args.llm_model is None):
        raise KameError("--llm-base-url and --llm-model go together")
    pcm = read_audio(args.input)
    name = CUSTOM if args.llm_model is not None else args.llm
    runtime = start_runtime(args, [name], realtime=True, asr_model=args.asr_model)
    greedy = {"text_temperature": 0, "audio_temperature": 0} if args.greedy else {}
    config = SessionConfig(persona=args.text_prompt, voice=args.voice_prompt, sampling=greedy)
    conversation = run_in_process(runtime, lambda: converse_in_process(runtime, pcm, config, tail_s=args.tail))
    write_wav(args.output, conversation.assistant_audio)
    if args.json:
        print(json.dumps({"text": conversation.assistant_text, "output": str(args.output), "events": [
            {"t": round(t, 3), "type": type(e).__name__, **dataclasses.asdict(e)} for t, e in conversation.events
            if not isinstance(e, AssistantAudio | AssistantText | SessionStats)]}))
    else:
        print("\n".join(conversation.lines()))
        print(f"assistant: {conversation.assistant_text}")
    return 0


def _cmd_transcribe(args: argparse.Namespace) -> int:
    import asyncio

    from kame.asr import AsrFailure, FinalTranscript, build_asr
    from kame.asr.transcribe import transcribe_pcm
    from kame.audio import read_audio

    pcm = read_audio(args.input)
    options = {"end_of_turn": args.end_of_turn} if args.end_of_turn else None  # whisper and kyutai-stt alike
    asr = build_asr(args.asr, args.asr_model, args.device, max_sessions=1, realtime=args.realtime, options=options)
    try:
        events = asyncio.run(transcribe_pcm(asr, pcm, realtime=args.realtime))
    finally:
        asr.close()
    for event in events:
        if isinstance(event, AsrFailure):
            raise KameError(event.message)
        kind = "final" if isinstance(event, FinalTranscript) else "partial"
        if args.json:
            print(json.dumps({"type": kind, "text": event.text, "start_s": round(event.start_s, 3),
                              "end_s": round(event.end_s, 3)}))
        else:
            print(f"[{event.start_s:6.2f} - {event.end_s:6.2f}] {kind:7} {event.text}")
    return 0


def add_frontend_bench_args(parser: argparse.ArgumentParser) -> None:
    """`kame bench frontend`'s flags (here, so that building the parser imports no torch)."""
    add_frontend_flag(parser, default="tiny")
    add_device_flag(parser)
    _add_quantize_arg(parser)
    parser.add_argument("--batch-sizes", default=None, help="comma list (default: 1,4,16 on cpu; 1,8,32,64 on cuda)")
    parser.add_argument("--frames", type=int, default=50, help="timed frames per batch size (default 50)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed frames first (default 5)")
    parser.add_argument("--json-out", default=None, help="write the results as JSON here")


def _cmd_bench(args: argparse.Namespace) -> int:
    from kame.frontend.bench import main_frontend

    return main_frontend(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kame", description="KAME tandem speech-to-speech server and tools")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    infer = sub.add_parser("infer", help="run the front-end over an audio file with an oracle schedule")
    _add_frontend_args(infer)
    infer.add_argument("--input", required=True, help="input audio file (any sample rate; resampled to 24 kHz)")
    infer.add_argument("--output", required=True, help="where to write the assistant audio (WAV, 24 kHz)")
    infer.add_argument("--oracle", action="append", default=[], metavar="TEXT",
                       help="oracle text; each one resets the oracle at its --oracle-at time (repeatable)")
    infer.add_argument("--oracle-at", action="append", type=float, default=[], metavar="SECONDS",
                       help="input time of the matching --oracle (default 0)")
    infer.add_argument("--tail", type=float, default=1.0, help="seconds of silence after the input (default 1; then "
                       "more while the session is still busy, at most 10 s)")
    infer.add_argument("--json", action="store_true", help="print JSON with per-frame text times")
    infer.add_argument("--text-prompt", default=None, metavar="TEXT",
                       help="a PersonaPlex-layout front-end's role text, prefilled before the input as NVIDIA's "
                            "offline.py does (its flag)")
    infer.add_argument("--voice-prompt", default=None, metavar="NAME",
                       help="a PersonaPlex voice by name (NATF2.pt), from --voice-prompt-dir or the checkpoint's "
                            "voices (offline.py's flag)")
    infer.add_argument("--voice-prompt-dir", default=None, type=Path, metavar="DIR",
                       help="where the voices are (default: the checkpoint's voices/ or voices.tgz)")
    infer.add_argument("--greedy", action="store_true",
                       help="the most likely token every step, text and audio (offline.py's --greedy)")
    infer.add_argument("--seed", type=int, default=None,
                       help="seed torch, numpy and random before the run (offline.py's --seed): a sampled run repeats")
    infer.add_argument("--llm", default=None, metavar="PROFILE",
                       help="run the whole tandem in this process: ASR, planner and this LLM profile give the "
                            "oracle (openai, anthropic, gemini, local, embedded); prints transcripts, oracle, answer")
    infer.add_argument("--llm-base-url", default=None, help="with --llm-model: an ad-hoc OpenAI-compatible endpoint")
    infer.add_argument("--llm-model", default=None)
    infer.add_argument("--llm-api-key-env", default=None, help="env var holding its key (default: none)")
    infer.add_argument("--asr", default=None, choices=["whisper", "kyutai-stt", "none"],
                       help="with --llm: the streaming ASR (default: kyutai-stt on a GPU, whisper on a CPU)")
    infer.add_argument("--asr-model", default=None)
    infer.set_defaults(func=_cmd_infer)

    transcribe = sub.add_parser("transcribe", help="print the streaming ASR's partial and final transcripts of a file")
    transcribe.add_argument("input", help="audio file (WAV, FLAC, MP3, Ogg; any sample rate)")
    transcribe.add_argument("--asr", default="whisper", choices=["whisper", "kyutai-stt", "none"])
    transcribe.add_argument("--asr-model", default=None,
                            help="model name or local directory (default: tiny.en / kyutai/stt-1b-en_fr)")
    add_device_flag(transcribe, what="the ASR's device: ")
    transcribe.add_argument("--realtime", action="store_true", help="feed the audio at real-time pace")
    transcribe.add_argument("--end-of-turn", default=None, choices=["smart-turn", "silence"],
                            help="what ends an utterance at a pause (docs/turn-taking.md; default smart-turn)")
    transcribe.add_argument("--json", action="store_true", help="one JSON object per event")
    transcribe.set_defaults(func=_cmd_transcribe)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    frontend = bench_sub.add_parser("frontend", help="ms per frame of encode, LM step, decode by batch size")
    add_frontend_bench_args(frontend)
    frontend.set_defaults(func=_cmd_bench)
    register_data(sub)
    register_train(sub)
    _register_plugins(sub, "kame.commands")
    _register_plugins(bench_sub, "kame.bench")
    return parser


def _register_plugins(sub: argparse._SubParsersAction, group: str) -> None:
    """Subcommands of the server, the clients and the evaluations, found through entry points
    (`kame.commands`, `kame.bench`), so that `kame` itself never imports `server/` or `client/`."""
    from importlib.metadata import entry_points

    for entry in sorted(entry_points(group=group), key=lambda e: e.name):
        entry.load()(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except KameError as exc:  # an expected condition: one line, its own exit code, no traceback
        print(f"kame: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
