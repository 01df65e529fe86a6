"""A call's media over RTP (RFC 3550, RFC 3551): G.711 in through a jitter buffer, out paced in real time, and
keypad digits as RFC 4733 telephone-events; symmetric RTP latches the peer's address (RFC 4961)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import logging
import math
import secrets
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

RTP_VERSION = 2
HEADER = struct.Struct("!BBHII")  # V/P/X/CC, M/PT, sequence number, timestamp, SSRC (RFC 3550 §5.1)
SEQ_MOD = 1 << 16
TS_MOD = 1 << 32
MAX_DROPOUT = 3000  # RFC 3550 A.1: a jump ahead further than this is not taken as loss...
MAX_MISORDER = 100  # ...nor one further back as reordering, until the sender confirms the new sequence

EVENT = struct.Struct("!BBH")  # RFC 4733 §2.3: event code, E/R/volume, duration
DIGITS = "0123456789*#ABCD"  # RFC 4733 §3: the DTMF event codes 0-15
EVENT_INTERVAL_S = 0.05  # an event's updates every 50 ms (RFC 4733 §2.5)
END_PACKETS = 3  # the final packet sent three times (RFC 4733 §2.5)
DIGIT_GAP_S = 0.05  # between two digits sent one after the other, so a receiver hears two presses
MAX_VOLUME = 63
SEEN_EVENTS = 32  # the last events reported, so their repeated packets are not reported again

BURST_MARGIN_MS = 100  # buffered audio beyond max_jitter_ms + this is a burst after a stall: trimmed at once
SHRINK_MARGIN_MS = 40  # buffered audio this far above the target for a whole second (not a passing stall)...
SHRINK_INTERVAL_S = 1.0  # ...loses its oldest packet, and so on each second, so the delay comes back down
JITTER_GAIN = 1 / 16  # RFC 3550 §6.4.1's interarrival jitter estimator
MAX_CATCHUP_TICKS = 3  # a tick task later than this skips to the present rather than sending a burst
TICK_EPSILON = 1e-9  # a wake-up exactly on the grid counts as that tick despite float rounding
SEND_JITTER_SAMPLES = 15_000  # five minutes of ticks
ERRORS_LOGGED = 3  # a failing callback is logged with its traceback this often, then counted


class MalformedPacket(ValueError):
    """Bytes that are not an RTP version 2 packet with consistent lengths."""


@dataclass(frozen=True)
class RtpFormat:
    payload_type: int  # the negotiated audio payload type
    clock_rate: int = 8000
    bytes_per_packet: int = 160  # 20 ms of G.711
    silence: bytes = b"\xff"  # one byte of the codec's silence: 0xFF PCMU, 0xD5 PCMA (repeated to fill a packet)
    dtmf_payload_type: int | None = None  # telephone-event, if negotiated (at the audio's clock rate)
    ptime_ms: int = 20

    @property
    def samples_per_packet(self) -> int:
        return self.clock_rate * self.ptime_ms // 1000

    @property
    def silence_packet(self) -> bytes:
        whole, part = divmod(self.bytes_per_packet, len(self.silence))
        return self.silence * whole + self.silence[:part]


@dataclass(frozen=True)
class RtpPacket:
    """An RTP packet without CSRCs, header extension or padding when we write it; those are skipped on reading."""

    payload_type: int
    sequence: int
    timestamp: int
    ssrc: int
    payload: bytes = b""
    marker: bool = False

    @classmethod
    def parse(cls, data: bytes) -> RtpPacket:
        if len(data) < HEADER.size:
            raise MalformedPacket("shorter than the RTP header")
        first, second, sequence, timestamp, ssrc = HEADER.unpack_from(data)
        if first >> 6 != RTP_VERSION:
            raise MalformedPacket(f"version {first >> 6}")
        start = HEADER.size + 4 * (first & 0x0F)
        if first & 0x10:  # header extension: 16-bit profile, 16-bit length in 32-bit words
            if len(data) < start + 4:
                raise MalformedPacket("header extension cut short")
            (words,) = struct.unpack_from("!H", data, start + 2)
            start += 4 + 4 * words
        if len(data) < start:
            raise MalformedPacket("CSRC list or header extension beyond the packet")
        end = len(data)
        if first & 0x20:  # padding: its last byte counts the padding bytes, itself included
            padding = data[-1]
            if padding == 0 or padding > end - start:
                raise MalformedPacket("padding longer than the payload")
            end -= padding
        return cls(second & 0x7F, sequence, timestamp, ssrc, bytes(data[start:end]), bool(second & 0x80))

    def serialize(self) -> bytes:
        second = (0x80 if self.marker else 0) | (self.payload_type & 0x7F)
        header = HEADER.pack(RTP_VERSION << 6, second, self.sequence % SEQ_MOD, self.timestamp % TS_MOD, self.ssrc)
        return header + self.payload


@dataclass(frozen=True)
class TelephoneEvent:
    """One RFC 4733 event block."""

    code: int
    end: bool
    volume: int
    duration: int  # in timestamp units

    @classmethod
    def parse(cls, payload: bytes) -> TelephoneEvent:
        if len(payload) < EVENT.size:
            raise MalformedPacket("telephone-event payload shorter than 4 bytes")
        code, flags, duration = EVENT.unpack_from(payload)
        return cls(code, bool(flags & 0x80), flags & 0x3F, duration)

    def serialize(self) -> bytes:
        return EVENT.pack(self.code, (0x80 if self.end else 0) | (self.volume & 0x3F), self.duration)


@dataclass
class RtpStats:
    packets_received: int = 0  # accepted from the peer: audio and telephone-events
    packets_lost: int = 0  # by sequence gaps (RFC 3550 A.3: expected less received)
    packets_late: int = 0  # arrived after playout had passed them: dropped
    packets_foreign: int = 0  # from another address than the latched peer
    packets_malformed: int = 0
    packets_ignored: int = 0  # another payload type (RTCP on a muxed port, a codec not negotiated), a wild jump
    packets_duplicate: int = 0
    packets_trimmed: int = 0  # dropped from the jitter buffer to bring its delay down
    concealed: int = 0  # payloads made up for missing packets
    jitter_ms: float = 0.0  # RFC 3550 §6.4.1 interarrival jitter estimate
    packets_sent: int = 0
    digits_received: int = 0
    digits_sent: int = 0
    send_jitter_ms: deque[float] = field(default_factory=lambda: deque(maxlen=SEND_JITTER_SAMPLES))

    def send_jitter_p99(self) -> float:
        """The 99th percentile of the send tick's lateness behind the ideal ptime grid, in ms (0 without samples)."""
        samples = sorted(self.send_jitter_ms)
        if not samples:
            return 0.0
        return samples[min(len(samples) - 1, math.ceil(0.99 * len(samples)) - 1)]


def _signed(delta: int, modulus: int) -> int:
    """A wrapped difference as the nearest signed one (serial number arithmetic)."""
    delta %= modulus
    return delta - modulus if delta >= modulus // 2 else delta


class _Sequencer:
    """Unwraps the 16-bit sequence number and 32-bit timestamp into ever-growing integers. A new SSRC, or a
    sender confirming a wild jump, continues the numbering right after the old stream's, so what is buffered
    plays on and the new stream follows it."""

    def __init__(self, samples_per_packet: int, stats: RtpStats) -> None:
        self.samples_per_packet = samples_per_packet
        self.stats = stats
        self.ssrc: int | None = None
        self.base: int | None = None
        self.received = 0
        self.highest = -1  # extended sequence number of the highest packet
        self.highest_raw = 0
        self.highest_ts = -samples_per_packet  # extended timestamp of that packet
        self.highest_ts_raw = 0
        self.latest_ts = self.highest_ts  # the latest timestamp of all (an event's stays at its start)
        self.bad_sequence: int | None = None

    def extend(self, packet: RtpPacket) -> tuple[int, int] | None:
        """(extended sequence, extended timestamp), or None for a packet taken as a stray (RFC 3550 A.1)."""
        if packet.ssrc != self.ssrc:
            if self.ssrc is not None:
                logger.info("RTP source changed SSRC %08x -> %08x", self.ssrc, packet.ssrc)
            self.ssrc = packet.ssrc
            return self._restart(packet)
        delta = _signed(packet.sequence - self.highest_raw, SEQ_MOD)
        if delta > MAX_DROPOUT or delta < -MAX_MISORDER:
            if packet.sequence != self.bad_sequence:
                self.bad_sequence = (packet.sequence + 1) % SEQ_MOD
                self.stats.packets_ignored += 1
                return None
            logger.info("RTP sequence jumped to %d: restarting the sequence", packet.sequence)
            return self._restart(packet)
        self.bad_sequence = None
        extended = self.highest + delta
        timestamp = self.highest_ts + _signed(packet.timestamp - self.highest_ts_raw, TS_MOD)
        if extended > self.highest:
            self._set_highest(packet, extended, timestamp)
        self.latest_ts = max(self.latest_ts, timestamp)
        self._count()
        return extended, timestamp

    def _restart(self, packet: RtpPacket) -> tuple[int, int]:
        self.bad_sequence = None
        extended, timestamp = self.highest + 1, self.latest_ts + self.samples_per_packet
        if self.base is None:
            self.base = extended
        self._set_highest(packet, extended, timestamp)
        self._count()
        return extended, timestamp

    def _set_highest(self, packet: RtpPacket, extended: int, timestamp: int) -> None:
        self.highest, self.highest_raw = extended, packet.sequence
        self.highest_ts, self.highest_ts_raw = timestamp, packet.timestamp
        self.latest_ts = max(self.latest_ts, timestamp)

    def _count(self) -> None:
        self.received += 1
        expected = self.highest - (self.base or 0) + 1
        self.stats.packets_lost = max(0, expected - self.received)


class PushResult(enum.Enum):
    QUEUED = "queued"
    LATE = "late"
    DUPLICATE = "duplicate"


class JitterBuffer:
    """The caller's audio in order, one payload a tick. Playout starts once the target depth is buffered (or the
    target's time has passed since the first packet), conceals a missing packet while later ones are there, and
    stops when it runs dry: a peer that pauses or stops sending gets nothing made up for it."""

    def __init__(self, fmt: RtpFormat, min_ms: float, max_ms: float, stats: RtpStats) -> None:
        self.fmt = fmt
        self.min_ms = min_ms
        self.max_ms = max_ms
        self.target_ms = float(min_ms)
        self.stats = stats
        self.packets: dict[int, tuple[int, bytes]] = {}  # extended sequence -> (extended timestamp, payload)
        self.playing = False
        self.next_sequence: int | None = None  # where playout stands, once it has started
        self.next_timestamp = 0
        self.first_arrival: float | None = None  # of the packets waiting for playout to (re)start
        self.last_payload: bytes | None = None
        self.missing_run = 0
        self.over_since: float | None = None  # since when the depth has been over the target

    @property
    def buffered_ms(self) -> float:
        return len(self.packets) * self.fmt.ptime_ms

    def adapt(self, jitter_ms: float) -> None:
        self.target_ms = min(self.max_ms, max(self.min_ms, 2 * jitter_ms + self.fmt.ptime_ms))

    def push(self, sequence: int, timestamp: int, payload: bytes, now: float) -> PushResult:
        if self.next_sequence is not None and (sequence < self.next_sequence or timestamp < self.next_timestamp):
            self.stats.packets_late += 1
            return PushResult.LATE
        if sequence in self.packets:
            self.stats.packets_duplicate += 1
            return PushResult.DUPLICATE
        self.packets[sequence] = (timestamp, payload)
        if not self.playing and self.first_arrival is None:
            self.first_arrival = now
        if self.buffered_ms > self.max_ms + BURST_MARGIN_MS:
            self._drop_oldest(self.target_ms)
        return PushResult.QUEUED

    def pop(self, now: float) -> bytes | None:
        """The next tick's payload: the next packet, a concealment, or None while not playing."""
        if not self.playing and not self._start(now):
            return None
        if not self.packets:
            self.playing = False  # ran dry: wait for the next talk spurt rather than conceal forever
            return None
        self._shrink(now)
        head = min(self.packets)
        timestamp, payload = self.packets[head]
        assert self.next_sequence is not None
        # Only audio is buffered; a telephone-event between two audio packets takes a sequence number without
        # taking time, and a silence-suppression gap takes time without sequence numbers: a packet is missing
        # when both say so.
        missing = min(head - self.next_sequence, (timestamp - self.next_timestamp) // self.fmt.samples_per_packet)
        if missing * self.fmt.ptime_ms > self.max_ms:
            # Further off than any jitter: a stray packet, or a sender that skipped ahead. Concealing up to it could
            # go on for seconds; wait instead for what arrives next and start again from the oldest then.
            self.playing = False
            return None
        if missing > 0:
            return self._conceal()
        del self.packets[head]
        self.next_sequence, self.next_timestamp = head + 1, timestamp + self.fmt.samples_per_packet
        self.last_payload, self.missing_run = payload, 0
        return payload

    def _shrink(self, now: float) -> None:
        if self.buffered_ms <= self.target_ms + SHRINK_MARGIN_MS:
            self.over_since = None
        elif self.over_since is None:
            self.over_since = now
        elif now - self.over_since >= SHRINK_INTERVAL_S:
            self._drop_oldest(self.buffered_ms - self.fmt.ptime_ms)
            self.over_since = now

    def _start(self, now: float) -> bool:
        if not self.packets or self.first_arrival is None:
            return False
        if self.buffered_ms < self.target_ms and (now - self.first_arrival) * 1000 < self.target_ms:
            return False
        self.playing, self.first_arrival = True, None
        self._resume_at_head()
        return True

    def _resume_at_head(self) -> None:
        head = min(self.packets)
        self.next_sequence, self.next_timestamp = head, self.packets[head][0]

    def _conceal(self) -> bytes:
        # The first missing packet repeats the last one (a 20 ms repeat is barely heard); a longer loss is silence.
        payload = self.last_payload if self.missing_run == 0 and self.last_payload is not None else None
        self.missing_run += 1
        self.stats.concealed += 1
        assert self.next_sequence is not None
        self.next_sequence += 1
        self.next_timestamp += self.fmt.samples_per_packet
        return payload or self.fmt.silence_packet

    def _drop_oldest(self, down_to_ms: float) -> None:
        dropped = 0
        while self.packets and self.buffered_ms > down_to_ms:
            del self.packets[min(self.packets)]
            dropped += 1
        self.stats.packets_trimmed += dropped
        if self.packets and self.next_sequence is not None:
            self._resume_at_head()  # the dropped stretch is skipped, not concealed
        logger.debug("RTP jitter buffer: %d packets dropped to %.0f ms", dropped, self.buffered_ms)


@dataclass(frozen=True)
class _DigitRequest:
    code: int
    duration: int  # timestamp units
    volume: int


@dataclass
class _EventInProgress:
    request: _DigitRequest
    timestamp: int
    started: float  # the tick time of its first packet
    packets: int = 0
    ends: int = 0


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, session: RtpSession) -> None:
        self.session = session

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        self.session.datagram_received(data, addr)

    def error_received(self, exc: Exception) -> None:  # an ICMP port unreachable for a packet we sent
        logger.debug("RTP on port %d: %s", self.session.port, exc)


class RtpSession:
    """One call's RTP: `open` binds the port (for the SDP), `start` begins the media once the peer's is known."""

    def __init__(
        self, host: str, *, jitter_ms: int, max_jitter_ms: int, timeout_s: float, clock: Callable[[], float]
    ) -> None:
        self.host = host
        self.port = 0
        self.stats = RtpStats()
        self._jitter_ms = jitter_ms
        self._max_jitter_ms = max(jitter_ms, max_jitter_ms)
        self._timeout_s = timeout_s
        self._clock = clock
        self._transport: asyncio.DatagramTransport | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self._fmt: RtpFormat | None = None
        self._remote: tuple[str, int] | None = None
        self._peer: tuple[str, int] | None = None  # latched from the first valid packet
        # the addresses the first packet may come from (the SDP's, the signalling peer's); None: any
        self.latch_from: Callable[[str], bool] | None = None
        self._hold = False
        self._on_audio: Callable[[bytes], None] = _ignore
        self._on_digit: Callable[[str], None] = _ignore
        self._on_timeout: Callable[[], None] = _ignore
        self._errors = 0
        # receiving
        self._sequencer: _Sequencer | None = None
        self._buffer: JitterBuffer | None = None
        self._previous: tuple[int, float, int] | None = None  # the last audio packet's SSRC, arrival, timestamp
        self._jitter = 0.0  # in timestamp units
        self._seen_events: deque[tuple[int, int]] = deque(maxlen=SEEN_EVENTS)
        self._last_received = 0.0
        self._timed_out = False
        # sending: tick n is at _t0 + n * ptime and carries timestamp _ts0 + n * samples_per_packet
        self._t0 = 0.0
        self._ts0 = secrets.randbits(32)
        self._next_tick = 0
        self._sequence = secrets.randbits(16)
        self._ssrc = secrets.randbits(32)
        self._queue = bytearray()
        self._appended = False  # audio queued since the last tick
        self._last_audio_tick: int | None = None
        self._digits: deque[_DigitRequest] = deque()
        self._event: _EventInProgress | None = None
        self._next_digit_at = -math.inf

    @classmethod
    async def open(
        cls,
        host: str,
        *,
        ports: tuple[int, int] | None = None,
        jitter_ms: int = 60,
        max_jitter_ms: int = 200,
        timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> RtpSession:
        session = cls(host, jitter_ms=jitter_ms, max_jitter_ms=max_jitter_ms, timeout_s=timeout_s, clock=clock)
        loop = asyncio.get_running_loop()
        last_error: OSError | None = None
        for port in _candidate_ports(ports):
            try:
                transport, _ = await loop.create_datagram_endpoint(lambda: _Protocol(session), local_addr=(host, port))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE or ports is None:
                    raise
                last_error = exc  # taken: try the next even port
                continue
            session._transport = transport
            session.port = transport.get_extra_info("sockname")[1]
            return session
        raise OSError(f"no free RTP port on {host} in {ports}") from last_error

    # ------------------------------------------------------------------ control

    def start(
        self,
        remote: tuple[str, int],
        fmt: RtpFormat,
        *,
        on_audio: Callable[[bytes], None],
        on_digit: Callable[[str], None],
        on_timeout: Callable[[], None],
    ) -> None:
        if self._transport is None or self._closed:
            raise RuntimeError("the RTP session is closed")
        if self._fmt is not None:
            raise RuntimeError("the RTP session has already started")
        self._on_audio, self._on_digit, self._on_timeout = on_audio, on_digit, on_timeout
        self._remote = (remote[0], remote[1])
        now = self._clock()
        self._apply_format(fmt, now)
        self._last_received = now
        self._task = asyncio.get_running_loop().create_task(self._run_ticks(), name=f"rtp-ticks-{self.port}")

    def update(
        self, remote: tuple[str, int] | None = None, fmt: RtpFormat | None = None, *, hold: bool | None = None
    ) -> None:
        if self._fmt is None:
            raise RuntimeError("the RTP session has not started")
        now = self._clock()
        if remote is not None:
            self._remote, self._peer = (remote[0], remote[1]), None  # the next valid packet latches again
        if fmt is not None and fmt != self._fmt:
            self._apply_format(fmt, now)
        if hold is not None and hold != self._hold:
            self._hold = hold
            self._last_received = now  # the timeout counts from the resumption, not from before the hold
            self._last_audio_tick = None  # the first packet after the hold carries the marker
            logger.info("RTP on port %d %s", self.port, "on hold" if hold else "resumed")

    def send_audio(self, data: bytes) -> None:
        if data:
            self._queue += data
            self._appended = True

    def clear(self) -> None:
        self._queue.clear()

    def queued_ms(self) -> float:
        if self._fmt is None:
            return 0.0
        return len(self._queue) * self._fmt.ptime_ms / self._fmt.bytes_per_packet

    def send_digit(self, digit: str, duration_ms: int = 200, volume: int = 10) -> None:
        if self._fmt is None or self._fmt.dtmf_payload_type is None:
            raise ValueError("no telephone-event payload type was negotiated")
        if len(digit) != 1 or digit.upper() not in DIGITS:
            raise ValueError(f"not a keypad digit: {digit!r}")
        duration = duration_ms * self._fmt.clock_rate // 1000
        if not 0 < duration <= 0xFFFF:
            raise ValueError(f"a digit's duration must fit one event: {duration_ms} ms")
        if not 0 <= volume <= MAX_VOLUME:
            raise ValueError(f"volume is 0 to {MAX_VOLUME} (-dBm0): {volume}")
        self._digits.append(_DigitRequest(DIGITS.index(digit.upper()), duration, volume))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._transport is not None:
            self._transport.close()
        logger.info("RTP on port %d closed: %s", self.port, self._summary())

    # ------------------------------------------------------------------ receiving

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        """A packet from the socket (the protocol calls this; tests may too). Never raises."""
        if self._fmt is None or self._closed:
            return
        try:
            self._receive(data, (addr[0], addr[1]), self._clock())
        except Exception:  # a bug here must not take the socket's protocol down
            self._report_error("receiving a packet")

    def _receive(self, data: bytes, source: tuple[str, int], now: float) -> None:
        assert self._fmt is not None and self._sequencer is not None
        try:
            packet = RtpPacket.parse(data)
        except MalformedPacket as exc:
            self.stats.packets_malformed += 1
            logger.debug("RTP from %s: malformed (%s)", source, exc)
            return
        if self._peer is not None and source != self._peer:
            self.stats.packets_foreign += 1
            logger.debug("RTP from %s ignored: the peer is %s", source, self._peer)
            return
        if self._peer is None and self.latch_from is not None and not self.latch_from(source[0]):
            self.stats.packets_foreign += 1  # RTP bleed: a stranger spraying ports may not become the peer
            logger.debug("RTP from %s ignored: not an address the call may latch to", source)
            return
        is_event = packet.payload_type == self._fmt.dtmf_payload_type
        if packet.payload_type != self._fmt.payload_type and not is_event:
            self.stats.packets_ignored += 1
            logger.debug("RTP from %s: payload type %d ignored", source, packet.payload_type)
            return
        if self._peer is None:
            self._peer = source
            logger.info("RTP on port %d: peer latched at %s:%d (SDP said %s)", self.port, *source, self._remote)
        self._last_received = now
        if is_event and self._sequencer.ssrc not in (None, packet.ssrc):
            # Some gateways send events under an SSRC of their own: they take no place in the audio's sequence.
            self.stats.packets_received += 1
            self._receive_event(packet)
            return
        extended = self._sequencer.extend(packet)
        if extended is None:
            return
        self.stats.packets_received += 1
        if is_event:
            self._receive_event(packet)
        else:
            self._receive_audio(packet, *extended, now)

    def _receive_audio(self, packet: RtpPacket, sequence: int, timestamp: int, now: float) -> None:
        assert self._fmt is not None and self._buffer is not None
        if self._previous is not None and self._previous[0] == packet.ssrc:
            _, arrival, sent = self._previous
            difference = (now - arrival) * self._fmt.clock_rate - _signed(packet.timestamp - sent, TS_MOD)
            # A stray packet's timestamp says nothing of the network: one moves the estimate by max/16 at most.
            bound = self._max_jitter_ms * self._fmt.clock_rate / 1000
            self._jitter += (min(abs(difference), bound) - self._jitter) * JITTER_GAIN
        self._previous = (packet.ssrc, now, packet.timestamp)
        self.stats.jitter_ms = self._jitter * 1000 / self._fmt.clock_rate
        self._buffer.adapt(self.stats.jitter_ms)
        result = self._buffer.push(sequence, timestamp, packet.payload, now)
        logger.debug("RTP in seq %d ts %d: %s", packet.sequence, packet.timestamp, result.value)

    def _receive_event(self, packet: RtpPacket) -> None:
        try:
            event = TelephoneEvent.parse(packet.payload)
        except MalformedPacket:
            self.stats.packets_malformed += 1
            return
        key = (packet.ssrc, packet.timestamp)  # one event, however many of its packets arrive
        if event.code >= len(DIGITS) or key in self._seen_events:
            return
        self._seen_events.append(key)
        self.stats.digits_received += 1
        logger.debug("RTP telephone-event %d at ts %d", event.code, packet.timestamp)
        self._call(self._on_digit, DIGITS[event.code])

    # ------------------------------------------------------------------ the tick

    async def _run_ticks(self) -> None:
        assert self._fmt is not None
        while True:
            delay = self._t0 + self._next_tick * self._fmt.ptime_ms / 1000 - self._clock()
            await asyncio.sleep(max(0.0, delay))
            try:
                self.tick(self._clock())
            except Exception:
                self._report_error("the RTP tick")

    def tick(self, now: float) -> None:
        """Plays out, sends and checks the timeout for every ptime tick of the grid up to `now` (the tick task
        calls it; a test calls it with its own clock's time). A task far behind skips to the present."""
        if self._fmt is None or self._closed:
            return
        period = self._fmt.ptime_ms / 1000
        due = math.floor((now - self._t0) / period + TICK_EPSILON)
        if due < self._next_tick:
            return
        behind = due - self._next_tick
        if behind >= MAX_CATCHUP_TICKS:
            # Sending skips to the present: a burst would only pile up in the peer's jitter buffer. Playout
            # catches up on what is buffered: that is the caller's audio the server has not had yet.
            logger.debug("RTP tick %d ticks late: skipping ahead", behind)
            for _ in range(behind):
                self._play(now)
            self._next_tick = due
        while self._next_tick <= due:
            index = self._next_tick
            self._next_tick += 1
            tick_time = self._t0 + index * period
            self._play(now)
            self._send(index, tick_time, now)
            self._check_timeout(now)

    def _play(self, now: float) -> None:
        assert self._buffer is not None
        payload = self._buffer.pop(now)
        if payload is not None:
            self._call(self._on_audio, payload)

    def _check_timeout(self, now: float) -> None:
        if self._hold or self._timed_out or now - self._last_received < self._timeout_s:
            return
        self._timed_out = True
        logger.info("RTP on port %d: nothing received for %.0f s", self.port, now - self._last_received)
        self._call(self._on_timeout)

    # ------------------------------------------------------------------ sending

    def _send(self, index: int, tick_time: float, now: float) -> None:
        assert self._fmt is not None
        if self._hold:
            # The audio still plays out at real time, into nothing: the server's idea of what was heard holds,
            # and nothing stale is left to send on resumption.
            del self._queue[: self._fmt.bytes_per_packet]
            self._digits.clear()
            self._event = None
            return
        timestamp = self._ts0 + index * self._fmt.samples_per_packet
        self._send_event(timestamp, tick_time)
        chunk = self._next_chunk()
        if chunk is None:
            return
        marker = self._last_audio_tick != index - 1  # the first packet of a talk spurt (RFC 3551 §4.1)
        self._last_audio_tick = index
        self._transmit(RtpPacket(self._fmt.payload_type, self._sequence, timestamp, self._ssrc, chunk, marker))
        self.stats.send_jitter_ms.append(max(0.0, now - tick_time) * 1000)

    def _next_chunk(self) -> bytes | None:
        # A part packet waits one tick for the rest of it; if none came, it is the end and goes out padded.
        assert self._fmt is not None
        size = self._fmt.bytes_per_packet
        appended, self._appended = self._appended, False
        if len(self._queue) < size and (not self._queue or appended):
            return None
        chunk = bytes(self._queue[:size])
        del self._queue[:size]
        return chunk + self._fmt.silence_packet[len(chunk) :]

    def _send_event(self, timestamp: int, tick_time: float) -> None:
        assert self._fmt is not None
        if self._fmt.dtmf_payload_type is None:  # a re-INVITE took telephone-event away: nothing to send them in
            self._digits.clear()
            self._event = None
            return
        if self._event is None:
            if not self._digits or tick_time < self._next_digit_at:
                return
            self._event = _EventInProgress(self._digits.popleft(), timestamp, tick_time)
            self.stats.digits_sent += 1
        event = self._event
        while self._event is not None and tick_time >= event.started + event.packets * EVENT_INTERVAL_S - 1e-9:
            self._send_event_packet(event, tick_time)

    def _send_event_packet(self, event: _EventInProgress, tick_time: float) -> None:
        # Each update carries the duration so far, counting the interval it stands for; the update that reaches
        # the digit's duration is the end, sent three times.
        assert self._fmt is not None and self._fmt.dtmf_payload_type is not None
        interval = round(EVENT_INTERVAL_S * self._fmt.clock_rate)
        duration = min((event.packets + 1) * interval, event.request.duration)
        end = duration >= event.request.duration
        block = TelephoneEvent(event.request.code, end, event.request.volume, duration)
        packet = RtpPacket(
            self._fmt.dtmf_payload_type,
            self._sequence,
            event.timestamp,
            self._ssrc,
            block.serialize(),
            event.packets == 0,
        )
        self._transmit(packet)
        event.packets += 1
        event.ends += end
        if event.ends >= END_PACKETS:
            self._event = None
            self._next_digit_at = tick_time + DIGIT_GAP_S

    def _transmit(self, packet: RtpPacket) -> None:
        destination = self._peer or self._remote
        if self._transport is None or self._transport.is_closing() or destination is None:
            return
        self._transport.sendto(packet.serialize(), destination)
        self._sequence = (self._sequence + 1) % SEQ_MOD
        self.stats.packets_sent += 1
        logger.debug("RTP out pt %d seq %d ts %d", packet.payload_type, packet.sequence, packet.timestamp)

    # ------------------------------------------------------------------ helpers

    def _apply_format(self, fmt: RtpFormat, now: float) -> None:
        old = self._fmt
        self._fmt = fmt
        if old is not None and (old.ptime_ms, old.clock_rate) == (fmt.ptime_ms, fmt.clock_rate):
            assert self._buffer is not None
            self._buffer.fmt = fmt  # the same timing: what is buffered plays on (with the new codec's silence)
            return
        # A new packet timing: a new grid from now (the timestamps run on), and a fresh receive state.
        if old is not None:
            elapsed = max(0.0, now - self._t0)
            self._ts0 = (self._ts0 + round(elapsed * old.clock_rate)) % TS_MOD
        self._t0, self._next_tick, self._last_audio_tick = now, 0, None
        self._sequencer = _Sequencer(fmt.samples_per_packet, self.stats)
        self._buffer = JitterBuffer(fmt, self._jitter_ms, self._max_jitter_ms, self.stats)
        self._previous, self._jitter = None, 0.0

    def _call(self, callback: Callable[..., None], *args: object) -> None:
        try:
            callback(*args)
        except Exception:
            self._report_error(f"the {getattr(callback, '__name__', 'RTP')} callback")

    def _report_error(self, where: str) -> None:
        self._errors += 1
        if self._errors <= ERRORS_LOGGED:
            logger.exception("RTP on port %d: error in %s", self.port, where)
        else:
            logger.debug("RTP on port %d: error in %s (%d so far)", self.port, where, self._errors, exc_info=True)

    def _summary(self) -> str:
        s = self.stats
        return (
            f"received {s.packets_received}, lost {s.packets_lost}, late {s.packets_late}, "
            f"concealed {s.concealed}, foreign {s.packets_foreign}, malformed {s.packets_malformed}, "
            f"jitter {s.jitter_ms:.1f} ms, sent {s.packets_sent}, send jitter p99 {s.send_jitter_p99():.1f} ms"
        )


def _candidate_ports(ports: tuple[int, int] | None) -> list[int]:
    """Even ports of the inclusive range from a random one on (RTP takes the even one, RFC 3550 §11), or any."""
    if ports is None:
        return [0]
    low, high = ports
    evens = list(range(low + low % 2, high + 1, 2))
    if not evens:
        raise ValueError(f"no even port in {ports}")
    first = secrets.randbelow(len(evens))
    return evens[first:] + evens[:first]


def _ignore(*_: object) -> None:
    pass
