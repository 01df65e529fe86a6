"""Run a streaming ASR engine over a whole file (`kame transcribe`)."""

from __future__ import annotations

import asyncio

import numpy as np

from kame.asr.events import AsrEngine, TranscriptEvent
from kame.audio import FRAME_SIZE, SAMPLE_RATE


async def transcribe_pcm(asr: AsrEngine, pcm: np.ndarray, realtime: bool = False) -> list[TranscriptEvent]:
    """Push `pcm` (24 kHz) frame by frame (paced to real time if asked), then flush; all events."""
    stream = asr.open_stream()
    events: list[TranscriptEvent] = []

    async def collect() -> None:
        async for event in stream:
            events.append(event)

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(collect(), name="asr-events")
        for start in range(0, len(pcm), FRAME_SIZE):
            stream.push_pcm(pcm[start:start + FRAME_SIZE])
            await asyncio.sleep(FRAME_SIZE / SAMPLE_RATE if realtime else 0)
        await stream.flush()
        await stream.aclose()
    return events
