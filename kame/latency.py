"""A session's timing on its clock: frame latency, the ASR's lag, frames skipped and the oracle lead.

The session feeds it what happens (audio in, frames out, each event it emits) and the tracker
answers with the timing events (`FramesSkipped`, `OracleLead`, `SessionStats`) that follow from
them; it reads only the injected clock, so a promise about time is tested on `ManualClock`.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque

from kame.audio import SAMPLE_RATE
from kame.clock import Clock
from kame.session_events import (
    FramesSkipped,
    LLMAttempt,
    OracleApplied,
    OracleLead,
    SessionEvent,
    SessionStats,
    Transcript,
)

RECENT_RESETS = 64  # oracle resets remembered: only recent oracles can be an answer's
# seconds of the user's audio whose arrival times are kept: an ASR's final ends within this much of the
# newest audio (a lag beyond it reads as this long); a bound in time, so a long session's memory stays flat
LAG_WINDOW_S = 20.0


class LatencyTracker:
    """Times one session: when its audio came in, when its frames came out, and when the oracle
    that answered the user was in place compared with when the user stopped."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._pushed_at: deque[float] = deque()  # per input frame not out yet: when it was pushed
        self._latencies: deque[float] = deque(maxlen=100)
        self._audio_at: deque[tuple[float, float]] = deque()  # (audio end s, clock time received), LAG_WINDOW_S
        self._samples_in = 0
        self.frames_skipped = 0  # input frames the engine skipped to stay live
        self._newest_epoch = 0  # of the LLM attempts started so far
        self._reset_at: dict[int, float] = {}  # oracle epoch -> when its reset was applied
        self._speech_end: float | None = None  # clock time the user's last utterance ended
        self._answer_after: int | None = None  # after the user stopped: attempts newer than this answer it
        self._lead_pending: int | None = None  # the oracle epoch whose application gives the lead

    @property
    def audio_s(self) -> float:
        """Seconds of the user's audio received so far."""
        return self._samples_in / SAMPLE_RATE

    # ---------------------------------------------------------------- audio in, frames out

    def audio_in(self, samples: int, frames: int) -> None:
        """`samples` of the user's audio came in now, completing `frames` input frames."""
        now = self.clock.now()
        self._samples_in += samples
        self._audio_at.append((self.audio_s, now))
        while self._audio_at[0][0] < self.audio_s - LAG_WINDOW_S:
            self._audio_at.popleft()
        self._pushed_at.extend([now] * frames)

    def frame_out(self, skipped_total: int) -> tuple[float | None, FramesSkipped | None]:
        """An output frame came out, the engine having skipped `skipped_total` input frames so far:
        the frame's latency (input pushed -> output), and the frames newly skipped, if any."""
        skipped = None
        if skipped_total > self.frames_skipped:
            count = skipped_total - self.frames_skipped
            for _ in range(min(count, len(self._pushed_at))):  # skipped frames never come out
                self._pushed_at.popleft()
            self.frames_skipped, skipped = skipped_total, FramesSkipped(count)
        if not self._pushed_at:
            return None, skipped
        latency = self.clock.now() - self._pushed_at.popleft()
        self._latencies.append(latency)
        return latency, skipped

    def lag(self, audio_s: float) -> float:
        """Clock time since the audio up to `audio_s` was received."""
        now = self.clock.now()
        if not self._audio_at:
            return 0.0
        index = min(bisect.bisect_left(self._audio_at, (audio_s, 0.0)), len(self._audio_at) - 1)
        return max(0.0, now - self._audio_at[index][1])

    def stats(self, frames_in: int, frames_out: int, output_dropped: int) -> SessionStats:
        latency = statistics.median(self._latencies) * 1000 if self._latencies else None
        return SessionStats(frames_in, frames_out, self.frames_skipped + output_dropped,
                            None if latency is None else round(latency, 2))

    # ---------------------------------------------------------------- the oracle lead

    def user_stopped(self, lag_s: float = 0.0) -> None:
        """The user's utterance ended `lag_s` ago: the answer comes from an attempt started from now on."""
        self._speech_end, self._answer_after = self.clock.now() - lag_s, self._newest_epoch

    def on_event(self, event: SessionEvent) -> OracleLead | None:
        """Note an event the session emitted; the oracle lead, when this event settles it."""
        if isinstance(event, Transcript) and event.final:
            self.user_stopped(event.lag_s)
        elif isinstance(event, LLMAttempt):
            return self._on_attempt(event)
        elif isinstance(event, OracleApplied) and event.op == "reset":
            if len(self._reset_at) >= RECENT_RESETS:
                del self._reset_at[min(self._reset_at)]
            self._reset_at[event.epoch] = self.clock.now()
            if event.epoch == self._lead_pending:
                return self._lead(event.epoch)
        return None

    def _on_attempt(self, event: LLMAttempt) -> OracleLead | None:
        if event.phase == "started":
            self._newest_epoch = max(self._newest_epoch, event.epoch)
        elif event.phase == "done" and self._answer_after is not None and event.epoch > self._answer_after:
            self._answer_after = None  # once per utterance (a final may be deferred by the rate limit)
            return self._answer_settled(event.oracle_epoch)
        return None

    def _answer_settled(self, epoch: int) -> OracleLead | None:
        """The user's utterance has its answer: the oracle of `epoch` in place now is the answer's."""
        if not epoch or self._speech_end is None:
            return None
        if epoch in self._reset_at:
            return self._lead(epoch)
        self._lead_pending = epoch  # its reset is still on the way to the engine
        return None

    def _lead(self, epoch: int) -> OracleLead | None:
        self._lead_pending = None
        if self._speech_end is None:
            return None
        return OracleLead(round(self._speech_end - self._reset_at[epoch], 3), epoch)
