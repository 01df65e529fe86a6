"""The assistant's audio to a phone carrier in real time, a small lead ahead of what the caller has heard.

A carrier buffers whatever it is sent and plays it out at its own pace: audio sent seconds ahead keeps
playing after the caller interrupts, and a `clear` then has seconds to drop. So each 80 ms frame goes out
only while fewer than `lead_frames` frames sent are still unplayed. What has played is known from the
carrier's marks (a mark sent after a frame comes back once the audio before it has played, or once a
`clear` dropped it); a carrier without marks, or whose marks stop coming, is paced on the session's clock
(its play head: what was sent plays back to back from when it arrived). Pure: frames, marks and the time
in; what to send now out.

The front-end makes a frame every 80 ms and the carrier plays one every 80 ms, so frames that pile up
behind the lead (a burst after a stalled step, a carrier that played late) would stay a delay for the rest
of the call. Past `max_waiting` frames waiting, the oldest is dropped, as the caller's side skips to live.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from kame.audio import FRAME_S

MARKS_SILENT_S = 2.0  # unplayed frames and no mark this long: the carrier does not mark; paced on the clock


@dataclass(frozen=True)
class Outgoing:
    """One frame of the assistant's audio to send, then its mark (None: the carrier takes no marks)."""

    payload: object  # the carrier's encoding of the frame (base64 text, or bytes)
    mark: str | None
    frame: int  # the session's frame it holds


class Pacer:
    def __init__(self, lead_frames: int = 2, marks: bool = True, max_waiting: int | None = None) -> None:
        self.lead_frames, self.marks = lead_frames, marks
        self.max_waiting = lead_frames if max_waiting is None else max_waiting  # frames behind the lead
        self.dropped = 0  # frames dropped from the wait, ever
        self._queue: collections.deque[tuple[object, int]] = collections.deque()
        self._sent = 0  # frames sent, ever (a frame's mark is its number)
        self._played = 0  # of them, those the carrier has marked played (or a clear dropped)
        self._frames: collections.deque[tuple[int, int]] = collections.deque()  # (number, session frame) unplayed
        self._last_frame: int | None = None  # the session frame of the last one played
        self._playhead = 0.0  # the clock's estimate: when everything sent so far has played
        self._last_mark = 0.0  # when a mark last came (or the first frame went out after all had played)
        self.max_lead = 0  # the most frames ever unplayed at once (the bench's figure)

    # ---------------------------------------------------------------- in

    def push(self, payload: object, frame: int) -> None:
        """The assistant's next frame, encoded for the carrier (the oldest waiting one dropped past the bound)."""
        self._queue.append((payload, frame))
        while len(self._queue) > self.max_waiting:
            self._queue.popleft()
            self.dropped += 1

    def marked(self, name: str, now: float) -> None:
        """The carrier's mark came back: the frames up to it have played (or were cleared)."""
        try:
            number = int(name)
        except ValueError:
            return  # not one of ours
        self._last_mark = now
        self._played_up_to(number)

    def clear(self, now: float) -> int | None:
        """A barge-in: nothing queued goes out, and what was sent is taken to be dropped by the carrier's
        `clear` (sent with it); returns the session frame heard last (None: none yet)."""
        self._queue.clear()
        if not self.marks or self._marks_silent(now):
            self._played_by_clock(now)
        heard = self._last_frame
        self._frames.clear()
        self._played = self._sent  # the marks still coming for the dropped frames change nothing
        self._playhead = now
        return heard

    # ---------------------------------------------------------------- out

    def take(self, now: float) -> list[Outgoing]:
        """What to send now, in order (each frame with its mark where the carrier takes marks)."""
        if not self.marks or self._marks_silent(now):
            self._played_by_clock(now)
        out = []
        while self._queue and self._sent - self._played < self.lead_frames:
            payload, frame = self._queue.popleft()
            if self._sent == self._played:  # all had played: the carrier starts afresh
                self._last_mark = now
            self._sent += 1
            self._frames.append((self._sent, frame))
            self._playhead = max(self._playhead, now) + FRAME_S
            self.max_lead = max(self.max_lead, self._sent - self._played)
            out.append(Outgoing(payload, str(self._sent) if self.marks else None, frame))
        return out

    def wake_at(self, now: float) -> float | None:
        """When to look again with frames waiting but no room (None: a frame or a mark will say)."""
        if not self._queue:
            return None
        if not self.marks or self._marks_silent(now):
            return self._next_played_by_clock()
        return self._last_mark + MARKS_SILENT_S

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def lead(self) -> int:
        """Frames sent and not yet played."""
        return self._sent - self._played

    @property
    def heard_frame(self) -> int | None:
        """The session frame the caller heard last."""
        return self._last_frame

    # ---------------------------------------------------------------- the play head

    def _marks_silent(self, now: float) -> bool:
        return self._sent > self._played and now - self._last_mark > MARKS_SILENT_S

    def _next_played_by_clock(self) -> float | None:
        unplayed = self._sent - self._played
        if unplayed < self.lead_frames:
            return None
        return self._playhead - (unplayed - self.lead_frames + 1) * FRAME_S

    def _played_by_clock(self, now: float) -> None:
        """Without marks: a frame has played once the play head has passed its end."""
        unplayed = max(0, int((self._playhead - now) / FRAME_S + 0.999))
        self._played_up_to(self._sent - unplayed)

    def _played_up_to(self, number: int) -> None:
        while self._frames and self._frames[0][0] <= number:
            self._last_frame = self._frames.popleft()[1]
        self._played = max(self._played, min(number, self._sent))
