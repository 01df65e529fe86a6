"""A session's ASR stream, kept only while it keeps up: a failing or stalled ASR is given up on,
and the session goes on as the front-end alone (plain Moshi)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import numpy as np

from kame.asr.events import AsrFailure, TranscriptEvent
from kame.clock import Clock

RECHECK_S = 0.1  # the stall watch looks again at least this long after a look


class AsrFeed:
    """Feeds the user's audio to an ASR stream and hands on its transcripts while it is healthy;
    `on_failed(message)` is told once when it is given up on (failed, or `stall_s` behind)."""

    def __init__(self, stream, clock: Clock, stall_s: float, on_failed: Callable[[str], None],
                 enabled: bool = True) -> None:
        self.stream, self.clock, self.stall_s = stream, clock, stall_s
        self._on_failed = on_failed
        self.ok = enabled  # False: no ASR (asked for none, or given up on)

    def push_pcm(self, pcm: np.ndarray) -> None:
        if self.ok:
            self.stream.push_pcm(pcm)

    async def flush(self) -> None:
        if self.ok:
            await self.stream.flush()

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def transcripts(self) -> AsyncIterator[TranscriptEvent]:
        """The stream's transcripts until it fails or is given up on."""
        async for event in self.stream:
            if not self.ok:
                return  # given up on (stalled): its late transcripts would only mislead the planner
            if isinstance(event, AsrFailure):
                self._fail(f"the ASR failed ({event.message}); going on without oracle updates")
                return
            yield event

    async def watch(self) -> None:
        """Give up on the ASR once it is `stall_s` behind: sleep until the soonest it could be, then look."""
        stalled_for = getattr(self.stream, "stalled_for_s", lambda: 0.0)
        while self.ok:
            lag = stalled_for()
            if lag >= self.stall_s:
                self._fail(f"the ASR is {lag:.0f} s behind; going on without transcripts (plain Moshi)")
                await self.stream.aclose()  # its backlog is not worked through on a shared CPU
                return
            await self.clock.sleep(max(self.stall_s - lag, RECHECK_S))

    def _fail(self, message: str) -> None:
        if self.ok:
            self.ok = False
            self._on_failed(message)
