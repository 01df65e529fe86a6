"""What both Pipecat examples share: a question WAV sent into a pipeline at a microphone's pace, the
assistant's audio kept as it passes, and the answer written out with the conversation Pipecat's
aggregators recorded. Imported by pipecat_realtime.py and pipecat_live.py (keep it beside them)."""

from __future__ import annotations

import asyncio
import wave

from pipecat.audio.utils import create_file_resampler
from pipecat.frames.frames import Frame, InputAudioRawFrame, OutputAudioRawFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor

RATE = 24000  # PCM16 mono both ways, KAME's native rate (both protocols' default)
CHUNK = RATE * 2 * 80 // 1000  # 80 ms of PCM16 per InputAudioRawFrame (one KAME frame)


class AnswerRecorder(FrameProcessor):
    """Keeps the assistant's audio as it passes (where a transport.output() would play it): the
    Realtime service pushes TTSAudioRawFrame, the live one SpeechOutputAudioRawFrame, both output audio."""

    def __init__(self) -> None:
        super().__init__()
        self.audio = bytearray()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, OutputAudioRawFrame):
            self.audio += frame.audio
        await self.push_frame(frame, direction)


def conversation(llm: FrameProcessor) -> tuple[Pipeline, LLMContext, AnswerRecorder]:
    """The usual speech-to-speech pipeline: the aggregators write both sides' turns into the context,
    which starts empty (pipecat would send earlier history to KAME as typed input)."""
    context = LLMContext()
    user, assistant = LLMContextAggregatorPair(context)
    recorder = AnswerRecorder()
    return Pipeline([user, llm, recorder, assistant]), context, recorder


async def send_audio(worker: PipelineWorker, pcm16: bytes) -> None:
    """PCM16 at 24 kHz into the pipeline at real-time pace, as a microphone would send it."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    for offset in range(0, len(pcm16), CHUNK):
        frame = InputAudioRawFrame(audio=pcm16[offset:offset + CHUNK], sample_rate=RATE, num_channels=1)
        await worker.queue_frame(frame)
        await asyncio.sleep(max(0.0, start + (offset + CHUNK) / (RATE * 2) - loop.time()))


async def read_wav(path: str) -> bytes:
    with wave.open(path, "rb") as wav:
        if wav.getnchannels() != 1 or wav.getsampwidth() != 2:
            raise SystemExit(f"{path}: a mono 16-bit WAV is needed")
        rate, audio = wav.getframerate(), wav.readframes(wav.getnframes())
    return audio if rate == RATE else await create_file_resampler().resample(audio, rate, RATE)


def write_answer(path: str, recorder: AnswerRecorder, context: LLMContext) -> None:
    """The assistant's audio as a 24 kHz WAV, then the conversation as the context holds it."""
    with wave.open(path, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(RATE)
        wav.writeframes(bytes(recorder.audio))
    for message in context.get_messages():
        print(f"{message['role']}: {message['content']}")
