"""A real Pipecat pipeline against /v1/realtime on loopback: pipecat-ai's own OpenAI Realtime service,
set up as examples/pipecat_realtime.py does, hears the spoken question (tiny-copy, Whisper tiny.en, the
scripted LLM behind the server) and gets the spoken answer back as Pipecat frames and context messages."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pipecat.services.openai.realtime.llm",
                    reason="needs the dev extra (pipecat-ai[openai])")

from pipecat.frames.frames import (
    ErrorFrame,
    LLMContextAssistantTurnFrame,
    LLMRunFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
    TTSTextFrame,
)
from pipecat.observers.base_observer import BaseObserver, FramePushed
from pipecat.pipeline.worker import PipelineWorker
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.workers.runner import WorkerRunner

from kame.pcm import pcm16_encode

from .conftest import words
from .server_harness import wait_until_all_slots_free

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).parent.parent / "examples" / "pipecat_realtime.py"
INSTRUCTIONS = "You are the test's assistant. Answer in one short sentence."


def load_example(path: Path = EXAMPLE):
    """The example as `python examples/NAME.py` loads it: its folder first on the path (it imports
    pipecat_audio.py from beside it)."""
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


class Heard(BaseObserver):
    """What the LLM service pushed into the pipeline: the assistant's audio and words, the user's
    transcript (sent upstream, to the user aggregator), errors; and the assistant turns the
    assistant aggregator wrote into the context (the GPT-Live test's service pushes its audio as
    another frame type: `audio_type`)."""

    audio_type: type = TTSAudioRawFrame

    def __init__(self, llm: OpenAIRealtimeLLMService) -> None:
        super().__init__(observe_every_push=False)
        self.llm = llm
        self.audio: list = []
        self.said: list[str] = []
        self.user: list[str] = []
        self.errors: list[str] = []
        self.turns: list[str] = []
        self.changed = asyncio.Event()

    async def on_push_frame(self, data: FramePushed) -> None:
        frame = data.frame
        if isinstance(frame, LLMContextAssistantTurnFrame):
            self.turns.append(frame.text)
        elif data.source is not self.llm:
            return
        elif isinstance(frame, self.audio_type):
            self.audio.append(frame)
        elif isinstance(frame, TTSTextFrame):
            self.said.append(frame.text)
        elif isinstance(frame, TranscriptionFrame):
            self.user.append(frame.text)
        elif isinstance(frame, ErrorFrame):
            self.errors.append(frame.error)
        else:
            return
        self.changed.set()

    def answered(self) -> bool:
        return " ".join(words("Paris is the capital of France")) in " ".join(words("".join(self.said)))

    async def wait(self, predicate, limit_s: float, what: str) -> None:
        """Until `predicate()`; fails at once on an error frame or when the service stops reading events."""
        reading = self.llm._receive_task  # pipecat logs and swallows what ends it: watch it here
        try:
            await asyncio.wait_for(self._until(predicate, reading, what), limit_s)
        except TimeoutError:
            raise AssertionError(f"no {what} within {limit_s} s; the assistant said {''.join(self.said)!r}, "
                                 f"the user {self.user!r}") from None

    async def _until(self, predicate, reading, what: str) -> None:
        while not predicate():
            assert not self.errors, f"the pipeline got errors while waiting for {what}: {self.errors}"
            assert reading is None or not reading.done(), (
                f"pipecat's service stopped reading server events while waiting for {what} (its log says why)")
            self.changed.clear()
            changed = asyncio.ensure_future(self.changed.wait())
            await asyncio.wait([changed, *([reading] if reading else [])], return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()


def test_a_pipecat_pipeline_talks_to_kame(tandem_server, scripted_llm, voices):
    url, services = tandem_server
    example = load_example()
    question = np.concatenate([np.zeros(12000, np.float32), voices["france"], np.zeros(24000 * 4, np.float32)])

    async def go():
        llm = example.kame_llm(url, None, INSTRUCTIONS)
        pipeline, context, recorder = example.conversation(llm)
        heard = Heard(llm)
        worker = PipelineWorker(pipeline, observers=[heard], enable_rtvi=False, cancel_on_idle_timeout=False)
        started = asyncio.Event()

        @worker.event_handler("on_pipeline_started")
        async def on_started(worker, frame) -> None:
            started.set()

        async def converse() -> None:
            await asyncio.wait_for(started.wait(), 10)
            await worker.queue_frame(LLMRunFrame())  # as the example does: response.create up front
            speaking = asyncio.ensure_future(example.send_audio(worker, pcm16_encode(question)))
            try:
                await heard.wait(heard.answered, 25, "the spoken answer")
                await heard.wait(lambda: heard.user, 15, "the user's transcript")
                await heard.wait(lambda: any("paris" in words(t) for t in heard.turns), 10, "the answer's turn")
            finally:
                speaking.cancel()
                await worker.cancel(reason="the test is over")  # ends runner.run() below, pass or fail

        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(worker)
        for result in await asyncio.gather(runner.run(), converse(), return_exceptions=True):
            if isinstance(result, BaseException):
                raise result
        return heard, context, recorder

    try:
        heard, context, recorder = asyncio.run(go())
    finally:
        wait_until_all_slots_free(services)
    assert not heard.errors
    # the user's side: KAME's ASR transcript, as a TranscriptionFrame, written into the context
    assert words(" ".join(heard.user))[:6] == words("What is the capital of France")
    messages = context.get_messages()
    assert any(m["role"] == "user" and "france" in words(m["content"]) for m in messages)
    assert any(m["role"] == "assistant" and "paris" in words(m["content"]) for m in messages)  # at response.done
    # the assistant's side: 24 kHz PCM16 in 80 ms frames, through the pipeline to where a transport plays it
    assert len(heard.audio) >= 5 and all(f.sample_rate == 24000 and len(f.audio) == 3840 for f in heard.audio)
    assert len(recorder.audio) >= 5 * 3840
    assert any(r["messages"][0]["content"] == INSTRUCTIONS for r in scripted_llm.requests)  # reached the LLM
