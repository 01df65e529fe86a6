"""`kame client` (stream a file, record the answer) and `kame talk` (microphone and speakers)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

DEFAULT_URL = "ws://127.0.0.1:8998/api/chat"


def register(sub: argparse._SubParsersAction) -> None:
    client = sub.add_parser("client", help="stream an audio file to a server and record what it answers")
    client.add_argument("--url", default=DEFAULT_URL, help=f"server websocket URL (default {DEFAULT_URL})")
    client.add_argument("--input", required=True, help="audio file to speak (any rate; resampled to 24 kHz)")
    client.add_argument("--output", required=True, help="WAV file for the assistant's audio")
    pace = client.add_mutually_exclusive_group()
    pace.add_argument("--realtime", dest="realtime", action="store_true", default=True,
                      help="send at real-time pace, as a user speaks (default)")
    pace.add_argument("--fast", dest="realtime", action="store_false",
                      help="send as fast as the server answers (offline servers)")
    client.add_argument("--tail", type=float, default=3.0, help="seconds of silence after the input (default 3)")
    add_llm_arg(client, "the server's LLM backend profile for this session (default: the server's default)")
    client.add_argument("--system-prompt", default=None)
    client.add_argument("--json", action="store_true", help="one JSON line per message, with times")
    client.add_argument("--realtime-api", action="store_true",
                        help="talk to the OpenAI-Realtime endpoint /v1/realtime through the openai SDK instead of "
                             "Moshi's protocol (the URL's path is replaced)")
    client.add_argument("--token", default=None, help="auth token (with --realtime-api: sent as the SDK's api_key)")
    add_session_args(client)
    client.set_defaults(func=run_client)

    talk = sub.add_parser("talk", help="talk to a server with the microphone and speakers")
    talk.add_argument("--url", default=DEFAULT_URL)
    talk.add_argument("--device", default=None, help="sounddevice device index or name (both directions)")
    talk.add_argument("--list-devices", action="store_true", help="list audio devices and exit")
    talk.add_argument("--no-aec", dest="aec", action="store_false",
                      help="send the microphone as it is, without cancelling the speakers' echo (with headphones)")
    add_llm_arg(talk, "the server's LLM backend profile for this session (default: the server's default)")
    add_session_args(talk)
    talk.set_defaults(func=run_talk)


def add_session_args(parser: argparse.ArgumentParser) -> None:
    """The session's persona and language, as Moshi's protocol asks for them (query parameters)."""
    parser.add_argument("--text-prompt", default=None, metavar="TEXT",
                        help="a role text for a PersonaPlex-layout front-end (PersonaPlex's text_prompt)")
    parser.add_argument("--voice-prompt", default=None, metavar="NAME",
                        help="a PersonaPlex voice by name (NATF2.pt; the server's /healthz lists them)")
    parser.add_argument("--language", default=None, choices=["en", "ja"],
                        help="the language the backend thinks in (default: the server's; docs/languages.md)")


def session_options(args: argparse.Namespace) -> dict[str, str]:
    asked = (("text_prompt", args.text_prompt), ("voice_prompt", args.voice_prompt), ("language", args.language))
    return {name: value for name, value in asked if value is not None}


def add_llm_arg(parser: argparse.ArgumentParser, help_text: str, metavar: str = "PROFILE") -> None:
    """`--llm`, the one spelling of the LLM profile in every command; `--backend` and `--profiles`
    (the spellings of the first release) still work, hidden."""
    parser.add_argument("--llm", default=None, metavar=metavar, help=help_text)
    for old in ("--backend", "--profiles"):
        parser.add_argument(old, dest="llm", default=None, help=argparse.SUPPRESS)


def run_client(args: argparse.Namespace) -> int:
    from client.console import printer
    from client.conversation import converse
    from kame.audio import read_audio

    pcm = read_audio(args.input)
    if args.realtime_api:
        return _run_realtime_client(args, pcm)
    if args.token:
        args.url += ("&" if "?" in args.url else "?") + f"token={args.token}"
    conv = asyncio.run(converse(args.url, pcm, realtime=args.realtime, tail_s=args.tail, backend=args.llm,
                                system_prompt=args.system_prompt, on_item=printer(args.json),
                                options=session_options(args) or None))
    return _finish(args, conv, {})


def _finish(args: argparse.Namespace, conv, more: dict) -> int:
    """Write the assistant's audio; the summary as a JSON line or two lines of text."""
    from kame.audio import SAMPLE_RATE, write_wav

    write_wav(args.output, conv.assistant_audio)
    summary = {"assistant_text": conv.assistant_text, "frames_sent": conv.frames_sent,
               "audio_s": round(len(conv.assistant_audio) / SAMPLE_RATE, 3), "output": args.output, **more}
    if args.json:
        print(json.dumps({"type": "summary", **summary}))
    else:
        print(f"assistant: {conv.assistant_text}")
        print(f"wrote {summary['audio_s']} s of assistant audio to {args.output}", file=sys.stderr)
    return 0


def _run_realtime_client(args: argparse.Namespace, pcm) -> int:
    from client.realtime_client import converse_realtime, realtime_url
    from kame.errors import KameError

    if args.llm or not args.realtime or session_options(args):
        raise KameError("--realtime-api streams at real-time pace with the server's default LLM: "
                        "no --llm, --fast, --text-prompt, --voice-prompt or --language with it")

    def show(t: float, line: str) -> None:
        if args.json:
            print(json.dumps({"t": round(t, 3), "line": line}), flush=True)
        else:
            print(f"[{t:7.2f}] {line}", flush=True)

    conv = asyncio.run(converse_realtime(args.url, pcm, token=args.token, tail_s=args.tail,
                                         instructions=args.system_prompt, on_line=show))
    return _finish(args, conv, {"user_text": " ".join(conv.transcripts), "errors": len(conv.errors),
                                "url": realtime_url(args.url)})


def run_talk(args: argparse.Namespace) -> int:
    from client.talk import list_devices, talk

    if args.list_devices:
        print(list_devices())
        return 0
    try:
        return asyncio.run(talk(args.url, args.device, args.llm, aec=args.aec, options=session_options(args)))
    except KeyboardInterrupt:  # Ctrl-C: the session was closed on the way out
        return 0
