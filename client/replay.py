"""`kame replay DIR --llm PROFILE`: send a recorded session's audio through the server again (`--url`),
or a tandem session in this process (`--in-process`), with another backend or prompt, and compare
what the assistant said (regressions, A/B tests). `--timeline out.html` draws one recorded session's
timeline instead (client/timeline.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from client.cli import DEFAULT_URL
from kame.errors import KameError
from kame.eval.inprocess import CUSTOM, add_in_process_args, check_in_process_args

if TYPE_CHECKING:
    from kame.conversation_log import ConversationLog


def register(sub: argparse._SubParsersAction) -> None:
    replay = sub.add_parser("replay", help="re-run recorded sessions (kame serve --record) with another backend")
    replay.add_argument("recording", help="a session folder of a --record DIR, or the DIR itself (all sessions)")
    replay.add_argument("--llm", default=None, help="the backend profile to use this time: the server's, or with "
                                                    f"--in-process a built-in one ({CUSTOM!r} with --llm-model)")
    replay.add_argument("--url", default=None, help=f"the server's websocket (default {DEFAULT_URL})")
    replay.add_argument("--system-prompt", default=None)
    replay.add_argument("--fast", action="store_true", help="send as fast as the server (or engine) answers")
    replay.add_argument("--tail", type=float, default=0.0, help="extra silence after the recorded audio (--in-process: "
                        "then more while the session is still busy, at most 10 s)")
    replay.add_argument("--timeline", default=None, metavar="OUT.html",
                        help="write the recorded session's timeline (the browser page's) to one HTML file; "
                             "nothing is replayed")
    add_in_process_args(replay)
    replay.set_defaults(func=run_replay)


def sessions_in(path: Path) -> list[Path]:
    if (path / "input.wav").is_file():
        return [path]
    found = sorted(p.parent for p in path.glob("*/input.wav"))
    if not found:
        raise KameError(f"{path} holds no recorded session (no input.wav)")
    return found


def said(folder: Path) -> str:
    lines = (folder / "events.jsonl").read_text().splitlines()
    return "".join(e["text"] for e in map(json.loads, lines) if e.get("type") == "text").strip()


def run_replay(args: argparse.Namespace) -> int:
    if args.timeline is not None:
        return _timeline(Path(args.recording), Path(args.timeline))
    check_in_process_args(args, DEFAULT_URL)
    if args.llm is None and args.llm_model is None:
        raise KameError("--llm PROFILE is needed (or, with --in-process, --llm-base-url and --llm-model)")
    args.llm = args.llm or CUSTOM
    folders = sessions_in(Path(args.recording))
    if args.in_process:
        return _in_process(args, folders)
    from client.conversation import converse

    async def talk(pcm):
        conversation = await converse(args.url, pcm, realtime=not args.fast, tail_s=args.tail, backend=args.llm,
                                      system_prompt=args.system_prompt)
        return conversation.log()

    return asyncio.run(replay_all(folders, talk, args.llm))


def _timeline(recording: Path, out: Path) -> int:
    from client.timeline import write_timeline

    folders = sessions_in(recording)
    if len(folders) > 1:
        raise KameError(f"--timeline draws one session; {recording} holds {len(folders)}: "
                        + ", ".join(f.name for f in folders))
    write_timeline(folders[0], out)
    print(json.dumps({"session": folders[0].name, "timeline": str(out)}))
    return 0


def _in_process(args: argparse.Namespace, folders: list[Path]) -> int:
    from kame.eval.harness import Mode
    from kame.eval.inprocess import in_process_source, run_in_process, start_runtime

    runtime = start_runtime(args, [args.llm], realtime=not args.fast)
    source = in_process_source(runtime, args.tail, realtime=not args.fast, system_prompt=args.system_prompt)
    mode = Mode(f"replay {args.llm}", backend=args.llm)
    return run_in_process(runtime, lambda: replay_all(folders, lambda pcm: source(pcm, mode), args.llm))


async def replay_all(folders: list[Path], talk: Callable[..., Awaitable[ConversationLog]], llm: str) -> int:
    """Each recording through `talk(pcm)`; its outputs beside it: the audio, and the events as a recording
    writes them (the wire's JSON events and the text pieces, in the order they came)."""
    from kame.audio import read_audio, write_wav
    from kame.protocol import wire_event
    from kame.session_events import AssistantText

    for folder in folders:
        conv = await talk(read_audio(folder / "input.wav"))
        out = folder / f"replay-{llm}"
        out.mkdir(exist_ok=True)
        write_wav(out / "output.wav", conv.assistant_audio)
        with (out / "events.jsonl").open("w") as handle:
            for t, event in conv.events:
                if isinstance(event, AssistantText):
                    line = {"type": "text", "text": event.text}
                elif (wire := wire_event(event)) is not None:
                    line = wire.model_dump(exclude_none=True)
                else:
                    continue
                handle.write(json.dumps({"t": round(t, 3), **line}) + "\n")
        print(json.dumps({"session": folder.name, "llm": llm, "recorded": said(folder),
                          "replayed": conv.assistant_text, "output": str(out)}))
    return 0
