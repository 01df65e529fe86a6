"""kame.sip.rtp: the jitter buffer, symmetric latching, RFC 4733 digits both ways, pacing and the timeout on a
manual clock, with packets built here from RFC 3550's header layout; then two real sessions over loopback."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import select
import socket
import struct

import pytest

from kame.sip.rtp import MalformedPacket, RtpFormat, RtpPacket, RtpSession, RtpStats

PCMU = RtpFormat(payload_type=0)
PCMU_DTMF = RtpFormat(payload_type=0, dtmf_payload_type=101)
SILENCE = b"\xff" * 160
SSRC = 0x5EED1234
START = 100.0
PTIME = 0.02


def rtp(seq: int, ts: int, payload: bytes, *, pt: int = 0, ssrc: int = SSRC, marker: bool = False) -> bytes:
    """RFC 3550 §5.1: V=2, P=0, X=0, CC=0 | M, PT | sequence | timestamp | SSRC, then the payload."""
    first = 2 << 6
    second = (0x80 if marker else 0) | pt
    return struct.pack("!BBHII", first, second, seq % 65536, ts % (1 << 32), ssrc) + payload


def audio(n: int, *, seq0: int = 0, ts0: int = 0, ssrc: int = SSRC) -> bytes:
    """The n-th audio packet of a stream: 20 ms of G.711 whose bytes say which packet it is."""
    return rtp(seq0 + n, ts0 + 160 * n, voice(n), ssrc=ssrc)


def voice(n: int) -> bytes:
    return struct.pack("!H", n) * 80


def event(seq: int, ts: int, code: int, duration: int, *, end: bool = False, marker: bool = False) -> bytes:
    """RFC 4733 §2.3: event | E R volume(6) | duration, in an RTP packet of payload type 101."""
    payload = struct.pack("!BBH", code, (0x80 if end else 0) | 10, duration)
    return rtp(seq, ts, payload, pt=101, marker=marker)


def header(data: bytes) -> dict:
    first, second, seq, ts, ssrc = struct.unpack_from("!BBHII", data)
    return {
        "version": first >> 6,
        "marker": bool(second & 0x80),
        "pt": second & 0x7F,
        "seq": seq,
        "ts": ts,
        "ssrc": ssrc,
        "payload": data[12:],
    }


class ManualClock:
    def __init__(self) -> None:
        self.t = START

    def __call__(self) -> float:
        return self.t


class Rig:
    """A session on a manual clock; a peer socket that receives what it sends; what its callbacks were told."""

    def __init__(self, session: RtpSession, clock: ManualClock, peer: socket.socket) -> None:
        self.session = session
        self.clock = clock
        self.peer = peer
        self.audio: list[bytes] = []
        self.digits: list[str] = []
        self.timeouts = 0

    @property
    def peer_address(self) -> tuple[str, int]:
        return self.peer.getsockname()

    def on_timeout(self) -> None:
        self.timeouts += 1

    def feed(self, data: bytes, source: tuple[str, int] | None = None) -> None:
        self.session.datagram_received(data, source or self.peer_address)

    def step(self) -> None:
        """The tick due now, then 20 ms on."""
        self.session.tick(self.clock.t)
        self.clock.t += PTIME

    def flow(self, packets: list) -> None:
        """One step per item: a packet (or a list of them) arrives, then the tick; None: nothing arrives."""
        for item in packets:
            for data in [] if item is None else [item] if isinstance(item, bytes) else item:
                self.feed(data)
            self.step()

    def idle(self, steps: int) -> None:
        self.flow([None] * steps)

    def sent(self, sock: socket.socket | None = None) -> list[bytes]:
        return received(sock or self.peer)


def received(sock: socket.socket) -> list[bytes]:
    """What has come in on a non-blocking socket (loopback delivers within the sender's sendto)."""
    packets = []
    while select.select([sock], [], [], 0)[0]:
        packets.append(sock.recv(2048))
    return packets


def udp_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


@contextlib.asynccontextmanager
async def rig(fmt: RtpFormat = PCMU, remote: tuple[str, int] | None = None, **options):
    clock = ManualClock()
    session = await RtpSession.open("127.0.0.1", clock=clock, **options)
    peer = udp_socket()
    r = Rig(session, clock, peer)
    session.start(
        remote or r.peer_address, fmt, on_audio=r.audio.append, on_digit=r.digits.append, on_timeout=r.on_timeout
    )
    try:
        yield r
    finally:
        await session.close()
        peer.close()


def run(test):
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        asyncio.run(test(*args, **kwargs))

    return wrapper


# ---------------------------------------------------------------------------------------------- the jitter buffer


@run
async def test_packets_in_order_are_delivered_one_per_tick_after_the_initial_depth():
    async with rig() as r:
        r.flow([audio(n) for n in range(10)])
        assert r.audio == [voice(n) for n in range(8)]  # playout began once 60 ms were buffered
        r.idle(10)
        assert r.audio == [voice(n) for n in range(10)]  # drained, then nothing: no concealment without packets
        s = r.session.stats
        assert (s.packets_received, s.packets_lost, s.concealed, s.packets_late) == (10, 0, 0, 0)


@run
async def test_reordered_packets_are_put_back_in_order():
    async with rig() as r:
        order = [0, 2, 1, 3, 5, 4, 6, 8, 7, 9]
        r.flow([audio(n) for n in order])
        r.idle(4)
        assert r.audio == [voice(n) for n in range(10)]
        assert r.session.stats.concealed == 0


@run
async def test_a_lost_packet_is_the_previous_one_repeated_then_silence():
    async with rig() as r:
        r.flow([audio(n) if n not in (4, 5) else None for n in range(10)])
        r.idle(4)
        assert r.audio == [voice(0), voice(1), voice(2), voice(3), voice(3), SILENCE] + [voice(n) for n in range(6, 10)]
        assert r.session.stats.concealed == 2
        assert r.session.stats.packets_lost == 2


@run
async def test_a_stray_packet_far_ahead_is_not_concealed_up_to():
    async with rig() as r:
        r.flow([audio(n) for n in range(6)])
        r.feed(audio(1000))
        r.idle(60)
        assert r.audio == [voice(n) for n in range(6)]  # the stream paused: not 20 s of silence up to the stray
        assert r.session.stats.concealed == 0
        r.flow([audio(n) for n in range(6, 12)])  # it goes on
        r.idle(15)
        # RFC 3550 A.1: the stray was within MAX_DROPOUT, so 6 reads as a jump back, taken once 7 confirms it
        assert r.audio == [voice(n) for n in [*range(6), 1000, *range(7, 12)]]
        assert r.session.stats.concealed == 0


@run
async def test_a_packet_after_its_playout_is_dropped_and_counted_late():
    async with rig() as r:
        r.flow([audio(n) if n != 4 else None for n in range(7)])  # 4's tick conceals it
        r.flow([[audio(4), audio(7)]])  # ...and then it comes
        r.idle(4)
        assert r.audio == [voice(0), voice(1), voice(2), voice(3), voice(3)] + [voice(n) for n in range(5, 8)]
        assert r.session.stats.packets_late == 1


@run
async def test_sequence_and_timestamp_wrap_around():
    async with rig() as r:
        r.flow([audio(n, seq0=65533, ts0=(1 << 32) - 480) for n in range(8)])
        r.idle(4)
        assert r.audio == [voice(n) for n in range(8)]
        s = r.session.stats
        assert (s.concealed, s.packets_lost, s.packets_late) == (0, 0, 0)


@run
async def test_a_burst_after_a_stall_is_trimmed_to_the_target_depth():
    async with rig(jitter_ms=60, max_jitter_ms=200) as r:
        r.flow([audio(n) for n in range(5)])
        r.idle(10)  # the peer stalls: the buffer drains and playout waits
        assert r.audio == [voice(n) for n in range(5)]
        r.audio.clear()
        r.flow([[audio(n) for n in range(5, 25)]])  # 400 ms at once
        trimmed = r.session.stats.packets_trimmed
        assert trimmed > 0
        r.idle(30)
        assert r.audio == [voice(n) for n in range(5 + trimmed, 25)]  # the oldest went, the rest in order
        assert len(r.audio) * 20 <= 200 + 100
        assert r.session.stats.concealed == 0


@run
async def test_the_interarrival_jitter_is_estimated_as_rfc_3550_does():
    async with rig() as r:
        for n in range(40):  # every other packet 30 ms late
            r.clock.t = START + n * PTIME + (0.03 if n % 2 else 0.0)
            r.feed(audio(n))
        expected = 30 * (1 - (15 / 16) ** 39)  # J += (|D| - J) / 16 with |D| = 30 ms each time
        assert r.session.stats.jitter_ms == pytest.approx(expected, abs=0.01)


@run
async def test_a_buffer_left_deep_by_a_stall_loses_a_packet_a_second_until_it_is_back_near_the_target():
    async with rig(jitter_ms=60, max_jitter_ms=200) as r:
        r.flow([audio(n) for n in range(10)])
        r.idle(8)  # the peer stalls 160 ms, then what it held arrives at once and it goes on at its pace
        r.flow([[audio(n) for n in range(10, 19)]] + [audio(n) for n in range(19, 270)])
        trimmed = r.session.stats.packets_trimmed
        assert 2 <= trimmed <= 5
        assert r.audio == [voice(n) for n in range(270) if voice(n) in r.audio]  # in order
        still_buffered = 270 - len(r.audio) - trimmed
        assert still_buffered * 20 <= 60 + 40  # back within 40 ms of the 60 ms target
        assert r.session.stats.concealed == 0


@run
async def test_a_new_ssrc_from_the_peer_carries_on_after_the_old_stream():
    async with rig() as r:
        r.flow([audio(n, seq0=100, ts0=5000) for n in range(5)])
        r.flow([audio(n, seq0=40000 - 5, ts0=123456789, ssrc=0xBEEF) for n in range(5, 10)])  # a PBX re-originates
        r.idle(4)
        assert r.audio == [voice(n) for n in range(10)]
        s = r.session.stats
        assert (s.concealed, s.packets_late, s.packets_lost) == (0, 0, 0)


@run
async def test_telephone_events_between_audio_packets_are_not_taken_for_loss():
    async with rig(PCMU_DTMF) as r:
        # audio seq 0-2, an event at seq 3, audio on at seq 4 with the next 20 ms: the sequence gap is no loss
        r.flow(
            [
                rtp(0, 0, voice(0)),
                rtp(1, 160, voice(1)),
                rtp(2, 320, voice(2)),
                [event(3, 320, 5, 160, marker=True), rtp(4, 480, voice(3))],
                rtp(5, 640, voice(4)),
            ]
        )
        r.idle(4)
        assert r.audio == [voice(n) for n in range(5)]
        assert r.session.stats.concealed == 0
        assert r.digits == ["5"]


@run
async def test_events_under_an_ssrc_of_their_own_leave_the_audio_alone():
    async with rig(PCMU_DTMF) as r:
        events = [rtp(900 + n, 77, struct.pack("!BBH", 3, 10, 400 * (n + 1)), pt=101, ssrc=0xE7E7) for n in range(4)]
        r.flow([[audio(n), events[n]] if n < 4 else audio(n) for n in range(8)])
        r.idle(4)
        assert r.audio == [voice(n) for n in range(8)]
        assert r.digits == ["3"]
        assert (r.session.stats.concealed, r.session.stats.packets_lost) == (0, 0)


# ---------------------------------------------------------------------------------------------- addresses


@run
async def test_the_first_packet_latches_its_source_rather_than_the_sdp_address():
    sdp = udp_socket()
    try:
        async with rig(remote=sdp.getsockname()) as r:
            r.session.send_audio(voice(0))
            r.step()
            assert [header(p)["payload"] for p in r.sent(sdp)] == [voice(0)]  # before latching: the SDP's address
            r.flow([audio(0)])  # from the peer socket's address (behind a NAT, say)
            r.session.send_audio(voice(1))
            r.step()
            assert [header(p)["payload"] for p in r.sent()] == [voice(1)]
            assert r.sent(sdp) == []
    finally:
        sdp.close()


@run
async def test_packets_from_another_source_are_ignored_after_latching():
    async with rig() as r:
        other = ("127.0.0.1", 9)
        r.flow([audio(0), audio(1)])
        r.feed(audio(2), other)
        r.feed(rtp(2, 320, b"\x00" * 160, ssrc=0xBAD), other)
        r.flow([audio(2), audio(3)])
        r.idle(4)
        assert r.audio == [voice(n) for n in range(4)]
        assert r.session.stats.packets_foreign == 2


@run
async def test_malformed_packets_and_other_payload_types_are_counted_and_ignored():
    async with rig() as r:
        good = audio(0)
        malformed = [
            good[:5],  # shorter than the header
            bytes([1 << 6]) + good[1:],  # version 1
            bytes([(2 << 6) | 15]) + good[1:20],  # 15 CSRCs announced, 2 there
            bytes([(2 << 6) | 0x10]) + good[1:12] + struct.pack("!HH", 0xBEDE, 100),  # extension beyond the end
            bytes([(2 << 6) | 0x20]) + good[1:20] + bytes([200]),  # padding longer than the payload
        ]
        for data in malformed:
            r.feed(data)
        r.feed(rtp(0, 0, voice(0), pt=8))  # PCMA, not negotiated
        r.feed(struct.pack("!BBHI", 0x80, 200, 6, SSRC) + bytes(20))  # an RTCP sender report on a muxed port
        r.idle(5)
        s = r.session.stats
        assert (s.packets_malformed, s.packets_ignored, s.packets_received) == (5, 2, 0)
        assert r.audio == []
        other = ("127.0.0.1", 9)
        r.feed(audio(0), other)  # none of those latched: this one does
        r.feed(audio(1), other)
        assert (s.packets_foreign, s.packets_received) == (0, 2)


def test_the_parser_skips_csrcs_extension_and_padding_and_never_raises_anything_else():
    payload = b"\x01\x02\x03"
    data = (
        struct.pack("!BBHII", (2 << 6) | 0x20 | 0x10 | 2, 0x80 | 8, 7, 9, SSRC)
        + b"\x00" * 8
        + struct.pack("!HH", 0xBEDE, 1)
        + b"\x00" * 4
        + payload
        + b"\x00\x00\x03"
    )
    packet = RtpPacket.parse(data)
    assert (packet.payload_type, packet.marker, packet.sequence, packet.timestamp) == (8, True, 7, 9)
    assert packet.payload == payload
    rng = random.Random(7)
    for _ in range(3000):
        noise = bytes(rng.getrandbits(8) for _ in range(rng.randrange(40)))
        with contextlib.suppress(MalformedPacket):
            RtpPacket.parse(noise)


@run
async def test_nothing_the_peer_sends_or_a_callback_raises_escapes(caplog):
    def broken(*_):
        raise RuntimeError("the server's callback failed")

    clock = ManualClock()
    session = await RtpSession.open("127.0.0.1", clock=clock)
    session.start(("127.0.0.1", 9), PCMU_DTMF, on_audio=broken, on_digit=broken, on_timeout=broken)
    rng = random.Random(3)
    with caplog.at_level(logging.DEBUG, logger="kame.sip.rtp"):
        for _ in range(500):
            header_bytes = bytes([0x80, rng.choice([0, 101, 0x80 | 101])]) + bytes(
                rng.getrandbits(8) for _ in range(10)
            )
            session.datagram_received(
                header_bytes + bytes(rng.getrandbits(8) for _ in range(rng.randrange(8))), ("127.0.0.1", 9)
            )
        for n in range(10):
            session.datagram_received(audio(n), ("127.0.0.1", 9))
            session.tick(clock.t)
            clock.t += PTIME
        clock.t += 60
        session.tick(clock.t)
    await session.close()
    errors = [record.getMessage() for record in caplog.records if "error in" in record.getMessage()]
    assert errors and all("callback" in message for message in errors)  # only the callbacks' own failures


# ---------------------------------------------------------------------------------------------- digits


@run
async def test_a_digit_is_reported_once_however_many_of_its_packets_arrive():
    async with rig(PCMU_DTMF) as r:
        # RFC 4733 §2.5: the start (marker), an update, and the end sent three times, all at the event's timestamp
        nine = [event(10, 8000, 9, 400, marker=True), event(11, 8000, 9, 800)]
        nine += [event(seq, 8000, 9, 1600, end=True) for seq in (12, 13, 14)]
        r.flow(nine)
        assert r.digits == ["9"]
        r.flow([event(15, 8000, 9, 1600, end=True)])  # a late repeat
        star = [event(16, 12000, 10, 400, marker=True)] + [event(s, 12000, 10, 800, end=True) for s in (17, 18, 19)]
        hash_ = [event(20, 16000, 11, 400, marker=True)] + [event(s, 16000, 11, 800, end=True) for s in (21, 22, 23)]
        r.flow(star + hash_)
        one = [event(s, 20000, 1, 1600, end=True) for s in (25, 26, 27)]  # its start and updates were lost
        r.flow(one)
        assert r.digits == ["9", "*", "#", "1"]
        assert r.session.stats.digits_received == 4


@run
async def test_send_digit_sends_rfc4733_packets_every_50_ms():
    async with rig(PCMU_DTMF) as r:
        r.session.send_digit("5")
        ticks = []
        for index in range(20):
            r.step()
            ticks += [(index, header(p)) for p in r.sent()]
        assert [index for index, _ in ticks] == [0, 3, 5, 8, 10, 13]  # the ticks at or after 0, 50, 100... ms
        packets = [h for _, h in ticks]
        assert {h["pt"] for h in packets} == {101}
        assert len({h["ts"] for h in packets}) == 1  # one event: one timestamp
        assert [h["marker"] for h in packets] == [True, False, False, False, False, False]
        assert [(h["seq"] - packets[0]["seq"]) % 65536 for h in packets] == list(range(6))
        blocks = [struct.unpack("!BBH", h["payload"]) for h in packets]
        assert [code for code, _, _ in blocks] == [5] * 6
        assert [bool(flags & 0x80) for _, flags, _ in blocks] == [False, False, False, True, True, True]
        assert [flags & 0x3F for _, flags, _ in blocks] == [10] * 6
        assert [duration for _, _, duration in blocks] == [400, 800, 1200, 1600, 1600, 1600]

        r.session.send_digit("*", duration_ms=100)
        r.session.send_digit("#", duration_ms=100)
        r.idle(40)
        later = [header(p) for p in r.sent()]
        assert [struct.unpack("!BBH", h["payload"])[0] for h in later] == [10] * 4 + [11] * 4
        assert len({h["ts"] for h in later}) == 2
        assert r.session.stats.digits_sent == 3

        with pytest.raises(ValueError):
            r.session.send_digit("x")
        with pytest.raises(ValueError):
            r.session.send_digit("12")
    async with rig(PCMU) as r:
        with pytest.raises(ValueError):
            r.session.send_digit("5")


# ---------------------------------------------------------------------------------------------- sending


@run
async def test_audio_goes_out_in_packets_on_the_grid_with_the_marker_after_idle():
    async with rig() as r:
        chunk = b"".join(voice(n) for n in range(4))  # 80 ms, as the server pushes it
        r.session.send_audio(chunk)
        assert r.session.queued_ms() == 80.0
        r.step()
        assert r.session.queued_ms() == 60.0
        r.idle(3)
        packets = [header(p) for p in r.sent()]
        assert [p["payload"] for p in packets] == [voice(n) for n in range(4)]
        assert [p["marker"] for p in packets] == [True, False, False, False]
        assert [p["ts"] - packets[0]["ts"] for p in packets] == [0, 160, 320, 480]
        assert [(p["seq"] - packets[0]["seq"]) % 65536 for p in packets] == [0, 1, 2, 3]
        assert {(p["version"], p["pt"], p["ssrc"]) for p in packets} == {(2, 0, packets[0]["ssrc"])}

        r.idle(6)  # nothing to send: nothing sent
        assert r.sent() == []
        r.session.send_audio(voice(9))
        r.step()
        [after] = [header(p) for p in r.sent()]
        assert after["marker"]
        assert (after["ts"] - packets[0]["ts"]) % (1 << 32) == 160 * 10  # the idle ticks' time went on
        assert (after["seq"] - packets[0]["seq"]) % 65536 == 4

        r.session.send_audio(b"\x01" * 100)  # the tail of an utterance: waits a tick for more, then padded
        r.step()
        assert r.sent() == []
        r.step()
        [tail] = [header(p) for p in r.sent()]
        assert tail["payload"] == b"\x01" * 100 + b"\xff" * 60

        r.session.send_audio(chunk)
        r.step()
        r.session.clear()  # barge-in
        assert r.session.queued_ms() == 0.0
        r.idle(3)
        assert len(r.sent()) == 1
        assert r.session.stats.send_jitter_p99() == 0.0  # a manual clock is never late


@run
async def test_a_late_tick_skips_ahead_instead_of_sending_a_burst():
    async with rig() as r:
        r.session.send_audio(b"".join(voice(n) for n in range(10)))
        r.step()
        r.clock.t += 1.0
        r.step()
        packets = [header(p) for p in r.sent()]
        assert len(packets) == 2
        assert packets[1]["ts"] - packets[0]["ts"] == 160 * 51  # stamped with the time it went out at
        assert r.session.queued_ms() == 160.0
        assert max(r.session.stats.send_jitter_ms) < 20.0


@run
async def test_a_late_tick_plays_out_what_it_missed():
    async with rig() as r:
        r.flow([audio(n) for n in range(6)])
        assert r.audio == [voice(n) for n in range(4)]
        for n in range(6, 16):  # the loop stalls 200 ms while the packets come in
            r.feed(audio(n))
        r.clock.t += 0.2
        r.step()
        assert r.audio == [voice(n) for n in range(4 + 11)]  # the ten ticks missed and this one
        r.idle(3)
        assert r.audio == [voice(n) for n in range(16)]


def test_send_jitter_p99():
    stats = RtpStats()
    assert stats.send_jitter_p99() == 0.0
    stats.send_jitter_ms.extend(float(n) for n in range(1, 101))
    assert stats.send_jitter_p99() == 99.0


# ---------------------------------------------------------------------------------------------- timeout and hold


@run
async def test_the_timeout_fires_once():
    async with rig(timeout_s=1.0) as r:
        r.flow([audio(0)])
        r.idle(49)
        assert r.timeouts == 0  # 0.98 s since the packet
        r.idle(2)
        assert r.timeouts == 1
        r.idle(100)
        assert r.timeouts == 1


@run
async def test_on_hold_nothing_is_sent_and_nothing_times_out():
    async with rig(timeout_s=1.0) as r:
        r.session.update(hold=True)
        r.session.send_audio(voice(1) * 5)
        r.idle(150)
        assert r.timeouts == 0
        assert r.sent() == []
        r.session.update(hold=False)
        r.idle(45)
        assert r.timeouts == 0  # counted from the resumption
        r.idle(10)
        assert r.timeouts == 1


@run
async def test_a_re_invite_moves_the_media_and_latches_again():
    moved = udp_socket()
    try:
        async with rig() as r:
            r.flow([audio(0)])
            r.session.update(remote=moved.getsockname())
            r.session.send_audio(voice(1))
            r.step()
            assert len(r.sent(moved)) == 1
            r.feed(audio(1), moved.getsockname())  # the new address is taken, not foreign
            assert r.session.stats.packets_foreign == 0
    finally:
        moved.close()


# ---------------------------------------------------------------------------------------------- sockets


@run
async def test_open_binds_an_even_port_from_the_range():
    session = await RtpSession.open("127.0.0.1", ports=(31000, 31999))
    try:
        assert session.port % 2 == 0 and 31000 <= session.port <= 31999
        assert session.host == "127.0.0.1"
    finally:
        await session.close()
        await session.close()  # idempotent
    with pytest.raises(ValueError):
        await RtpSession.open("127.0.0.1", ports=(31001, 31001))


@run
async def test_two_sessions_exchange_a_second_of_audio_and_a_digit_over_loopback():
    a = await RtpSession.open("127.0.0.1")
    b = await RtpSession.open("127.0.0.1")
    heard: dict[str, list[bytes]] = {"a": [], "b": []}
    digits: list[str] = []
    done = {"a": asyncio.Event(), "b": asyncio.Event(), "digit": asyncio.Event()}
    count = 50  # 1 s of 20 ms packets each way

    def hear(name: str, receiver: list[RtpSession]):
        def on_audio(payload: bytes) -> None:
            heard[name].append(payload)
            # a loaded machine's late ticks may leave the buffer deep enough for a packet to be trimmed
            if len(heard[name]) + receiver[0].stats.packets_trimmed >= count:
                done[name].set()

        return on_audio

    def on_digit(digit: str) -> None:
        digits.append(digit)
        done["digit"].set()

    try:
        a.start(("127.0.0.1", b.port), PCMU_DTMF, on_audio=hear("a", [a]), on_digit=on_digit, on_timeout=lambda: None)
        b.start(("127.0.0.1", a.port), PCMU_DTMF, on_audio=hear("b", [b]), on_digit=on_digit, on_timeout=lambda: None)
        sent = [voice(n) for n in range(count)]
        a.send_audio(b"".join(sent))
        b.send_audio(b"".join(reversed(sent)))
        a.send_digit("7")
        async with asyncio.timeout(3.0):
            await asyncio.gather(*(event.wait() for event in done.values()))
        for receiver, payloads, expected in ((b, heard["b"], sent), (a, heard["a"], list(reversed(sent)))):
            assert payloads == [p for p in expected if p in payloads]  # in order, nothing made up
            assert len(payloads) + receiver.stats.packets_trimmed == count
            assert receiver.stats.concealed == 0 and receiver.stats.packets_lost == 0
        assert digits == ["7"]
        assert b.stats.packets_received == count + 6  # the audio and the digit's six packets
        assert a.stats.packets_sent == count + 6
    finally:
        await a.close()
        await b.close()
