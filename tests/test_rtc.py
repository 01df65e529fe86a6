"""The WebRTC audio path's parts: the reordering gate, the 2:1 resamplers, the Opus input thread (fed
by aiortc's own Opus encoder, the peer's definition of the packets), the audio level, and the
assistant's track catching up on a backlog."""

from __future__ import annotations

import asyncio
import fractions
import time
from dataclasses import dataclass

import av
import numpy as np
import pytest
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.codecs.opus import OpusEncoder
from aiortc.mediastreams import MediaStreamError
from aiortc.rtp import compute_audio_level_dbov

from kame import opus
from kame.pcm import Resampler
from kame.rtc import RESTART_RUN, OpusInput, ReorderGate, audio_level_dbov, ptime, receive_opus, with_ptime
from server.live.assistant_track import (
    BLOCK,
    PHASE_MARGIN_S,
    PTIME_SAMPLES,
    SLACK_S,
    SLOT,
    AssistantTrack,
    _opus_encoder,
    _Pacer,
    _quiet_after_silence,
    empty_frames,
)


@dataclass
class Packet:
    sequence_number: int


def released(gate: ReorderGate, *seqs: int) -> list[tuple[int, int]]:
    out = []
    for seq in seqs:
        out += [(lost, p.sequence_number) for lost, p in gate.push(Packet(seq))]
    return out


def test_packets_in_order_go_out_at_once():
    gate = ReorderGate()
    assert released(gate, 65534, 65535, 0, 1) == [(0, 65534), (0, 65535), (0, 0), (0, 1)]  # across the wrap
    assert gate.hold == 0 and gate.lost == 0


def test_a_gap_is_given_up_at_once_on_a_link_that_keeps_order_and_waited_for_once_it_reorders():
    gate = ReorderGate(relax_after=6)
    assert released(gate, 10, 12) == [(0, 10), (1, 12)]  # 11 lost, no wait
    assert released(gate, 11) == [] and gate.late == 1 and gate.hold == 1  # it came after all: wait one
    assert released(gate, 14) == []  # held: 13 may come
    assert released(gate, 13) == [(0, 13), (0, 14)]  # in order
    assert released(gate, 16, 17) == [(1, 16), (0, 17)]  # two past the gap: 15 given up
    assert released(gate, 18, 19, 20, 21) == [(0, s) for s in (18, 19, 20, 21)]
    assert gate.hold == 0  # six in order since the last late one: the wait shrinks


def test_duplicates_and_restarts():
    gate = ReorderGate()
    assert released(gate, 5, 6, 6, 5) == [(0, 5), (0, 6)]
    assert gate.hold == 0 and gate.late == 0  # a duplicate is not reordering
    assert released(gate, 40000) == [(0, 40000)]  # a new stream
    assert gate.lost == 0


def test_a_stream_that_went_back_is_taken_up_again_after_a_run_of_packets():
    """One stray packet far ahead (or a sender that restarted its numbering lower) left every later packet
    'late': dropped until the stream caught up, a minute at 40 ms packets. Eight in sequence behind
    restart the gate there; a few late ones in a row do not."""
    gate = ReorderGate()
    released(gate, 100, 101, 102)
    assert released(gate, 1600) == [(1497, 1600)]  # a stray packet far ahead: the gap is given up
    assert released(gate, *range(103, 103 + RESTART_RUN - 1)) == []  # late, for now
    assert released(gate, 103 + RESTART_RUN - 1) == [(0, 103 + RESTART_RUN - 1)]  # the stream is back
    after = 103 + RESTART_RUN
    assert released(gate, after, after + 1) == [(0, after), (0, after + 1)]
    gate2 = ReorderGate()
    released(gate2, 10, 14)  # 11-13 given up
    assert released(gate2, 11, 12, 13) == [] and gate2.late == 3  # late ones, not a restart


def test_the_resamplers_keep_every_sample_and_the_voice_band():
    up, down = Resampler(24000, 48000), Resampler(48000, 24000)
    rate = 24000
    tone = np.sin(2 * np.pi * 1000 * np.arange(rate) / rate).astype(np.float32)
    chunks = [up(c) for c in np.split(tone, 25)]  # 40 ms at a time
    assert [len(c) for c in chunks] == [1920] * 25
    back = np.concatenate([down(c) for c in np.split(np.concatenate(chunks), 50)])
    assert len(back) == rate
    assert abs(back[2000:].std() / tone.std() - 1) < 0.01
    high = np.sin(2 * np.pi * 18000 * np.arange(48000) / 48000).astype(np.float32)
    assert Resampler(48000, 24000)(high)[200:].std() < 1e-3  # over the 24 kHz side's Nyquist: not folded back


def _opus_packets(pcm48: np.ndarray) -> list[bytes]:
    encoder, packets = OpusEncoder(), []
    for index, start in enumerate(range(0, len(pcm48), 960)):
        frame = av.AudioFrame.from_ndarray((pcm48[start:start + 960] * 32767).astype(np.int16).reshape(1, -1),
                                           format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = 48000, index * 960, fractions.Fraction(1, 48000)
        packets += encoder.encode(frame)[0]
    return packets


@pytest.mark.parametrize("direct", [True, False], ids=["libopus", "pyav"])
def test_opus_input_decodes_each_packet_as_it_comes_at_24khz(direct, monkeypatch):
    if not direct:  # no libopus to call: PyAV's decoder, at 48 kHz, halved
        monkeypatch.setattr("kame.rtc.opus.library", lambda: None)
    else:
        assert opus.library() is not None  # (PyAV's wheel carries one where the system has none)
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(48000) / 48000)).astype(np.float32)
    packets = _opus_packets(tone)

    async def scenario():
        opus = OpusInput(asyncio.get_running_loop())
        sizes = []
        for index, packet in enumerate(packets[:10]):
            opus.push(packet, lost_before=2 if index == 5 else 0)
            sizes.append(len(await asyncio.wait_for(opus.frames.get(), 5)))  # nothing held back
        opus.push(b"\xff\xff\xff")  # not Opus
        opus.push(packets[10])
        last = await asyncio.wait_for(opus.frames.get(), 5)
        opus.close()
        opus.push(packets[11])  # the peer's packets still coming while its connection closes: dropped
        assert await asyncio.wait_for(opus.frames.get(), 5) is None
        await asyncio.sleep(0.1)
        assert opus.frames.empty()
        return sizes, last, opus.undecodable

    sizes, last, undecodable = asyncio.run(scenario())
    assert sizes == [480] * 5 + [480 * 3] + [480] * 4  # two lost packets made up (libopus) or silence (PyAV)
    assert 0.15 < np.abs(last).max() < 0.45 and len(last) == 480
    assert undecodable == 1


def test_libopus_called_directly_speaks_the_peers_opus():
    """kame.opus against FFmpeg's libopus wrapper (PyAV) and aiortc's encoder, the peers' definitions:
    their packets decode at 24 kHz, ours decode in FFmpeg, any packet time; bad bytes are an OpusError."""
    tone48 = (0.3 * np.sin(2 * np.pi * 440 * np.arange(48000) / 48000)).astype(np.float32)
    decoder, packets = opus.Decoder(24000), _opus_packets(tone48)
    theirs = [decoder.decode(p) for p in packets]
    assert {len(pcm) for pcm in theirs} == {480}
    ffmpeg = av.CodecContext.create("libopus", "r")  # the same packets through FFmpeg, downmixed
    ffmpeg.format, ffmpeg.layout, ffmpeg.sample_rate = "s16", "stereo", 48000
    reference = np.concatenate([f.to_ndarray().reshape(-1, 2).mean(axis=1) / 32768
                                for p in packets for f in ffmpeg.decode(av.Packet(p))])
    assert abs(np.concatenate(theirs)[2400:].std() / reference[4800:].std() - 1) < 0.05
    assert len(decoder.conceal(3)) == 3 * 480 and decoder.last_samples == 480
    with pytest.raises(opus.OpusError, match="opus_decode_float"):
        decoder.decode(b"\xff\xff\xff\xff")

    tone24 = (0.3 * np.sin(2 * np.pi * 440 * np.arange(24000) / 24000) * 32767).astype(np.int16)
    ffmpeg = av.CodecContext.create("libopus", "r")
    ffmpeg.format, ffmpeg.layout, ffmpeg.sample_rate = "s16", "mono", 48000
    for ms, complexity in ((20, 10), (40, 5), (60, 0)):
        encoder, size = opus.Encoder(24000, 48000, complexity), 24 * ms
        ours = [encoder.encode(tone24[i:i + size]) for i in range(0, len(tone24) - size + 1, size)]
        decoded = [np.concatenate([f.to_ndarray().reshape(-1) for f in ffmpeg.decode(av.Packet(p))]) for p in ours]
        assert {len(pcm) for pcm in decoded} == {48 * ms}, ms
        level = np.concatenate(decoded)[4800:].astype(np.float32).std() / 32767
        assert abs(level / (0.3 / np.sqrt(2)) - 1) < 0.1, (ms, level)


def test_an_answer_asks_for_the_packet_time_in_its_audio_section():
    async def answer() -> str:
        offerer, answerer = RTCPeerConnection(), RTCPeerConnection()
        offerer.addTransceiver("audio")
        offerer.createDataChannel("oai-events")
        await offerer.setLocalDescription(await offerer.createOffer())
        await answerer.setRemoteDescription(offerer.localDescription)
        answerer.addTrack(AssistantTrack())
        await answerer.setLocalDescription(await answerer.createAnswer())
        sdp = answerer.localDescription.sdp
        asked = with_ptime(sdp, 40)
        await offerer.setRemoteDescription(RTCSessionDescription(asked, "answer"))  # aiortc reads it
        await offerer.close()
        await answerer.close()
        return sdp, asked

    sdp, asked = asyncio.run(answer())
    assert ptime(sdp) == 20 and ptime(asked) == 40 and ptime(with_ptime(asked, 60)) == 60
    assert with_ptime(asked, 60).count("a=ptime") == 1  # asked again: the old line replaced
    two = "v=0\r\nm=audio 9 RTP/SAVPF 111\r\nc=IN IP4 0.0.0.0\r\na=ptime:20\r\na=mid:0\r\n" \
          "m=audio 9 RTP/SAVPF 111\r\nc=IN IP4 0.0.0.0\r\na=mid:1\r\n"
    assert with_ptime(two, 40).split("\r\n") == [
        "v=0", "m=audio 9 RTP/SAVPF 111", "c=IN IP4 0.0.0.0", "a=ptime:40", "a=mid:0",
        "m=audio 9 RTP/SAVPF 111", "c=IN IP4 0.0.0.0", "a=ptime:40", "a=mid:1", ""]
    audio, application = asked.split("m=application")
    assert audio.count("a=ptime:40") == 1 and "a=ptime" not in application
    lines = audio[audio.index("m=audio"):].split("\r\n")
    first_attribute = next(i for i, line in enumerate(lines) if line.startswith("a="))
    assert lines[first_attribute] == "a=ptime:40" and lines[first_attribute - 1].startswith("c=")


@pytest.mark.parametrize("layout", ["mono", "stereo"])
def test_the_audio_level_is_aiortcs(layout):
    rng = np.random.default_rng(0)
    channels = 2 if layout == "stereo" else 1
    for scale in (0, 3, 300, 30000):
        samples = (rng.standard_normal((1, 960 * channels)) * scale).clip(-32768, 32767).astype(np.int16)
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout=layout)
        assert audio_level_dbov(frame) == compute_audio_level_dbov(frame)


def test_receive_opus_leaves_a_receiver_it_does_not_know_alone():
    class Codec:
        mimeType = "audio/opus"

    class Transceiver:
        _codecs = [Codec()]
        receiver = object()  # no jitter buffer where aiortc 1.16 has one

    async def scenario():
        return receive_opus(Transceiver())

    assert asyncio.run(scenario()) is None


def test_empty_rtp_packets_hold_their_place_and_are_not_taken_for_lost_audio():
    """Padding or keep-alive packets (no payload) have sequence numbers of their own: they count as arrived,
    so the packets around them are not taken for lost ones (each would have added 20 ms of made-up audio
    to the user's timeline); a real loss next to them is still made up."""
    from types import SimpleNamespace

    from aiortc.jitterbuffer import JitterBuffer
    from aiortc.rtp import RtpPacket

    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(48000) / 48000)).astype(np.float32)
    packets = _opus_packets(tone)[:12]  # 20 ms each

    async def scenario():
        handled = []

        async def handle(packet, arrival_time_ms):
            handled.append(packet.sequence_number)

        receiver = SimpleNamespace(_RTCRtpReceiver__jitter_buffer=JitterBuffer(capacity=16), _handle_rtp_packet=handle)
        transceiver = SimpleNamespace(_codecs=[SimpleNamespace(mimeType="audio/opus")], receiver=receiver)
        decoded = receive_opus(transceiver)
        seq = 100
        for index, payload in enumerate(packets):
            if index == 8:
                seq += 1  # a real loss: one packet never comes
            await receiver._handle_rtp_packet(RtpPacket(sequence_number=seq, payload=payload), 0)
            seq += 1
            if index % 3 == 2:  # padding between the audio packets
                await receiver._handle_rtp_packet(RtpPacket(sequence_number=seq, payload=b""), 0)
                seq += 1
        await asyncio.sleep(0.2)
        decoded.close()
        samples = 0
        while (pcm := await asyncio.wait_for(decoded.frames.get(), 5)) is not None:
            samples += len(pcm)
        return samples, len(handled), decoded.gate.lost

    samples, handled, lost = asyncio.run(scenario())
    assert handled == 12 + 4  # aiortc's statistics and RTCP see every packet
    assert lost == 1 and samples == (12 + 1) * 480  # 12 packets and the one lost, 20 ms each at 24 kHz


# -------------------------------------------------------------------- the assistant's track


FRAME = 1920  # 80 ms at 24 kHz
SPEECH, SILENCE = np.full(FRAME, 0.2, np.float32), np.zeros(FRAME, np.float32)


PACKETS = FRAME // PTIME_SAMPLES  # a frame's packets


class Raw:
    """In place of an encoded packet: the audio it would carry."""

    def __init__(self, pcm: np.ndarray) -> None:
        self.pcm = pcm


def tick(track: AssistantTrack) -> np.ndarray:
    """What the track's thread does at a packet's time, and what `recv` reports on the loop."""
    packet, started = track._make(Raw)
    for frame in started:
        track.sent(frame, packet.pts // SLOT)
    return packet.pcm


def test_frames_on_time_are_sent_whole_and_in_order():
    sent = []
    track = AssistantTrack(lambda frame, packet: sent.append((frame, packet)))
    for frame in range(10):
        track.play(SPEECH, frame)
        for _ in range(PACKETS):
            assert len(tick(track)) == PTIME_SAMPLES
    assert track.skipped_samples == track.hurried_samples == 0
    assert sent == [(frame, 4 * frame) for frame in range(10)]  # in 20 ms slots


def test_a_late_frame_leaves_no_standing_delay():
    """Three frames at once (a slow step): the backlog drains, silence skipped first, speech hurried
    by cross-faded cuts, until the queue swings from a frame down to under a packet again."""
    sent = []
    track = AssistantTrack(lambda frame, packet: sent.append((frame, packet)))
    track.play(SILENCE, 0)
    track.play(SILENCE, 1)
    track.play(SPEECH, 2)
    for _ in range(PACKETS):
        tick(track)
    for frame in range(3, 40):
        track.play(SPEECH, frame)
        for _ in range(PACKETS):
            tick(track)
    assert track.skipped_samples > 0 and track.hurried_samples > 0
    lows = []
    for frame in range(40, 44):
        track.play(SPEECH, frame)
        lows.append(min(track._samples for _ in range(PACKETS) if tick(track) is not None))
    assert max(lows) <= BLOCK  # caught up: nothing standing (20 ms, the bound when packets were 20 ms)
    frame, packet = sent[-1]
    assert packet - 4 * (frame - 2) <= 1  # the last frame goes out where it would have with no backlog


def run_track(track: AssistantTrack, packets: int) -> list:
    """`packets` from the track as aiortc's sender takes them (at real-time pace), a frame played as
    the last one's audio is taken, then stopped."""

    async def scenario():
        got = []
        for index in range(packets):
            if index % (FRAME // track.packet) == 0:
                track.play(SPEECH, index * track.packet // FRAME)
            got.append(await track.recv())
        track.stop()
        with pytest.raises(MediaStreamError):
            await track.recv()
        return got

    return asyncio.run(scenario())


@pytest.mark.parametrize("direct", [True, False], ids=["libopus", "pyav"])
def test_the_track_gives_aiortc_40ms_opus_packets_on_the_rtp_clock(direct, monkeypatch):
    if not direct:
        monkeypatch.setattr("server.live.assistant_track.opus.library", lambda: None)
    else:
        assert opus.library() is not None
    sent = []
    track = AssistantTrack(lambda frame, packet: sent.append((frame, packet)))
    assert track.encoded  # aiortc 1.16 packs them as they are
    packets = run_track(track, 6)
    assert all(isinstance(p, av.Packet) for p in packets)
    assert [p.pts for p in packets] == [1920 * i for i in range(6)]  # 48 kHz, whatever was encoded
    assert [OpusEncoder().pack(p)[1] for p in packets] == [1920 * i for i in range(6)]  # aiortc's timestamps
    decoder = av.CodecContext.create("libopus", "r")
    decoder.format, decoder.layout, decoder.sample_rate = "s16", "stereo", 48000
    assert [sum(f.samples for f in decoder.decode(av.Packet(bytes(p)))) for p in packets] == [1920] * 6
    assert sent == [(0, 0), (1, 4), (2, 8)]  # each frame's 20 ms slot, as the bench's client counts them


def test_where_aiortc_does_not_pack_the_track_gives_20ms_frames_at_48khz(monkeypatch):
    monkeypatch.setattr("server.live.assistant_track.sends_opus_packets", lambda: False)
    sent = []
    track = AssistantTrack(lambda frame, packet: sent.append((frame, packet)))
    frames = run_track(track, 8)
    assert all(isinstance(f, av.AudioFrame) and f.sample_rate == 48000 and f.samples == 960 for f in frames)
    assert [f.pts for f in frames] == [960 * i for i in range(8)]
    assert sent == [(0, 0), (1, 4)]


def test_a_frame_goes_out_as_it_comes_not_at_the_schedules_next_tick():
    """The track's schedule and the engine's frames have phases of their own: a frame played just
    after a packet of silence went goes out at once, not 40 ms later, and the packets after it keep
    the packet time from there (the schedule takes the frames' phase)."""
    track = AssistantTrack()

    async def scenario():
        await track.recv()  # the schedule starts: silence, nothing played yet
        played = time.monotonic()
        track.play(SPEECH, 0)
        first = await track.recv()
        came = time.monotonic() - played
        second = await track.recv()
        spaced = time.monotonic() - played - came
        track.stop()
        return came, spaced, first, second

    came, spaced, first, second = asyncio.run(scenario())
    assert came < 0.25 * PTIME_SAMPLES / 24000, came  # its time was 20 ms on (silence waits GRACE_S)
    assert spaced > 0.75 * PTIME_SAMPLES / 24000, spaced  # no burst: a packet's time apart
    assert (first.pts, second.pts) == (1920, 3840)  # the RTP timeline stays whole


def pace_by_hand(arrivals: list[float], start: float) -> list[tuple[float, object, list[int]]]:
    """On a manual clock: a track whose schedule starts at `start`, served as the pacer serves it (at the
    times it asks for, and when poked by a frame played), frame k played at arrivals[k]; (when, packet,
    the frames that begin in it) for each packet made."""
    track, out = AssistantTrack(lambda frame, slot: None), []  # (frames are followed where someone asks)
    track._encode = Raw
    clock = track._start = start
    track._deliver = lambda item: out.append((clock, *item)) or True
    wake = track._service(clock)
    for frame, at in enumerate(arrivals):
        while wake <= at:  # the pacer's wake-ups before the frame comes
            clock = wake
            wake = track._service(clock)
        track.play(SPEECH, frame)  # the poke: the pacer looks at once
        clock = at
        wake = track._service(clock)
    while wake <= arrivals[-1] + 0.1:
        clock = wake
        wake = track._service(clock)
    return out


def spacing_ms(out: list[tuple[float, object, list[int]]]) -> list[float]:
    """The times between `pace_by_hand`'s packets of speech, in ms."""
    times = [at for at, packet, _ in out if np.abs(packet.pcm).max() > 0]
    return [round(1000 * (b - a), 1) for a, b in zip(times, times[1:], strict=False)]


def first_packets(out: list[tuple[float, object, list[int]]]) -> dict[int, float]:
    """When each frame's first packet went, by frame."""
    return {frame: at for at, _, started in out for frame in started}


def test_frames_that_come_early_go_out_on_the_schedule_not_with_the_engines_jitter():
    """After the first frame sets the schedule's phase, frames that keep coming up to 8 ms early (an
    engine's step-to-step jitter) go out on the schedule, a packet time apart, with their RTP timestamps:
    the listener's jitter buffer is not handed the jitter (docs/benchmarks-history.md, "three trials that did
    not land": sending each frame as it came shortened the bench's round trip by what the listener would then hold)."""
    base = time.monotonic() + 1000.0  # ahead of the real clock, which the track reads beside `now`
    arrivals = [base + 0.025 + 0.080 * k - early for k, early in enumerate([0, 0.006, 0.003, 0.008, 0.002, 0.005])]
    out = pace_by_hand(arrivals, base)
    speech = [(at, packet) for at, packet, _ in out if np.abs(packet.pcm).max() > 0]
    assert len(speech) == 12 and all(len(packet.pcm) == PTIME_SAMPLES for _, packet in speech)
    assert speech[0][0] == arrivals[0]  # the first frame, after a silent packet, goes as it comes
    times = [1000 * (at - arrivals[0]) for at, _ in speech]
    # then the schedule, whatever the frames' jitter (but for SLACK_S: the pacer sends a packet that early
    # with other tracks' due)
    assert all(-1000 * SLACK_S - 1e-6 <= at - 40.0 * i <= 1e-6 for i, at in enumerate(times)), times
    assert [packet.pts - speech[0][1].pts for _, packet in speech] == [1920 * i for i in range(12)]


def test_a_track_that_never_runs_dry_moves_its_schedule_to_the_frames():
    """Frames that keep coming 25 ms (+-2) before the schedule's ticks, the track never without audio
    (its first packet was timed by the peer's connecting, not by a frame): after PHASE_WINDOW packets
    the schedule moves earlier, once, to leave the latest frame PHASE_MARGIN_S; the packets stay a packet
    time apart but for that one."""
    base = time.monotonic() + 1000.0
    jitter = [0.0, 0.002, -0.002, 0.001, -0.001]
    arrivals = [base] + [base + 0.080 * k - 0.025 + jitter[k % 5] for k in range(1, 50)]
    out = pace_by_hand(arrivals, base)
    firsts = first_packets(out)
    waited = [round(1000 * (firsts[k] - at), 1) for k, at in enumerate(arrivals)]
    assert all(23 <= w <= 27 for w in waited[1:25]), waited  # held until the schedule's tick
    assert all(1000 * (PHASE_MARGIN_S - SLACK_S) - 0.1 <= w <= 7.1 for w in waited[30:]), waited  # then not
    spacing = spacing_ms(out)
    assert len([gap for gap in spacing if gap != 40.0]) == 1, spacing  # the one move
    assert sum(40.0 - gap for gap in spacing) == pytest.approx(1000 * (0.023 - PHASE_MARGIN_S), abs=0.01)


def test_a_first_frame_in_its_packets_grace_sets_the_phase_later():
    """After silence, a first frame that comes 10 ms past a tick (its packet waiting in the grace) sets
    the schedule's phase, later: the frames after it go a packet time apart (kept at the old phase,
    each frame's first packet waited in the grace and the spacing alternated 30 / 50 ms)."""
    base = time.monotonic() + 1000.0
    arrivals = [base + 0.130 + 0.080 * k for k in range(10)]  # the ticks at base + 40 ms n
    out = pace_by_hand(arrivals, base)
    assert first_packets(out)[0] == arrivals[0]
    assert spacing_ms(out) == [40.0] * 19


def test_a_schedule_moves_later_when_the_frames_phase_does():
    """Frames 25 ms early move a schedule that never runs dry earlier (above); when the engine's phase
    then moves 6 ms later (longer steps as sessions join), PHASE_LATE_SHARE of a window's packets late
    move it later, once: the packets go a packet time apart again, not alternately early and late."""
    base = time.monotonic() + 1000.0
    arrivals = [base] + [base + 0.080 * k - 0.025 + 0.006 * (k >= 40) for k in range(1, 120)]
    out = pace_by_hand(arrivals, base)
    spacing = spacing_ms(out)
    assert spacing[-60:] == [40.0] * 60, spacing
    firsts = first_packets(out)
    assert all(round(1000 * (firsts[k] - arrivals[k]), 1) == 1000 * PHASE_MARGIN_S for k in range(90, 120))


def test_the_bench_microphone_sends_the_packets_the_answer_asks_for():
    """The load bench's client stands for a browser: packets as long as the server's a=ptime, decoded
    by FFmpeg (the peer's decoder) to that length, stamped on the 48 kHz RTP clock."""
    from client.live_client import _Microphone

    async def scenario(ptime_ms: int) -> list:
        microphone = _Microphone()
        microphone.ptime_ms = ptime_ms
        microphone.say(SPEECH)
        microphone.say(SPEECH)
        microphone.end()
        got = []
        with pytest.raises(MediaStreamError):
            while True:
                got.append(await microphone.recv())
        return got

    for ptime_ms in (20, 40):
        packets = asyncio.run(scenario(ptime_ms))
        assert len(packets) == 160 // ptime_ms and all(isinstance(p, av.Packet) for p in packets)
        assert [p.pts for p in packets] == [48 * ptime_ms * i for i in range(len(packets))]
        ffmpeg = av.CodecContext.create("libopus", "r")
        ffmpeg.format, ffmpeg.layout, ffmpeg.sample_rate = "s16", "mono", 48000
        assert {sum(f.samples for f in ffmpeg.decode(av.Packet(bytes(p)))) for p in packets} == {48 * ptime_ms}


def test_the_assistants_digital_silence_goes_out_as_empty_frames_past_its_first_packet():
    """The silence gate's zeros are encoded once, then sent as Opus's empty frames (DTX), which the
    peer's decoder (FFmpeg's) takes as 40 ms of silence each; speech after them is encoded again."""
    encode = _quiet_after_silence(_opus_encoder(5))
    speech = (0.3 * np.sin(2 * np.pi * 440 * np.arange(PTIME_SAMPLES) / 24000) * 32767).astype(np.int16)
    silence = np.zeros(PTIME_SAMPLES, np.int16)
    packets = [bytes(encode(pcm)) for pcm in [speech] * 3 + [silence] * 5 + [speech] * 3]
    assert len(packets[3]) > 3  # the first packet of silence is encoded: the encoder has heard it
    assert packets[4:8] == [packets[4]] * 4 and len(packets[4]) <= 2  # the rest: empty frames, not encoded
    assert all(len(p) > 3 for p in packets[8:])  # speech again: encoded again
    ffmpeg = av.CodecContext.create("libopus", "r")
    ffmpeg.format, ffmpeg.layout, ffmpeg.sample_rate = "s16", "mono", 48000
    decoded = [np.concatenate([f.to_ndarray().reshape(-1) for f in ffmpeg.decode(av.Packet(p))]) for p in packets]
    assert [len(d) for d in decoded] == [1920] * 11  # every packet 40 ms, the empty ones too
    assert max(np.abs(d).max() for d in decoded[5:8]) < 40  # silence (of 32767)
    assert np.abs(decoded[-1]).max() > 5000  # and the speech after it


@pytest.mark.parametrize(("toc", "frame_ms"), [(13 << 3, 20), (2 << 3, 40), (31 << 3, 20), (18 << 3, 10),
                                               (16 << 3, 2.5), (3 << 3, 60)])
def test_empty_frames_last_as_long_as_asked_in_the_tocs_mode(toc, frame_ms):
    decoder = opus.Decoder(48000)
    for ms in (20, 40, 60, 120):
        if ms % frame_ms:
            with pytest.raises(ValueError):
                empty_frames(toc, ms)
            continue
        packet = empty_frames(toc, ms)
        assert packet[0] >> 3 == toc >> 3 and len(packet) <= 2
        assert len(decoder.decode(packet)) == 48 * ms, (toc >> 3, ms)  # libopus reads it as that long


def test_a_track_that_fails_ends_alone_and_its_pacer_goes_on_with_the_others(monkeypatch):
    pacer = _Pacer("opus-out-test")
    monkeypatch.setattr("server.live.assistant_track._pacer", lambda: pacer)
    good, bad = AssistantTrack(), AssistantTrack()

    def broken(now: float) -> float:
        raise RuntimeError("a bug in one track")

    bad._service = broken

    async def scenario():
        got = [await asyncio.wait_for(good.recv(), 5)]
        with pytest.raises(MediaStreamError):
            await asyncio.wait_for(bad.recv(), 5)  # ended, not waiting for ever
        good.play(SPEECH, 0)
        got += [await asyncio.wait_for(good.recv(), 5) for _ in range(3)]
        good.stop()
        with pytest.raises(MediaStreamError):
            await good.recv()
        return got

    got = asyncio.run(scenario())
    assert good._pacer is bad._pacer is pacer
    assert len(got) == 4 and all(isinstance(p, av.Packet) for p in got)
    assert [p.pts for p in got] == [1920 * i for i in range(4)]


def test_a_late_burst_after_its_gap_was_given_up_is_no_restart():
    """Twelve delayed packets arriving together after the gate gave their gap up are late ones, known as such:
    dropped, not taken for a stream that went back (which would play them out of order, then lose the present)."""
    gate = ReorderGate()
    released(gate, *range(100))
    assert released(gate, *range(112, 131))[0] == (12, 112)
    assert released(gate, *range(100, 112)) == []
    assert released(gate, 131) == [(0, 131)] and gate.late == 12
