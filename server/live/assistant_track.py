"""The assistant's voice on a WebRTC session's media track: the front-end's 24 kHz frames encoded to
Opus as they are (40 ms packets) on a pacer thread shared by the tracks, at real-time pace, kept near real
time when frames come late. The event loop only hands each packet to aiortc's sender."""

from __future__ import annotations

import asyncio
import collections
import fractions
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable

import av
import numpy as np
from aiortc import MediaStreamTrack
from aiortc.mediastreams import MediaStreamError

from kame import opus
from kame.pcm import Resampler
from kame.rtc import sends_opus_packets

logger = logging.getLogger(__name__)

RATE = 24000  # the front-end's audio, which libopus takes as it is
WIRE_RATE = 48000  # the RTP clock of Opus, whatever the rate encoded
SLOT = 960  # 20 ms of the RTP clock: the unit `sent` reports packets in (the bench's)
PTIME_SAMPLES = 960  # 40 ms at 24 kHz: one RTP packet, half of one of the engine's 80 ms frames
BLOCK = 480  # 20 ms: what one cut of hurried speech is taken from
MAX_QUEUED_S = 1.0  # the assistant's audio queued for the track beyond this: the oldest is dropped
STANDING_S = 0.16  # the queue's low over the last two frames is what a late frame left behind
HURRY_SAMPLES = (60, 120)  # 2.5 or 5 ms (past 40 ms behind) out of each 20 ms of speech, cross-faded
GRACE_S = 0.02  # a packet whose audio is not all there at its time waits this much more for it
PHASE_WINDOW = 50  # packets (2 s of 40 ms ones) over which every frame came at least this early ...
PHASE_EARLY_S = 0.006  # ... for the schedule to move earlier, leaving the latest PHASE_MARGIN_S early; or
PHASE_LATE_SHARE = 0.25  # this share of them late, for it to move later (a phase that moved, not a late step)
PHASE_MARGIN_S = 0.003
SLACK_S = 0.002  # a packet whose audio is all there may go this early: the pacer serves it with others due
SILENT_PEAK = 1e-3  # of full scale: a packet under it is silence (skippable)
OPUS_BITRATE = 48000  # mono voice, 12 kHz of band

Media = av.Packet | av.AudioFrame  # what the track gives aiortc's sender: encoded, or for its encoder


class AssistantTrack(MediaStreamTrack):
    """The assistant's voice: the mapping's 24 kHz frames (`play`, from the event loop), sent as 40 ms
    Opus packets (`av.Packet`: aiortc's sender only packs them) at real-time pace; silence when nothing
    is queued. Where this aiortc does not take encoded packets (`sends_opus_packets`), 20 ms frames at
    48 kHz for its own encoder instead. Whatever came late (a slow step, the frames made before the peer
    connected, the user's audio held up and then let through at once) would delay every later packet
    for good: it is caught up on (`_next_packet`). A pacer thread, shared with other tracks, paces,
    catches up and encodes (`_service`); the loop is woken once a packet."""

    kind = "audio"

    def __init__(self, sent: Callable[[int, int], None] | None = None, complexity: int = opus.VOICE_COMPLEXITY) -> None:
        super().__init__()
        # (frame, slot): a frame's first sample went out in the packet at that 20 ms slot; set before the first `play`
        self.sent = sent
        self.encoded = sends_opus_packets()
        self.complexity = complexity
        self.packet = PTIME_SAMPLES if self.encoded else BLOCK  # 24 kHz samples a packet
        self._inbox: queue.SimpleQueue[tuple[np.ndarray, int | None]] = queue.SimpleQueue()  # from `play`
        # the thread's own, from here on
        self._frames: collections.deque[tuple[int, int]] = collections.deque()  # (frame, its first sample's place)
        self._queued_total = self._taken_total = 0  # samples ever queued, ever taken (sent, skipped or dropped)
        self._queued: collections.deque[np.ndarray] = collections.deque()
        self._samples = 0
        self._pts = 0  # on the RTP clock
        self._started: list[int] = []  # frames whose first sample is in the packet being made
        self._idle = True  # the last packet had nothing queued to send
        self.dropped_samples = 0  # speech dropped past MAX_QUEUED_S
        self.skipped_samples = 0  # silence skipped to catch up
        self.hurried_samples = 0  # speech cut (cross-faded) to catch up
        self._levels: collections.deque[int] = collections.deque(maxlen=round(STANDING_S * RATE / self.packet))
        # between the pacer and the loop, from the first `recv` on
        self._out: asyncio.Queue[tuple[Media, list[int]] | None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pacer: _Pacer | None = None
        self._encode: Callable[[np.ndarray], Media] | None = None
        self._start, self._made = 0.0, 0  # the schedule: packet n goes at _start + n packet times
        self._full_at: float | None = None  # when the next packet's audio was seen all there, before its time
        self._new_window()
        self._stopping = threading.Event()

    def play(self, pcm: np.ndarray, frame: int | None = None) -> None:
        self._inbox.put((pcm, frame))
        if self._pacer is not None:
            self._pacer.poke(self)

    def _enqueue(self, pcm: np.ndarray, frame: int | None) -> None:
        chunk = (np.clip(np.asarray(pcm, np.float32), -1.0, 1.0) * 32767).astype(np.int16)
        if self.sent is not None and frame is not None:
            self._frames.append((frame, self._queued_total))
        self._queued.append(chunk)
        self._samples += len(chunk)
        self._queued_total += len(chunk)
        while self._samples > MAX_QUEUED_S * RATE:  # the peer's clock runs slow: keep it live
            old = self._queued.popleft()
            self._samples -= len(old)
            self._taken_total += len(old)
            self.dropped_samples += len(old)

    def _next_packet(self) -> np.ndarray:
        """The next packet's audio, what was played since the last one queued first. The queue's level
        swings by a frame (80 ms) as frames arrive; its low over two frames is what is standing: audio
        that came late and would delay the rest. While that is over a packet, silent packets at the
        head are skipped and speech is hurried: 22.5 ms (25 ms past 40 ms behind) made into each 20,
        the cut cross-faded (a jitter buffer's 'accelerate', without pitch alignment, so the cut is
        kept short)."""
        self._take_played()
        begins = self._taken_total
        self._levels.append(self._samples)
        behind = min(self._levels) - self.packet if len(self._levels) == self._levels.maxlen else 0
        while behind > 0 and self._samples > self.packet and self._head_peak() < SILENT_PEAK:
            self._take(self.packet)
            self._caught_up(self.packet)
            self.skipped_samples += self.packet
            behind -= self.packet
        cut = HURRY_SAMPLES[behind > 0.04 * RATE]
        blocks = [self._next_block(cut if behind >= cut * (i + 1) else 0) for i in range(self.packet // BLOCK)]
        self._report_sent(begins)
        self._idle = self._taken_total == begins
        return np.concatenate(blocks) if len(blocks) > 1 else blocks[0]

    def _next_block(self, cut: int) -> np.ndarray:
        """The next 20 ms; `cut` samples fewer than were taken, cross-faded, when there are enough."""
        if not cut or self._samples < BLOCK + cut:
            return self._take(BLOCK)
        head = self._take(BLOCK + cut).copy()
        fade = np.linspace(0.0, 1.0, cut, dtype=np.float32)
        tail = slice(BLOCK - cut, BLOCK)
        head[tail] = (head[tail] * (1.0 - fade) + head[BLOCK:] * fade).astype(np.int16)
        self.hurried_samples += cut
        self._caught_up(cut)
        return head[:BLOCK]

    def _caught_up(self, samples: int) -> None:
        """What was standing is less by `samples` in every level kept."""
        self._levels = collections.deque((level - samples for level in self._levels), maxlen=self._levels.maxlen)

    def _report_sent(self, begins: int) -> None:
        """Each frame whose first sample was in the packet just made (or was skipped before it)."""
        while self._frames and self._frames[0][1] < self._taken_total:
            frame, place = self._frames.popleft()
            if place >= begins:
                self._started.append(frame)

    def _head_peak(self) -> float:
        peak, seen = 0, 0
        for chunk in self._queued:
            part = chunk[:self.packet - seen]
            peak, seen = max(peak, int(np.abs(part.astype(np.int32)).max(initial=0))), seen + len(part)
            if seen >= self.packet:
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

    # ---------------------------------------------------------------- the thread and the sender's side

    def _make(self, encode: Callable[[np.ndarray], Media]) -> tuple[Media, list[int]]:
        """The next packet, stamped, and the frames that begin in it (as 20 ms slots of the RTP clock)."""
        media = encode(self._next_packet())
        media.pts, media.time_base = self._pts, fractions.Fraction(1, WIRE_RATE)
        started, self._started = self._started, []
        self._pts += self.packet * WIRE_RATE // RATE
        return media, started

    def _service(self, now: float) -> float | None:
        """On the pacer's thread: every packet due by `now` made and handed to the loop; when to look
        again (None: the track has ended). A packet goes at its time on an absolute schedule (no drift)
        with its audio all there; else up to GRACE_S later as soon as it is (a frame a little late);
        else with what there is. The engine's frames come at a phase of their own (the same for every
        session: one engine steps them all), which the schedule takes: after a packet with nothing to
        send, from the moment the audio is all there (earlier or later than the old phase); and where,
        over PHASE_WINDOW packets, every packet's audio was there PHASE_EARLY_S before its time or more,
        or PHASE_LATE_SHARE of them came late, the schedule moves to leave the latest PHASE_MARGIN_S (a
        track that never runs dry, its first packet timed by the peer's connecting, held every frame up
        to a packet time; one whose frames' phase moved later sent each as it came). Never to each
        frame as it comes: a packet spaced closer than the packet time, or later, by the engine's
        step-to-step jitter would raise the receiver's jitter buffer (tests/test_rtc.py)."""
        while not self._stopping.is_set():
            self._take_played()
            due = self._start + self._made * self.packet / RATE
            full = self._samples >= self.packet
            if full and self._idle:  # (now read again: encoding other tracks' packets took time)
                self._start += max(now, time.monotonic()) - due
                self._full_at = None
                self._new_window()
            elif not (full and now + SLACK_S >= due) and now < due + GRACE_S:
                if full and self._full_at is None:
                    self._full_at = now
                return due if full else due + GRACE_S
            else:
                self._note_early(due, full, now)
            try:
                item = self._make(self._encode)
            except Exception:  # the track ends (and the sender with it) rather than leave `recv` waiting
                logger.exception("the assistant's track failed to make a packet")
                self._stopping.set()
                break
            self._made += 1
            if self._window >= PHASE_WINDOW:
                if self._earliest >= PHASE_EARLY_S or self._late >= PHASE_LATE_SHARE * PHASE_WINDOW:
                    self._start -= max(self._earliest, -GRACE_S) - PHASE_MARGIN_S
                self._new_window()
            if not self._deliver(item):
                return None
        self._deliver(None)
        return None

    def _new_window(self) -> None:
        """Over the next PHASE_WINDOW packets: the least a packet's audio was early by, the packets
        counted, those late."""
        self._earliest, self._window, self._late = math.inf, 0, 0

    def _note_early(self, due: float, full: bool, now: float) -> None:
        """How early the packet going now had its audio all there (negative: late, after its grace)."""
        if full:
            early = due - (self._full_at if self._full_at is not None else now)
        elif self._samples:  # a frame not all there by the end of its grace
            early = due - now
        else:  # nothing to send: no frame came early or late
            early = None
        self._full_at = None
        if early is not None:
            self._earliest = min(self._earliest, early)
            self._window += 1
            self._late += early < 0

    def _take_played(self) -> None:
        """What `play` has given since last asked, queued."""
        while True:
            try:
                self._enqueue(*self._inbox.get_nowait())
            except queue.Empty:
                return

    def _deliver(self, item: tuple[Media, list[int]] | None) -> bool:
        try:
            self._loop.call_soon_threadsafe(self._out.put_nowait, item)
            return True
        except RuntimeError:  # the loop has closed: nobody is listening
            return False

    async def recv(self) -> Media:
        if self.readyState != "live":
            raise MediaStreamError
        if self._out is None:
            self._encode = _quiet_after_silence(_opus_encoder(self.complexity)) if self.encoded else _wire_frames()
            self._out, self._loop = asyncio.Queue(), asyncio.get_running_loop()
            _pacer().add(self)
        item = await self._out.get()
        if item is None:
            raise MediaStreamError
        media, started = item
        for frame in started:
            self.sent(frame, media.pts // SLOT)
        return media

    def stop(self) -> None:
        self._stopping.set()
        if self._pacer is not None:
            self._pacer.poke(self)
        super().stop()


class _Pacer:
    """A thread that paces, catches up and encodes the packets of assistant tracks (`_service`). The
    engine steps every session at once, so the tracks' frames come together and their schedules take
    the same phase: a wake-up serves the tracks due together, where a thread per track woke and took
    the GIL for each (and the event loop with it)."""

    def __init__(self, name: str) -> None:
        self.tracks: dict[AssistantTrack, float] = {}  # the pacer thread's own: track -> when to look again
        self._pokes: queue.SimpleQueue[AssistantTrack] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, track: AssistantTrack) -> None:
        track._start, track._made, track._pacer = time.monotonic(), 0, self
        self.poke(track)

    def poke(self, track: AssistantTrack) -> None:
        """`track` has news (its first packet is due, a frame was played, it stopped)."""
        self._pokes.put(track)

    def _run(self) -> None:
        while True:
            try:
                self._serve()
            except Exception:  # the pacer's own bug: logged, and the tracks go on being served
                logger.exception("the assistant tracks' pacer failed")
                time.sleep(0.01)

    def _serve(self) -> None:
        """One wake-up: wait for the next track due or poked, then serve every track due or poked (a
        stopped one gets its end, once more where it had ended already: harmless)."""
        wake = min(self.tracks.values(), default=None)
        try:
            poked = [self._pokes.get(timeout=None if wake is None else max(0.0, wake - time.monotonic()))]
        except queue.Empty:
            poked = []
        while True:
            try:
                poked.append(self._pokes.get_nowait())
            except queue.Empty:
                break
        now = time.monotonic()
        for track in poked:
            self.tracks.setdefault(track, now)
        for track, at in list(self.tracks.items()):
            if at <= now + SLACK_S or track in poked:
                try:
                    again = track._service(now)
                except Exception:  # a bug in one track ends that track, not the pacer and every other
                    logger.exception("the assistant's track failed")
                    track._stopping.set()
                    track._deliver(None)
                    again = None
                if again is None:
                    del self.tracks[track]
                else:
                    self.tracks[track] = again


PACERS = max(1, len(os.sched_getaffinity(0)) // 4)  # libopus lets go of the GIL: pacers encode side by side
_pacers: list[_Pacer] = []
_pacers_made = threading.Lock()


def _pacer() -> _Pacer:
    """The pacer with the fewest tracks (made as needed, up to PACERS; they live as long as the process)."""
    with _pacers_made:
        if len(_pacers) < PACERS:
            _pacers.append(_Pacer(f"opus-out-{len(_pacers)}"))
        return min(_pacers, key=lambda pacer: len(pacer.tracks))


def _opus_encoder(complexity: int) -> Callable[[np.ndarray], av.Packet]:
    """24 kHz mono int16, a packet's worth at a time, to one Opus packet: libopus called directly
    (`kame.opus`), else through PyAV (libopus's packet time set to match, so nothing is held back)."""
    if opus.library() is not None:
        encoder = opus.Encoder(RATE, OPUS_BITRATE, complexity)
        return lambda pcm: av.Packet(encoder.encode(pcm))
    codec = av.CodecContext.create("libopus", "w")
    codec.sample_rate, codec.layout, codec.format, codec.bit_rate = RATE, "mono", "s16", OPUS_BITRATE
    codec.time_base = fractions.Fraction(1, RATE)
    codec.options = {"application": "voip", "frame_duration": str(PTIME_SAMPLES * 1000 // RATE),
                     "compression_level": str(complexity)}

    def encode(pcm: np.ndarray) -> av.Packet:
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = RATE
        (packet,) = codec.encode(frame)
        return packet

    return encode


def _quiet_after_silence(encode: Callable[[np.ndarray], av.Packet]) -> Callable[[np.ndarray], av.Packet]:
    """`encode`, but digital silence (the zeros of the session's silence gate, server/live/silence.py)
    costs no encoding past its first packet: the next go out as packets of empty frames, Opus's
    discontinuous transmission (RFC 6716 3.2.1: a 0-byte frame is one the decoder conceals, fading to
    silence), until the audio is not zeros again. An encode is ~220 us of libopus a packet at
    complexity 5 whatever the audio; the speech after the silence decodes as well as after encoded
    zeros (scripts/bench_opus.py)."""
    quiet: bytes | None = None

    def encode_or_not(pcm: np.ndarray) -> av.Packet:
        nonlocal quiet
        if pcm.any():
            quiet = None
            return encode(pcm)
        if quiet is not None:
            return av.Packet(quiet)
        packet = encode(pcm)
        quiet = empty_frames(bytes(packet)[0], len(pcm) * 1000 / RATE)
        return packet

    return encode_or_not


def empty_frames(toc: int, ms: float) -> bytes:
    """An Opus packet of `ms` of empty frames in the mode and frame length of the TOC byte `toc`."""
    config = toc >> 3
    if config < 12:  # SILK: 10, 20, 40, 60 ms
        frame_ms = (10, 20, 40, 60)[config % 4]
    elif config < 16:  # hybrid: 10, 20
        frame_ms = (10, 20)[config % 2]
    else:  # CELT: 2.5, 5, 10, 20
        frame_ms = (2.5, 5, 10, 20)[config % 4]
    frames, base = round(ms / frame_ms), toc & 0xFC
    if frames * frame_ms != ms or not 1 <= frames <= 48:
        raise ValueError(f"{ms} ms is not a whole number of {frame_ms} ms frames (at most 48)")
    if frames == 1:
        return bytes([base])  # code 0: one frame, of 0 bytes
    if frames == 2:
        return bytes([base | 1])  # code 1: two frames of equal size, 0
    return bytes([base | 3, frames])  # code 3: CBR, no padding, `frames` frames of 0 bytes


def _wire_frames() -> Callable[[np.ndarray], av.AudioFrame]:
    """24 kHz mono int16 to 48 kHz frames, for aiortc's own encoder."""
    upsample = Resampler(RATE, WIRE_RATE)

    def frame(pcm: np.ndarray) -> av.AudioFrame:
        pcm48 = (np.clip(upsample(pcm.astype(np.float32) / 32767), -1.0, 1.0) * 32767).astype(np.int16)
        out = av.AudioFrame.from_ndarray(pcm48.reshape(1, -1), format="s16", layout="mono")
        out.sample_rate = WIRE_RATE
        return out

    return frame
