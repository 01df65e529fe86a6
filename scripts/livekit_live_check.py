"""Checks LiveKit Agents' GPT-Live client against a running KAME server, outside any LiveKit room: an
`AgentSession(llm=GPTLiveModel(base_url=...))` under client delegation speaks a WAV question into
KAME's /v1/live/sessions, answers each `session.delegation.created` with commentary, and waits until
KAME's front-end says the commentary's words. Prints the server events it saw; exit status 0 on success.

livekit-agents 1.8.9 and its OpenAI plugin come with KAME's dev extra (moshi is installed without its
aiohttp<3.12 pin: docs/dependencies.md); tests/test_livekit_live.py runs the same in the suite.
GPTLiveModel first ships in livekit-plugins-openai 1.8.1.

    kame serve --frontend tiny-copy --port 18999 &
    python scripts/livekit_live_check.py question.wav --url http://127.0.0.1:18999/v1
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import sys
import wave

from livekit import rtc
from livekit.agents import Agent, AgentSession
from livekit.plugins.openai.realtime import GPTLiveModel

RATE = 24000
CHUNK_S = 0.08  # one KAME frame per push
TAIL_S = 3  # seconds of silence sent at least, for the user's last words to come back
ANSWER = "Zebras sing in Oslo."  # words only this script supplies: heard back, they prove the round trip


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def read_wav(path: str) -> bytes:
    with wave.open(path, "rb") as wav:
        if (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) != (1, 2, RATE):
            raise SystemExit(f"{path}: a mono 16-bit 24 kHz WAV is needed")
        return wav.readframes(wav.getnframes())


class Log:
    """The server's events as LiveKit's plugin received them, and the assistant's words."""

    def __init__(self) -> None:
        self.types: collections.Counter[str] = collections.Counter()
        self.said = ""
        self.heard = ""
        self.delegations: list[str] = []
        self.errors: list[dict] = []
        self.user_turns: list[str] = []  # the user's turns as LiveKit closed them (its final transcripts)
        self.started = asyncio.Event()
        self.closed = asyncio.Event()

    def on_event(self, event: dict) -> None:
        kind = event.get("type", "")
        self.types[kind] += 1
        if kind == "session.started":
            self.started.set()
        elif kind == "session.closed":
            self.closed.set()
        elif kind == "session.output_transcript.delta":
            self.said += event.get("delta", "")
        elif kind == "session.input_transcript.delta":
            self.heard += event.get("delta", "")
        elif kind == "error":
            self.errors.append(event)

    def answered(self) -> bool:
        return " ".join(words(ANSWER)) in " ".join(words(self.said))


async def speak(duplex, pcm16: bytes, log: Log, limit_s: float) -> None:
    """The question, then silence, at real-time pace, until the answer is heard or `limit_s` passes."""
    step = int(RATE * CHUNK_S) * 2
    audio = pcm16 + bytes(int(RATE * limit_s) * 2)
    loop = asyncio.get_running_loop()
    start = loop.time()
    for offset in range(0, len(audio), step):
        if offset > len(pcm16) + RATE * 2 * TAIL_S and log.answered():
            return
        chunk = audio[offset:offset + step]
        duplex.push_audio(rtc.AudioFrame(data=chunk, sample_rate=RATE, num_channels=1,
                                         samples_per_channel=len(chunk) // 2))
        await asyncio.sleep(max(0.0, start + (offset + step) / (RATE * 2) - loop.time()))


async def main(args: argparse.Namespace) -> int:
    log = Log()
    model = GPTLiveModel(api_key="unused", base_url=args.url, delegation="client")
    session = AgentSession(llm=model)
    agent = Agent(instructions="You are the check's assistant. Answer in one short sentence.")
    await session.start(agent)  # no room: session.start goes out once the agent's instructions are set
    duplex = agent.duplex_session
    duplex.on("openai_server_event_received", log.on_event)

    @duplex.on("input_audio_transcription_completed")
    def on_user_turn(event) -> None:
        if event.is_final:
            log.user_turns.append(event.transcript)

    @duplex.on("delegation_created")
    def on_delegation(delegation) -> None:
        log.delegations.append(delegation.id)
        duplex.append_commentary(ANSWER, delegation_id=delegation.id)

    try:
        await asyncio.wait_for(log.started.wait(), 15)
        await speak(duplex, read_wav(args.question), log, args.listen)
    finally:
        await session.aclose()  # session.close, then (within 5 s) session.closed
        await model.aclose()
    print(f"server events: {dict(log.types)}")
    print(f"user (KAME's ASR): {log.heard.strip()!r}")
    print(f"user turns as LiveKit split them: {log.user_turns!r}")
    print(f"assistant: {log.said.strip()!r}")
    print(f"delegations answered: {len(log.delegations)}; session.closed: {log.closed.is_set()}")
    for error in log.errors:
        print(f"error event: {error}")
    ok = log.answered() and log.delegations and log.closed.is_set() and not log.errors
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("question", help="a mono 16-bit 24 kHz WAV of a spoken question")
    parser.add_argument("--url", default="http://127.0.0.1:18999/v1", help="KAME's HTTP base (default: %(default)s)")
    parser.add_argument("--listen", type=float, default=10.0, help="seconds of silence after the question at most")
    sys.exit(asyncio.run(main(parser.parse_args())))
