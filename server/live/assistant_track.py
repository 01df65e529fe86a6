"""The assistant's voice on a WebRTC session's media track: the front-end's 24 kHz frames as 20 ms
packets at 48 kHz, at real-time pace, kept near real time when frames come late."""

from __future__ import annotations

import asyncio
import collections
import fractions
from collections.abc import Callable

import av
import numpy as np
from aiortc import MediaStreamTrack
from aiortc.mediastreams import MediaStreamError

from kame.pcm import Resampler

WIRE_RATE = 48000  # Opus
PTIME_SAMPLES = 960  # 20 ms at 48 kHz: one RTP packet
MAX_QUEUED_S = 1.0  # the assistant's audio queued for the track beyond this: the oldest is dropped
STANDING_TICKS = 8  # the queue's low over the last 8 packets (two frames) is what a late frame left behind
HURRY_SAMPLES = (120, 240)  # 2.5 or 5 ms (past 40 ms behind) out of a 20 ms packet of speech, cross-faded
SILENT_PEAK = 1e-3  # of full scale: a packet under it is silence (skippable)


class AssistantTrack(MediaStreamTrack):
    """The assistant's voice: the mapping's 24 kHz frames (`play`), sent as 20 ms frames at 48 kHz
    at real-time pace; silence when nothing is queued. Whatever came late (a slow step, the frames
    made before the peer connected, the user's audio held up and then let through at once) would
    delay every later packet for good: it is caught up on (`_next_packet`)."""

    kind = "audio"

    def __init__(self, sent: Callable[[int, int], None] | None = None) -> None:
        super().__init__()
        self._sent = sent  # (frame, packet): a frame's first sample went out in that packet (the bench's timing)
        self._frames: collections.deque[tuple[int, int]] = collections.deque()  # (frame, its first sample's place)
        self._queued_total = self._taken_total = 0  # samples ever queued, ever taken (sent, skipped or dropped)
        self._upsample = Resampler(24000, 48000)
        self._queued: collections.deque[np.ndarray] = collections.deque()
        self._samples = 0
        self._start: float | None = None
        self._pts = 0
        self.dropped_samples = 0  # speech dropped past MAX_QUEUED_S
        self.skipped_samples = 0  # silence skipped to catch up
        self.hurried_samples = 0  # speech cut (cross-faded) to catch up
        self._levels: collections.deque[int] = collections.deque(maxlen=STANDING_TICKS)  # queued at each tick

    def play(self, pcm: np.ndarray, frame: int | None = None) -> None:
        chunk = (np.clip(self._upsample(np.asarray(pcm, np.float32)), -1.0, 1.0) * 32767).astype(np.int16)
        if self._sent is not None and frame is not None:
            self._frames.append((frame, self._queued_total))
        self._queued.append(chunk)
        self._samples += len(chunk)
        self._queued_total += len(chunk)
        while self._samples > MAX_QUEUED_S * WIRE_RATE:  # the peer's clock runs slow: keep it live
            old = self._queued.popleft()
            self._samples -= len(old)
            self._taken_total += len(old)
            self.dropped_samples += len(old)

    def _next_packet(self) -> np.ndarray:
        """The next 20 ms. The queue's level swings by a frame (80 ms) as frames arrive; its low over
        two frames is what is standing: audio that came late and would delay the rest. While that is
        over a packet, silent packets at the head are skipped and speech is hurried: 22.5 ms (25 ms
        past 40 ms behind) made into 20, the cut cross-faded (a jitter buffer's 'accelerate', without
        pitch alignment, so the cut is kept short)."""
        self._levels.append(self._samples)
        behind = min(self._levels) - PTIME_SAMPLES if len(self._levels) == STANDING_TICKS else 0
        while behind > 0 and self._samples > PTIME_SAMPLES and self._head_peak() < SILENT_PEAK:
            self._take(PTIME_SAMPLES)
            self._caught_up(PTIME_SAMPLES)
            self.skipped_samples += PTIME_SAMPLES
            behind -= PTIME_SAMPLES
        cut = HURRY_SAMPLES[behind > 0.04 * WIRE_RATE]
        if behind < cut or self._samples < PTIME_SAMPLES + cut:
            return self._take(PTIME_SAMPLES)
        head = self._take(PTIME_SAMPLES + cut).copy()
        fade = np.linspace(0.0, 1.0, cut, dtype=np.float32)
        tail = slice(PTIME_SAMPLES - cut, PTIME_SAMPLES)
        head[tail] = (head[tail] * (1.0 - fade) + head[PTIME_SAMPLES:] * fade).astype(np.int16)
        self.hurried_samples += cut
        self._caught_up(cut)
        return head[:PTIME_SAMPLES]

    def _caught_up(self, samples: int) -> None:
        """What was standing is less by `samples` in every level kept."""
        self._levels = collections.deque((level - samples for level in self._levels), maxlen=STANDING_TICKS)

    def _report_sent(self, begins: int) -> None:
        """Each frame whose first sample was in the packet just made (or was skipped before it)."""
        while self._frames and self._frames[0][1] < self._taken_total:
            frame, place = self._frames.popleft()
            if place >= begins:
                self._sent(frame, self._pts // PTIME_SAMPLES)

    def _head_peak(self) -> float:
        peak, seen = 0, 0
        for chunk in self._queued:
            part = chunk[:PTIME_SAMPLES - seen]
            peak, seen = max(peak, int(np.abs(part.astype(np.int32)).max(initial=0))), seen + len(part)
            if seen >= PTIME_SAMPLES:
                break
        return peak / 32767

    def _take(self, count: int) -> np.ndarray:
        """The next `count` samples (int16; a view where one chunk holds them), silence past the queue."""
        if self._queued and len(head := self._queued[0]) >= count:
            self._queued[0] = head[count:]
            if len(head) == count:
                self._queued.popleft()
            self._samples -= count
            self._taken_total += count
            return head[:count]
        out = np.zeros(count, np.int16)
        filled = 0
        while filled < count and self._queued:
            chunk = self._queued[0]
            n = min(count - filled, len(chunk))
            out[filled:filled + n] = chunk[:n]
            if n == len(chunk):
                self._queued.popleft()
            else:
                self._queued[0] = chunk[n:]
            filled += n
        self._samples -= filled
        self._taken_total += filled
        return out

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        loop = asyncio.get_running_loop()
        if self._start is None:
            self._start = loop.time()
        else:  # an absolute schedule: no drift
            self._pts += PTIME_SAMPLES
            await asyncio.sleep(self._start + self._pts / WIRE_RATE - loop.time())
        begins = self._taken_total
        pcm16 = self._next_packet()
        self._report_sent(begins)
        frame = av.AudioFrame.from_ndarray(pcm16.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = WIRE_RATE, self._pts, fractions.Fraction(1, WIRE_RATE)
        return frame
