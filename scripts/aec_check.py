"""Echo cancellation, measured: the assistant's speech played back into the microphone 50, 120 and 200 ms
late at -6 dB (optionally through a synthetic room), with and without the user talking over its end;
ERLE on the echo-only part and Whisper tiny.en's WER of the user's question, before and after
kame.aec.EchoCanceller. docs/echo.md keeps the tables.

    python scripts/aec_check.py [--rooms 0,0.3] [--delays 50,120,200] [--gain-db -6] [--telephone]

--telephone: both directions through a G.711 mu-law line (8 kHz); cancelled as a telephone session
and `kame talk` do, at 24 kHz against the audio sent.
The last row of each room has no echo at all (gain -200 dB) while the reference plays, and a last
table has the user's question at later points of the assistant's speech with no echo: what the
canceller costs a user whose device already cancelled its echo."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np

from kame.aec import EchoCanceller
from kame.asr import build_asr
from kame.asr.events import FinalTranscript
from kame.asr.transcribe import transcribe_pcm
from kame.audio import SAMPLE_RATE
from kame.testing.echo import (
    ASSISTANT_TEXT,
    USER_TEXT,
    EchoScene,
    cancel_frames,
    erle_db,
    phone_line,
    scene,
    word_error_rate,
)
from kame.testing.speech import speech


async def heard(asr, pcm: np.ndarray) -> str:
    return " ".join(e.text for e in await transcribe_pcm(asr, pcm) if isinstance(e, FinalTranscript))


def clean(talk: EchoScene) -> np.ndarray:
    return cancel_frames(EchoCanceller().process_input, talk.mic, talk.played)


async def no_echo(asr, user: np.ndarray, assistant: np.ndarray, telephone: bool) -> None:
    """A microphone that hears no echo at all (headphones, a phone that cancelled it), only noise at
    -50 dBFS, while the reference plays: the user's question over the assistant, after 3.7, 6.6 and
    9.5 s of its speech. The canceller learns that there is no echo path only from the audio."""
    print("\nno echo at all (noise -50 dBFS), the user talking over the assistant after some of its speech:\n")
    print("| assistant speech before the user | WER cleaned | cleaned heard as |\n|---|---|---|")
    gap = np.zeros(SAMPLE_RATE // 2, np.float32)
    for speech_s, played, at in ((3.7, assistant, 4.0), (6.6, np.concatenate([assistant, gap, assistant]), 6.9),
                                 (9.5, np.concatenate([assistant, gap, assistant]), 9.8)):
        talk = scene(played, user, delay_ms=200, gain_db=-200, rt60_s=0.3, user_at_s=at, telephone=telephone)
        noise = np.random.default_rng(1).normal(0, 10 ** (-50 / 20), len(talk.mic)).astype(np.float32)
        talk = dataclasses.replace(talk, mic=talk.mic + noise)
        cleaned = clean(talk)[int((at - 0.5) * SAMPLE_RATE):]
        text = await heard(asr, cleaned)
        print(f"| {speech_s} s | {word_error_rate(USER_TEXT, text):.2f} | {text!r} |", flush=True)


async def main(args: argparse.Namespace) -> None:
    cache = Path(args.cache or tempfile.mkdtemp(prefix="aec-tts-"))
    user, assistant = speech(USER_TEXT, cache), speech(ASSISTANT_TEXT, cache)
    asr = build_asr("whisper", "tiny.en", realtime=False)
    print(f"user: {USER_TEXT!r}\nassistant (echoed): {ASSISTANT_TEXT!r}\n")
    line = "G.711 both ways" if args.telephone else "none"
    print(f"phone line: {line}; echo at {args.gain_db:g} dB\n")
    print("| room RT60 | delay | echo | echo-only ERLE | WER user alone | WER mic (user + echo) | WER cleaned "
          "| cleaned heard as |")
    print("|---|---|---|---|---|---|---|---|")
    cpu = []
    try:
        for rt60 in args.rooms:
            for delay, gain in [(d, args.gain_db) for d in args.delays] + [(args.delays[-1], -200.0)]:
                options = {"delay_ms": delay, "gain_db": gain, "rt60_s": rt60, "telephone": args.telephone}
                echo_only = scene(assistant, None, **options)
                t = time.process_time()
                cleaned = clean(echo_only)
                cpu.append((time.process_time() - t) / (len(echo_only.mic) / SAMPLE_RATE))
                erle = erle_db(echo_only.mic, cleaned, echo_only.echo_only) if gain > -100 else float("nan")
                talk = scene(assistant, user, **options)
                cleaned = clean(talk)
                alone = phone_line(talk.user) if args.telephone else talk.user
                texts = [await heard(asr, pcm) for pcm in (alone, talk.mic, cleaned)]
                wers = [word_error_rate(USER_TEXT, text) for text in texts]
                echo = f"{gain:g} dB" if gain > -100 else "none"
                print(f"| {rt60:.2f} s | {delay} ms | {echo} | {erle:.1f} dB | {wers[0]:.2f} | {wers[1]:.2f} "
                      f"| {wers[2]:.2f} | {texts[2]!r} |", flush=True)
        await no_echo(asr, user, assistant, args.telephone)
    finally:
        asr.close()
    print(f"\ncanceller CPU: {100 * float(np.mean(cpu)):.1f} % of one core per stream (mean over the runs)")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delays", type=lambda s: [int(x) for x in s.split(",")], default=[50, 120, 200])
    parser.add_argument("--rooms", type=_floats, default=[0.0, 0.3], help="room RT60s in seconds (0: no room)")
    parser.add_argument("--gain-db", type=float, default=-6.0, help="the echo's level against the played audio")
    parser.add_argument("--telephone", action="store_true",
                        help="both directions through a G.711 mu-law line (8 kHz); the reference stays the 24 kHz sent")
    parser.add_argument("--cache", default=None, help="where piper's speech is kept (default: a temporary folder)")
    asyncio.run(main(parser.parse_args()))
