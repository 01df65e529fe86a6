"""The `kame` command line: one subcommand per job (infer, bench, ...)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from kame.errors import KameError


def _add_frontend_args(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--frontend", default=default,
                        help="preset (tiny, tiny-copy, moshi-7b-random), local directory, or HF repo id "
                             f"(default: {default})")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda (default: auto)")


def _cmd_infer(args: argparse.Namespace) -> int:
    from kame.audio import read_audio, write_wav
    from kame.frontend.infer import OracleCue, run_inference
    from kame.frontend.loader import load_frontend

    if len(args.oracle_at) > len(args.oracle):
        raise KameError("each --oracle-at needs an --oracle before it")
    times = list(args.oracle_at) + [0.0] * (len(args.oracle) - len(args.oracle_at))
    cues = [OracleCue(at, text) for at, text in zip(times, args.oracle, strict=True)]
    pcm = read_audio(args.input)
    frontend = load_frontend(args.frontend, args.device)
    result = run_inference(frontend, pcm, cues, tail_s=args.tail)
    write_wav(args.output, result.audio)
    if args.json:
        print(json.dumps(result.to_json() | {"output": str(args.output)}))
    else:
        print(result.text)
    return 0


def _cmd_transcribe(args: argparse.Namespace) -> int:
    import asyncio

    from kame.asr import AsrFailure, FinalTranscript, build_asr
    from kame.asr.transcribe import transcribe_pcm
    from kame.audio import read_audio

    pcm = read_audio(args.input)
    asr = build_asr(args.asr, args.asr_model, args.device, max_sessions=1, realtime=args.realtime)
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


def _cmd_bench(args: argparse.Namespace) -> int:
    from kame.frontend.bench import main_frontend

    return main_frontend(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kame", description="KAME tandem speech-to-speech server and tools")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    infer = sub.add_parser("infer", help="run the front-end over an audio file with an oracle schedule")
    _add_frontend_args(infer, "SakanaAI/kame")
    infer.add_argument("--input", required=True, help="input audio file (any sample rate; resampled to 24 kHz)")
    infer.add_argument("--output", required=True, help="where to write the assistant audio (WAV, 24 kHz)")
    infer.add_argument("--oracle", action="append", default=[], metavar="TEXT",
                       help="oracle text; each one resets the oracle at its --oracle-at time (repeatable)")
    infer.add_argument("--oracle-at", action="append", type=float, default=[], metavar="SECONDS",
                       help="input time of the matching --oracle (default 0)")
    infer.add_argument("--tail", type=float, default=1.0, help="seconds of silence after the input (default 1)")
    infer.add_argument("--json", action="store_true", help="print JSON with per-frame text times")
    infer.set_defaults(func=_cmd_infer)

    transcribe = sub.add_parser("transcribe", help="print the streaming ASR's partial and final transcripts of a file")
    transcribe.add_argument("input", help="audio file (WAV, FLAC, MP3, Ogg; any sample rate)")
    transcribe.add_argument("--asr", default="whisper", choices=["whisper", "kyutai-stt", "none"])
    transcribe.add_argument("--asr-model", default=None,
                            help="model name or local directory (default: tiny.en / kyutai/stt-1b-en_fr)")
    transcribe.add_argument("--device", default="auto")
    transcribe.add_argument("--realtime", action="store_true", help="feed the audio at real-time pace")
    transcribe.add_argument("--json", action="store_true", help="one JSON object per event")
    transcribe.set_defaults(func=_cmd_transcribe)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    frontend = bench_sub.add_parser("frontend", help="ms per frame of encode, LM step, decode by batch size")
    from kame.frontend.bench import add_frontend_bench_args

    add_frontend_bench_args(frontend)
    frontend.set_defaults(func=_cmd_bench)
    _register_plugins(sub, "kame.commands")
    _register_plugins(bench_sub, "kame.bench")
    return parser


def _register_plugins(sub: argparse._SubParsersAction, group: str) -> None:
    """Subcommands of the server and the clients, found through entry points (`kame.commands`,
    `kame.bench`), so that `kame` itself never imports `server/` or `client/`."""
    from importlib.metadata import entry_points

    for entry in sorted(entry_points(group=group), key=lambda e: e.name):
        entry.load()(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except KameError as exc:
        print(f"kame: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
