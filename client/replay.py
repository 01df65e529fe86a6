"""`kame replay DIR --llm PROFILE`: send a recorded session's audio through the server again,
with another backend or prompt, and compare what the assistant said (regressions, A/B tests)."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from kame.errors import KameError


def register(sub: argparse._SubParsersAction) -> None:
    replay = sub.add_parser("replay", help="re-run recorded sessions (kame serve --record) with another backend")
    replay.add_argument("recording", help="a session folder of a --record DIR, or the DIR itself (all sessions)")
    replay.add_argument("--llm", required=True, help="the server's backend profile to use this time")
    replay.add_argument("--url", default="ws://127.0.0.1:8998/api/chat")
    replay.add_argument("--system-prompt", default=None)
    replay.add_argument("--fast", action="store_true", help="send as fast as the server answers")
    replay.add_argument("--tail", type=float, default=0.0, help="extra silence after the recorded audio")
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
    from client.conversation import converse
    from kame.audio import read_audio, write_wav

    for folder in sessions_in(Path(args.recording)):
        pcm = read_audio(folder / "input.wav")
        conv = asyncio.run(converse(args.url, pcm, realtime=not args.fast, tail_s=args.tail, backend=args.llm,
                                    system_prompt=args.system_prompt))
        out = folder / f"replay-{args.llm}"
        out.mkdir(exist_ok=True)
        write_wav(out / "output.wav", conv.assistant_audio)
        with (out / "events.jsonl").open("w") as handle:
            for t, event in conv.events:
                handle.write(json.dumps({"t": round(t, 3), **event}) + "\n")
            for t, piece in conv.text:
                handle.write(json.dumps({"t": round(t, 3), "type": "text", "text": piece}) + "\n")
        print(json.dumps({"session": folder.name, "llm": args.llm, "recorded": said(folder),
                          "replayed": conv.assistant_text, "output": str(out)}))
    return 0
