"""Pipecat with KAME as its speech-to-speech service: pipecat-ai's own OpenAI Realtime service, its
URL pointed at KAME's /v1/realtime. A question from a WAV file goes in, the spoken answer comes out.

Written for pipecat-ai[openai]==1.12.0, run on 1.14.0 (the dev extra's); tests/test_pipecat.py
runs `kame_llm()` and `conversation()` against a real server. See examples/README.md.

    python examples/pipecat_realtime.py question.wav answer.wav --url ws://127.0.0.1:8998

In a live app only the two ends change: Pipeline([transport.input(), user, llm, transport.output(), assistant])
with any Pipecat transport, and PipelineParams(audio_in_sample_rate=24000): the service sends the input
frames' bytes to KAME as they are, without resampling.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from pipecat.frames.frames import EndFrame, Frame, LLMRunFrame
from pipecat.pipeline.worker import PipelineWorker
from pipecat.services.openai.realtime import events
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.workers.runner import WorkerRunner
from pipecat_audio import RATE, conversation, read_wav, send_audio, write_answer  # beside this file


def kame_llm(url: str, token: str | None, instructions: str) -> OpenAIRealtimeLLMService:
    """Pipecat's OpenAI Realtime service, talking to the KAME server at `url` (ws:// or wss://)."""
    # {"type": "audio/pcm", "rate": 24000} both ways. Keep it: pipecat labels what it receives as 24 kHz PCM16
    # whatever the format (KAME's audio/pcmu and audio/pcma at 8 kHz are for clients that decode G.711).
    pcm = events.PCMAudioFormat()
    session = events.SessionProperties(
        output_modalities=["audio"],  # KAME always speaks; its words come as output_audio_transcript deltas
        # turn_detection and transcription left unset: KAME's defaults, server_vad (its ASR's endpointing) and
        # transcripts of the user from its own ASR. No `tools`: KAME stores them but does not call them yet.
        audio=events.AudioConfiguration(input=events.AudioInput(format=pcm), output=events.AudioOutput(format=pcm)),
    )
    settings = OpenAIRealtimeLLMService.Settings(
        model="kame",  # sent as ?model=kame; KAME serves one model whatever the name
        system_instruction=instructions,  # session.instructions: the system prompt of KAME's oracle LLM
        session_properties=session,
    )
    return OpenAIRealtimeLLMService(
        api_key=token or "unused",  # sent as "Authorization: Bearer ..."; KAME wants none on loopback
        base_url=f"{url.rstrip('/')}/v1/realtime",  # the full websocket URL, without a query: pipecat adds ?model=
        settings=settings,
    )


async def main(args: argparse.Namespace) -> None:
    llm = kame_llm(args.url, args.token, args.instructions)
    pipeline, context, recorder = conversation(llm)
    worker = PipelineWorker(pipeline, enable_rtvi=False, idle_timeout_secs=None)
    question = await read_wav(args.question)
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def on_started(worker: PipelineWorker, frame: Frame) -> None:
        started.set()

    async def talk() -> None:
        await started.wait()
        # before any audio: response.create (KAME's next words answer it) and, as the context is still empty,
        # no history for pipecat to send. Without it pipecat's first context update (at the end of the user's
        # first turn) sends the transcript so far to KAME as one typed user message.
        await worker.queue_frame(LLMRunFrame())
        await send_audio(worker, question + bytes(RATE * 2 * args.listen))  # then silence, for the answer
        await worker.queue_frame(EndFrame())

    runner = WorkerRunner(handle_sigint=True)
    await runner.add_workers(worker)
    await asyncio.gather(runner.run(), talk())
    write_answer(args.answer, recorder, context)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("question", help="a WAV file (mono, 16-bit, any rate)")
    parser.add_argument("answer", help="where the assistant's audio is written (24 kHz WAV)")
    parser.add_argument("--url", default="ws://127.0.0.1:8998", help="the KAME server (default: %(default)s)")
    parser.add_argument("--token", default=os.environ.get("KAME_TOKEN"), help="bearer token (default: $KAME_TOKEN)")
    parser.add_argument("--instructions", default="You are a helpful assistant. Answer in one or two sentences.")
    parser.add_argument("--listen", type=int, default=8, help="seconds of silence sent after the question")
    asyncio.run(main(parser.parse_args()))
