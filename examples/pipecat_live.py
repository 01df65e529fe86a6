"""Pipecat with KAME as its GPT-Live model: pipecat-ai's own OpenAI Live service, its URL pointed at
KAME's /v1/live/sessions. A question from a WAV file goes in, the spoken answer comes out.

Written for pipecat-ai[openai]==1.12.0, run on 1.14.0 (the dev extra's); tests/test_pipecat_live.py runs
`kame_live_llm()` and `conversation()` against a real server, in both delegation modes. See examples/README.md.

    python examples/pipecat_live.py question.wav answer.wav --url ws://127.0.0.1:8998
    python examples/pipecat_live.py question.wav answer.wav --client-llm http://127.0.0.1:8000/v1 --model m

`responses` delegation (the default): KAME's own planner and LLM answer. `client` delegation (with
--client-llm): KAME calls no LLM; each time its planner would, Pipecat's backend worker asks the
OpenAI-compatible LLM at --client-llm and KAME's front-end says what that LLM answered.

In a live app only the two ends change: Pipeline([transport.input(), user, llm, transport.output(),
assistant]) with any Pipecat transport (LocalAudioTransport needs pipecat-ai[local], i.e. PyAudio).
"""

from __future__ import annotations

import argparse
import asyncio
import os

from pipecat.frames.frames import LLMRunFrame
from pipecat.pipeline.worker import PipelineWorker
from pipecat.services.openai.live.llm import ClientDelegation, OpenAILiveLLMService, ResponsesDelegation
from pipecat.services.openai.llm import OpenAILLMService
from pipecat.services.openai.responses.llm import OpenAIResponsesLLMService
from pipecat.workers.llm import BackendLLMWorker
from pipecat.workers.runner import WorkerRunner
from pipecat_audio import RATE, conversation, read_wav, send_audio, write_answer  # beside this file


def responses_delegation(profile: str) -> ResponsesDelegation:
    """KAME answers with its own planner and LLM: `profile` names one of the server's LLM profiles
    (a model name that names none gets the server's default profile)."""
    return ResponsesDelegation(settings=OpenAIResponsesLLMService.Settings(model=profile))


def client_delegation(llm_url: str, model: str, api_key: str = "unused") -> ClientDelegation:
    """Pipecat answers: a backend worker runs an OpenAI-compatible chat LLM on each delegation and sends
    its answer back as `session.commentary.append`, which KAME's front-end speaks."""
    backend_llm = OpenAILLMService(api_key=api_key, base_url=llm_url, settings=OpenAILLMService.Settings(model=model))
    return ClientDelegation(backend=BackendLLMWorker(llm=backend_llm), timeout_secs=30.0)


def kame_live_llm(url: str, token: str | None, instructions: str,
                  delegation: ResponsesDelegation | ClientDelegation) -> OpenAILiveLLMService:
    """Pipecat's OpenAI Live service, talking to the KAME server at `url` (ws:// or wss://)."""
    return OpenAILiveLLMService(
        api_key=token or "unused",  # sent as "Authorization: Bearer ..."; KAME wants none on loopback
        base_url=f"{url.rstrip('/')}/v1/live/sessions",  # pipecat takes the full websocket URL
        # session.instructions: added to the prompt of KAME's planner. The model name is echoed, not used.
        settings=OpenAILiveLLMService.Settings(system_instruction=instructions),
        delegation=delegation,
    )


async def main(args: argparse.Namespace) -> None:
    delegation = (client_delegation(args.client_llm, args.model, os.environ.get("OPENAI_API_KEY", "unused"))
                  if args.client_llm else responses_delegation(args.model))
    llm = kame_live_llm(args.url, args.token, args.instructions, delegation)
    pipeline, context, recorder = conversation(llm)
    worker = PipelineWorker(pipeline, enable_rtvi=False, idle_timeout_secs=None)
    question = await read_wav(args.question)
    started = asyncio.Event()
    runner = WorkerRunner(handle_sigint=True)  # a client delegation's backend runs as a child worker

    @llm.event_handler("on_session_started")
    async def on_started(llm: OpenAILiveLLMService, session: object) -> None:
        started.set()  # audio sent before session.started is dropped by pipecat

    async def talk() -> None:
        await worker.queue_frame(LLMRunFrame())  # the first context frame sends session.start
        await asyncio.wait_for(started.wait(), 30)
        await send_audio(worker, question + bytes(RATE * 2 * args.listen))  # then silence, for the answer
        # session.close: KAME drains, then session.closed. runner.end(), not an EndFrame: pipecat 1.12 ends a
        # pipeline worker's children (client delegation's backend) only when the runner ends the worker.
        await runner.end(reason="the question was answered")

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
    parser.add_argument("--client-llm", help="client delegation: an OpenAI-compatible base URL (…/v1) "
                        "for Pipecat's backend worker; its key from $OPENAI_API_KEY")
    parser.add_argument("--model", default="default", help="responses: a KAME LLM profile; client: the "
                        "backend LLM's model (default: %(default)s)")
    parser.add_argument("--listen", type=int, default=8, help="seconds of silence sent after the question")
    asyncio.run(main(parser.parse_args()))
