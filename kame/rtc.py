"""aiortc's audio receiver, fitted to a voice session: each Opus packet is decoded the moment it is
next in sequence (aiortc's own buffer holds four packets, 80 ms, before releasing one), off the
event loop, and handed over as 24 kHz mono float32. Used by the server's WebRTC sessions and the
load benchmark's WebRTC client.

A receiver's reordering wait is sized by the link it serves: none while packets come in order
(loopback, a LAN), one more packet each time one arrived after it had been given up on, back down
after a quiet stretch.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fractions
import functools
import logging
import math
import queue
import threading
from collections.abc import Callable
from typing import Protocol

import aiortc.codecs.opus
import aiortc.rtp
import av
import numpy as np
from aiortc import RTCRtpTransceiver
from aiortc.jitterbuffer import JitterBuffer
from aiortc.rtp import RtpPacket

from kame import opus
from kame.audio import SAMPLE_RATE
from kame.opus import OpusError
from kame.pcm import Resampler

logger = logging.getLogger(__name__)

OPUS_RATE = 48000  # what libopus decodes to (FFmpeg's wrapper has no other rate)
PACKET_SAMPLES = OPUS_RATE // 50  # 20 ms
MAX_HOLD = 5  # packets a gap may be waited for on the worst link (100 ms)
RELAX_AFTER = 1500  # packets in order (30 s) before the wait shrinks by one
MAX_FILL = 10  # lost packets made up for (more: the sender restarted or paused)
RESTART_GAP = 3000  # a jump this far ahead is a new stream, not loss
RESTART_RUN = 8  # this many packets in a row, each next to the last, all before `_next`: the stream restarted


class Sequenced(Protocol):
    sequence_number: int


def _ahead(a: int, b: int) -> int:
    """How far sequence number a is after b (negative: before), on the 16-bit circle."""
    return (a - b + 0x8000) % 0x10000 - 0x8000


class ReorderGate:
    """RTP packets in, in sequence order out, as early as the link allows. A packet that is next
    goes out at once (and any held ones it unblocks); after a gap, later packets are held until the
    missing one comes or `hold` of them are waiting, then the gap is given up (`lost`). A packet
    that comes after its gap was given up is dropped (`late`) and the hold grows by one. A stream that
    went back (the sender restarted its numbering, or one stray packet far ahead moved `_next` on) is
    taken up again after RESTART_RUN packets in sequence behind it, not dropped until it catches up."""

    def __init__(self, max_hold: int = MAX_HOLD, relax_after: int = RELAX_AFTER) -> None:
        self.hold, self.max_hold, self.relax_after = 0, max_hold, relax_after
        self.lost = self.late = 0
        self._next: int | None = None
        self._held: dict[int, Sequenced] = {}
        self._skipped: collections.deque[int] = collections.deque(maxlen=64)  # given up on, recently
        self._in_order = 0
        self._behind: tuple[int, int] | None = None  # (the last packet before `_next`, the run it ends)

    def push(self, packet: Sequenced) -> list[tuple[int, Sequenced]]:
        """The packets released by this one: (packets lost just before it, packet), in order."""
        seq = packet.sequence_number
        if self._next is None or abs(_ahead(seq, self._next)) >= RESTART_GAP or self._went_back(seq):
            self._next, self._held, self._behind = seq, {}, None
        if _ahead(seq, self._next) < 0:  # its gap was given up (or it is a duplicate)
            if seq in self._skipped:
                self.late += 1
                self._grow()
            return []
        self._held[seq] = packet
        out = self._release(0)
        while len(self._held) > self.hold:  # waited long enough: skip to the oldest held packet
            oldest = min(self._held, key=lambda s: _ahead(s, self._next))
            skipped = _ahead(oldest, self._next)
            if skipped <= MAX_HOLD * 4:  # reordering's losses; a jump further is a stray packet or a new stream
                self._skipped.extend((self._next + i) & 0xFFFF for i in range(skipped))
            self.lost += skipped
            self._next = oldest
            out += self._release(skipped)
        self._relax(len(out))
        return out

    def _went_back(self, seq: int) -> bool:
        """Whether `seq`, before `_next`, ends RESTART_RUN such packets in sequence (a late one alone does not)."""
        if _ahead(seq, self._next) >= 0 or seq in self._skipped:  # a late one whose gap was given up: no restart
            self._behind = None
            return False
        last, run = self._behind if self._behind is not None else (None, 0)
        run = run + 1 if last is not None and _ahead(seq, last) == 1 else 1
        self._behind = (seq, run)
        return run >= RESTART_RUN

    def _release(self, lost: int) -> list[tuple[int, Sequenced]]:
        """The held packets from `_next` on, up to the next gap; the first follows `lost` lost ones."""
        out = []
        while (packet := self._held.pop(self._next, None)) is not None:
            out.append((lost if not out else 0, packet))
            self._next = (self._next + 1) & 0xFFFF
        return out

    def _grow(self) -> None:
        if self.hold < self.max_hold:
            self.hold += 1
            logger.info("RTP packets arrive out of order: waiting up to %d packets for a gap", self.hold)
        self._in_order = 0

    def _relax(self, released: int) -> None:
        self._in_order += released
        if self.hold and self._in_order >= self.relax_after:
            self.hold, self._in_order = self.hold - 1, 0


class OpusInput:
    """One peer's Opus packets decoded to 24 kHz mono float32 off the event loop, on the one thread
    that decodes every peer's in this process (`_DECODING`): `push` from the event loop never blocks,
    `frames` is where the PCM comes out (None once closed). A packet that does not decode is skipped,
    and counted."""

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str = "opus-in") -> None:
        self.frames: asyncio.Queue[np.ndarray | None] = asyncio.Queue()
        self.undecodable = 0
        self.packet_ms: int | None = None  # how long the last packet decoded lasted
        self.gate: ReorderGate | None = None  # set by `receive_opus`
        self.name = name
        self._loop = loop
        self._decode: Callable[[bytes, int], np.ndarray] | None = None  # made on the decoding thread
        self._closed = False  # packets still arriving (the peer connection closes after) are dropped

    def push(self, payload: bytes, lost_before: int = 0) -> None:
        if not self._closed:
            _DECODING.put((self, lost_before, payload))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _DECODING.put((self, 0, None))

    def _decode_one(self, lost: int, payload: bytes | None) -> None:
        """On the decoding thread: one packet (None: the end, the last item `close` lets through)."""
        if payload is None:
            self._decode = None
            self._deliver(None)
            return
        if self._decode is None:
            self._decode = _decoder()
        lost = min(lost, MAX_FILL)
        try:
            pcm = self._decode(payload, lost)
        except (av.FFmpegError, OpusError):
            self.undecodable += 1
            logger.debug("%s: an Opus packet did not decode", self.name, exc_info=True)
            return
        if len(pcm):
            self.packet_ms = 1000 * len(pcm) // ((lost + 1) * SAMPLE_RATE)
            self._deliver(pcm)

    def _deliver(self, pcm: np.ndarray | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is listening
            self._loop.call_soon_threadsafe(self.frames.put_nowait, pcm)


class _Decoding:
    """The thread that decodes every `OpusInput`'s packets, in arrival order (a packet is ~30 us of
    libopus: one thread keeps up with hundreds of peers, and one waiting thread wakes where one per
    peer would each wake and contend for the GIL), started with the first packet."""

    def __init__(self) -> None:
        self._packets: queue.SimpleQueue[tuple[OpusInput, int, bytes | None]] = queue.SimpleQueue()
        self._started = threading.Lock()
        self._thread: threading.Thread | None = None

    def put(self, item: tuple[OpusInput, int, bytes | None]) -> None:
        if self._thread is None:
            with self._started:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="opus-in", daemon=True)
                    self._thread.start()
        self._packets.put(item)

    def _run(self) -> None:
        while True:
            opus_input, lost, payload = self._packets.get()
            try:
                opus_input._decode_one(lost, payload)
            except Exception:  # one peer's failure is not every peer's
                logger.exception("%s: decoding failed", opus_input.name)


_DECODING = _Decoding()


def _decoder() -> Callable[[bytes, int], np.ndarray]:
    """(packet, packets lost just before it) -> 24 kHz mono float32: libopus decoding at 24 kHz, its
    loss concealment for the lost ones; where it cannot be called, PyAV's (48 kHz, downmixed and
    halved; silence for the lost ones)."""
    if opus.library() is not None:
        decoder = opus.Decoder(SAMPLE_RATE)

        def direct(payload: bytes, lost: int) -> np.ndarray:
            made = decoder.conceal(lost) if lost else None
            pcm = decoder.decode(payload)
            return np.concatenate([made, pcm]) if made is not None else pcm

        return direct
    codec = av.CodecContext.create("libopus", "r")
    codec.format, codec.layout, codec.sample_rate = "s16", "stereo", OPUS_RATE
    halve = Resampler(OPUS_RATE, SAMPLE_RATE)

    last = [PACKET_SAMPLES]  # the last packet's length at 48 kHz: what a lost one is taken to last

    def through_pyav(payload: bytes, lost: int) -> np.ndarray:
        pcm = []
        for frame in codec.decode(av.Packet(payload)):
            samples = frame.to_ndarray().reshape(-1, len(frame.layout.channels))
            pcm.append(samples.mean(axis=1, dtype=np.float32) / 32768.0)
        if pcm:
            last[0] = sum(map(len, pcm))
        pcm = [np.zeros(last[0] * lost, np.float32)] * bool(lost) + pcm
        return halve(np.concatenate(pcm)) if pcm else np.zeros(0, np.float32)

    return through_pyav


def with_ptime(sdp: str, ptime_ms: int) -> str:
    """`sdp` asking for `ptime_ms` packets on its audio (RFC 4566's a=ptime, which Chromium's Opus
    encoder follows): a receiver's work is per packet, not per second of audio."""
    out, audio, asked = [], False, False
    for line in sdp.split("\r\n"):
        if line.startswith("m="):
            audio, asked = line.startswith("m=audio"), False
        elif audio and line.startswith("a=ptime:"):
            continue
        if audio and not asked and line.startswith("a="):  # attributes come after m=, c= and b= lines
            out.append(f"a=ptime:{ptime_ms}")
            asked = True
        out.append(line)
    return "\r\n".join(out)


def ptime(sdp: str, default: int = 20) -> int:
    """The packet time the audio of `sdp` asks for (a=ptime), `default` where it does not say."""
    audio = False
    for line in sdp.splitlines():
        if line.startswith("m="):
            audio = line.startswith("m=audio")
        elif audio and line.startswith("a=ptime:"):
            try:
                return int(float(line.split(":", 1)[1]))
            except ValueError:
                return default
    return default


def audio_level_dbov(frame: av.AudioFrame) -> int:
    """RFC 6465's audio level of an s16 frame, as aiortc's `compute_audio_level_dbov` computes it (the
    same sum over the first plane, the same rounding), in numpy: aiortc's loops over the samples in
    Python, ~50 us a packet on the event loop, the largest single cost of sending audio."""
    samples = np.frombuffer(frame.planes[0], np.int16).astype(np.float64)
    rms = math.sqrt(float(np.dot(samples, samples)) / (frame.samples * 32767 * 32767))
    return round(min(max(20 * math.log10(rms), -127), 0)) if rms > 0 else -127


def send_cheaply() -> None:
    """aiortc's senders measure each packet's level with `audio_level_dbov` (same value, once per
    process; idempotent)."""
    aiortc.rtp.compute_audio_level_dbov = audio_level_dbov


@functools.cache
def sends_opus_packets() -> bool:
    """Whether this aiortc's senders take Opus already encoded: a track's `recv` may return an
    `av.Packet`, sent as it is with its pts (on the packet's time base) as the RTP timestamp, as 1.16's
    do (`OpusEncoder.pack`). Tried once per process; where not, a warning, and tracks give frames."""
    probe = av.Packet(b"\xf8\xff\xfe")  # an Opus packet's bytes (20 ms of silence)
    probe.pts, probe.time_base = 3, fractions.Fraction(1, 24000)
    try:
        payloads, timestamp = aiortc.codecs.opus.OpusEncoder().pack(probe)
    except (AttributeError, TypeError, ValueError):
        payloads, timestamp = None, None
    if payloads == [bytes(probe)] and timestamp == 6:
        return True
    logger.warning("aiortc's Opus encoder has changed (no `pack` as 1.16 had): the assistant's audio is "
                   "encoded by aiortc, on its default executor")
    return False


class _Discard:
    """In place of aiortc's jitter buffer: the receiver keeps its statistics and RTCP reports, its
    own decoder gets nothing (the packets went to `OpusInput` already)."""

    capacity = 16

    def add(self, packet: object) -> tuple[bool, None]:
        return False, None


def receive_opus(transceiver: RTCRtpTransceiver, name: str = "opus-in",
                 observe: Callable[[RtpPacket], None] | None = None) -> OpusInput | None:
    """Take an audio transceiver's packets from aiortc (call once its codec is negotiated, before
    media flows): released in order by a `ReorderGate`, decoded by an `OpusInput`, whose `frames` the
    caller reads; `observe` sees each packet as it arrives. None where the codec is not Opus, or
    this aiortc's receiver is not the one this was written for (with a warning): aiortc's own path
    stays, and its track has the audio."""
    receiver = transceiver.receiver
    codecs = getattr(transceiver, "_codecs", None) or []
    if not codecs or codecs[0].mimeType.lower() != "audio/opus":
        logger.info("the peer's audio is not Opus: aiortc's own receiver decodes it")
        return None
    if not isinstance(getattr(receiver, "_RTCRtpReceiver__jitter_buffer", None), JitterBuffer):
        logger.warning("aiortc's receiver has changed (no jitter buffer where 1.16 had one): "
                       "audio goes through aiortc's own buffer (80 ms more delay)")
        return None
    opus, gate, handle = OpusInput(asyncio.get_running_loop(), name=name), ReorderGate(), receiver._handle_rtp_packet
    receiver._RTCRtpReceiver__jitter_buffer = _Discard()

    carried = 0  # packets lost before empty ones released: counted before the next with audio

    async def handle_rtp(packet, arrival_time_ms: int) -> None:
        nonlocal carried
        if packet.payload and observe is not None:
            observe(packet)
        for lost, ready in gate.push(packet):  # an empty one (padding, a keep-alive) holds its place in sequence
            if ready.payload:
                opus.push(ready.payload, lost + carried)
                carried = 0
            else:
                carried += lost
        await handle(packet, arrival_time_ms)  # statistics, RTCP

    receiver._handle_rtp_packet = handle_rtp
    opus.gate = gate
    return opus
