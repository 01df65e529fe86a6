"""Checks LiveKit Agents' GPT-Live client against a running KAME server, outside any LiveKit room: an
`AgentSession(llm=GPTLiveModel(base_url=...))` under client delegation speaks a WAV question into
KAME's /v1/live/sessions, answers each `session.delegation.created` with commentary, and waits until
KAME's front-end says the commentary's words. Prints the server events it saw; exit status 0 on success.

livekit-agents 1.8.9 and its OpenAI plugin come with KAME's dev extra (moshi is installed without its
aiohttp<3.12 pin: docs/dependencies.md); tests/test_livekit_live.py runs the same in the suite, both through
client/livekit_live.py.
GPTLiveModel first ships in livekit-plugins-openai 1.8.1.

    kame serve --frontend tiny-copy --port 18999 &
    python scripts/livekit_live_check.py question.wav --url http://127.0.0.1:18999/v1
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import wave

import numpy as np
from livekit.agents import Agent
from livekit.plugins.openai.realtime import GPTLiveModel

from client.livekit_live import RATE, Log, answer_with, converse
from kame.eval.conditions import words

TAIL_S = 3  # seconds of silence sent at least, for the user's last words to come back
ANSWER = "Zebras sing in Oslo."  # words only this script supplies: heard back, they prove the round trip


def read_wav(path: str) -> np.ndarray:
    with wave.open(path, "rb") as wav:
        if (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) != (1, 2, RATE):
            raise SystemExit(f"{path}: a mono 16-bit 24 kHz WAV is needed")
        pcm16 = wav.readframes(wav.getnframes())
    return np.frombuffer(pcm16, "<i2").astype(np.float32) / 32768


def answered(log: Log) -> bool:
    return " ".join(words(ANSWER)) in log.said_words()


async def main(args: argparse.Namespace) -> int:
    model = GPTLiveModel(api_key="unused", base_url=args.url, delegation="client")
    agent = Agent(instructions="You are the check's assistant. Answer in one short sentence.")
    question = np.concatenate([read_wav(args.question), np.zeros(RATE * TAIL_S, np.float32)])
    log = await converse(agent, model, question, answered, limit_s=args.listen, on_delegation=answer_with(ANSWER))
    print(f"server events: {dict(log.types)}")
    print(f"user (KAME's ASR): {log.heard.strip()!r}")
    print(f"user turns as LiveKit split them: {log.user_turns!r}")
    print(f"assistant: {log.said.strip()!r}")
    print(f"delegations answered: {len(log.delegations)}; session.closed: {log.closed.is_set()}")
    for error in log.errors:
        print(f"error event: {error}")
    ok = answered(log) and log.delegations and log.closed.is_set() and not log.errors
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("question", help="a mono 16-bit 24 kHz WAV of a spoken question")
    parser.add_argument("--url", default="http://127.0.0.1:18999/v1", help="KAME's HTTP base (default: %(default)s)")
    parser.add_argument("--listen", type=float, default=10.0, help="seconds of silence after the question at most")
    sys.exit(asyncio.run(main(parser.parse_args())))
