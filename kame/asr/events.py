"""The streaming ASR contract: push 24 kHz PCM without blocking, iterate typed transcript events.

Every event is stamped with *audio time*: seconds of the session's audio, counted from the
first sample pushed, not wall time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class PartialTranscript:
    """The current hypothesis of an utterance still being spoken; a later one may change it."""

    text: str
    start_s: float  # audio time the utterance started
    end_s: float  # audio time up to which audio was heard for this hypothesis
    # the speech paused (the VAD heard it end): these words are settled, later hypotheses of the utterance
    # start with them, though the turn may go on; repeated through the pause while the turn stays open
    settled: bool = False


@dataclass(frozen=True)
class FinalTranscript:
    """An utterance ended (end of turn or length cap): its text will not change."""

    text: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class AsrFailure:
    """The ASR engine failed; the stream ends after this event."""

    message: str


TranscriptEvent = PartialTranscript | FinalTranscript | AsrFailure


async def drain_events(queue) -> AsyncIterator[TranscriptEvent]:
    """Yield a stream's events from its asyncio queue until None (closed) or a failure (last)."""
    while (event := await queue.get()) is not None:
        yield event
        if isinstance(event, AsrFailure):
            return


class TranscriptStream(Protocol):
    """One session's ASR stream."""

    def push_pcm(self, pcm: np.ndarray) -> None:
        """Queue 24 kHz mono float32 samples; never blocks."""

    async def flush(self) -> None:
        """The input ended: finish the current utterance (a final event follows if it had words)."""

    async def aclose(self) -> None:
        """Stop the stream; iteration ends."""

    def __aiter__(self) -> AsyncIterator[TranscriptEvent]: ...


class AsrEngine(Protocol):
    """A loaded ASR model that opens one stream per session."""

    name: str

    def open_stream(self) -> TranscriptStream:
        """Open a stream; must be called inside a running asyncio loop."""

    def warm_up(self) -> None:
        """Pay first-call costs (kernels, allocations) before any user comes (blocking)."""

    def close(self) -> None: ...
