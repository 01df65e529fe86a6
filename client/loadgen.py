"""Load from the client side: many sessions at real-time pace, churn and garbage (soak tests)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field

import numpy as np
from websockets.exceptions import ConnectionClosed

from client.client import AudioMessage, EventMessage, KameClient, ServerRefused, ServerUnreachable, send_paced
from client.phone_client import CARRIERS, PhoneCall
from kame.protocol import FRAME_SIZE as FRAME
from kame.protocol import SAMPLE_RATE as RATE
from kame.protocol import Kind, encode


@dataclass
class SessionReport:
    frames_sent: int = 0
    frames_received: int = 0
    frames_dropped: int = 0  # reported by the server's stats events: skipped to stay live, or a slow reader's
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def real_time_ratio(self) -> float:
        """Audio received per audio sent (1.0: every frame came back)."""
        return self.frames_received / self.frames_sent if self.frames_sent else 0.0

    @property
    def accounted_ratio(self) -> float:
        """Audio received or reported dropped per audio sent (1.0: no frame lost without a word)."""
        return (self.frames_received + self.frames_dropped) / self.frames_sent if self.frames_sent else 0.0


async def _settle(done, timeout_s: float) -> None:
    """Poll `done()` every 50 ms (state another task's reader updates) for at most `timeout_s`."""
    for _ in range(int(timeout_s / 0.05)):
        if done():
            return
        await asyncio.sleep(0.05)


async def good_session(url: str, speech: np.ndarray, seconds: float, report: SessionReport) -> None:
    """Speak `speech` in a loop (with pauses) at real-time pace for `seconds`, counting audio back and
    the frames the server reports dropping (its stats events, once a second)."""
    client = await KameClient.connect(url, events=True)
    received = dropped = 0

    async def receive() -> None:
        nonlocal received, dropped
        async for message in client:
            if isinstance(message, AudioMessage):
                received += len(message.pcm)
            elif isinstance(message, EventMessage) and message.event.type == "stats":
                dropped = message.event.frames_dropped

    task = asyncio.create_task(receive())
    loop_audio = np.concatenate([speech, np.zeros(RATE * 2, np.float32)])
    started = time.monotonic()
    index = 0
    try:
        while time.monotonic() - started < seconds:
            start = (index * FRAME) % (len(loop_audio) - FRAME)
            await client.send_pcm(loop_audio[start:start + FRAME])
            index += 1
            delay = started + index * FRAME / RATE - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        # the last frames' audio, and a stats event counting any drop among them (at most 2 s)
        await _settle(lambda: received // FRAME + dropped >= index - 2, 2.0)
        await asyncio.sleep(0.5)
    except ConnectionClosed as exc:
        report.errors.append(f"closed by the server: {exc}")
    finally:
        report.frames_sent += index
        report.seconds += time.monotonic() - started
        await client.close()
        await task
        report.frames_received += received // FRAME
        report.frames_dropped += dropped


async def garbage_client(url: str, seconds: float, rng: random.Random) -> int:
    """Connect, send random junk of every kind, disconnect abruptly, repeat. Returns connections made."""
    made, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            client = await KameClient.connect(url, events=rng.random() < 0.5)
        except (ServerRefused, ServerUnreachable):
            await asyncio.sleep(0.2)
            continue
        made += 1
        try:
            for _ in range(rng.randrange(1, 30)):
                kind = rng.choice([0, 1, 2, 3, 5, 7, 8, 9, 42, 255])
                junk = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300)))
                await client.send_raw(encode(Kind(kind), junk) if kind in Kind._value2member_map_ else
                                      bytes([kind]) + junk)
                await asyncio.sleep(rng.random() * 0.05)
        except ConnectionClosed:
            pass
        if rng.random() < 0.5:
            client.ws.transport.abort()
        else:
            with contextlib.suppress(Exception):
                await client.close()
    return made


async def churn_client(url: str, speech: np.ndarray, seconds: float, rng: random.Random) -> int:
    """Sessions that talk briefly and vanish mid-utterance. Returns sessions made."""
    made, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            client = await KameClient.connect(url)
        except (ServerRefused, ServerUnreachable):
            await asyncio.sleep(0.2)
            continue
        made += 1
        frames = rng.randrange(3, 40)
        with contextlib.suppress(ConnectionClosed):
            for index in range(frames):
                start = (index * FRAME) % (len(speech) - FRAME)
                await client.send_pcm(speech[start:start + FRAME])
                await asyncio.sleep(FRAME / RATE)
        client.ws.transport.abort()
        await asyncio.sleep(rng.random() * 0.5)
    return made


async def soak(url: str, speech: np.ndarray, seconds: float, good: int = 2, seed: int = 0) -> dict:
    """Good sessions, one garbage client and one churning client, all for `seconds`."""
    rng = random.Random(seed)
    reports = [SessionReport() for _ in range(good)]
    results = await asyncio.gather(
        *(good_session(url, speech, seconds, r) for r in reports),
        garbage_client(url, seconds, rng), churn_client(url, speech, seconds, rng))
    return {"good": reports, "garbage_connections": results[good], "churn_sessions": results[good + 1]}


# ----------------------------------------------------------------------------- load benchmark


@dataclass
class LatencyRun:
    """One load level: every session's frame round trips (seconds), client side."""

    sessions: int
    seconds: float
    round_trips: list[float] = field(default_factory=list)
    frames_sent: int = 0
    frames_received: int = 0
    refused: int = 0
    frames_dropped: int = 0  # Moshi's transport: the drops its stats events reported (others: not counted)
    frames_unmatched: int = 0  # back, but after a drop the server had not yet counted: not timed
    leads: list[float] = field(default_factory=list)  # phone calls: the carrier's playout lead (s) at each arrival
    rtp_jitter_ms: list[float] = field(default_factory=list)  # SIP calls: each RTP packet's arrival off its 20 ms beat


# the Realtime endpoint sends audio only while the model speaks; with audio energy counted as speech,
# a front-end that makes noise (tiny-copy, random weights) speaks in every frame once its audio is ready.
# No silence fed after the last frame; kame events on, so that each delta names its frame.
REALTIME_LOAD_SESSION = {"kame": {"activity": "text+audio", "feed_silence": False, "events": True}}


async def _connect(url: str, transport: str):
    """A timed session's client: moshi (/api/chat), realtime (/v1/realtime), live or live-webrtc
    (/v1/live/sessions, client delegation), or a carrier's media stream (/twilio/media, ...: a call).
    Each imports its own client: the moshi one needs no aiortc."""
    if transport in CARRIERS:
        return await PhoneCall.connect(url, transport)
    if transport == "sip":  # url: sip://HOST:PORT
        from client.sip_phone import SipPhone

        return await SipPhone.connect(url)
    if transport == "realtime":
        from client.realtime_client import RealtimeAudio

        return await RealtimeAudio.connect(url, session=REALTIME_LOAD_SESSION)
    if transport == "live":
        from client.live_client import LiveAudio

        return await LiveAudio.connect(url)
    if transport == "live-webrtc":
        from client.live_client import LiveWebRTC

        return await LiveWebRTC.connect(url, timing=True)
    return await KameClient.connect(url, events=True)  # events: the stats events' count of dropped frames


async def _timed_session(url: str, seconds: float, run: LatencyRun, rng: random.Random,
                         transport: str = "moshi", speech: np.ndarray | None = None) -> None:
    try:
        client = await _connect(url, transport)
    except ServerRefused:
        run.refused += 1
        return
    sent_at: list[float] = []
    received_at: list[tuple[int, float]] = []  # (frame index, arrival time)

    matcher = _MoshiFrames(received_at)

    async def receive() -> None:
        with contextlib.suppress(ConnectionClosed):
            if transport != "moshi":
                async for frame, pcm in client.audio():
                    if frame is not None:  # the Realtime endpoint and the WebRTC track's pairing name it
                        received_at.append((frame, time.monotonic()))
                    else:  # GPT-Live's deltas: one per frame, in order
                        matcher.audio(len(pcm))
                return
            async for message in client:
                if isinstance(message, AudioMessage):
                    matcher.audio(len(message.pcm))
                elif isinstance(message, EventMessage) and message.event.type == "stats":
                    matcher.dropped(message.event.frames_dropped)

    task = asyncio.create_task(receive())
    await asyncio.sleep(rng.random() * FRAME / RATE)  # sessions do not start in lockstep
    noise = (np.random.default_rng(rng.randrange(1 << 30)).standard_normal(FRAME) * 0.05).astype(np.float32)
    frames = int(seconds * RATE / FRAME)
    if speech is not None:  # the speech and a 1 s pause (a turn's end), looped, each session from its own point
        turn = np.concatenate([speech, np.zeros(RATE, np.float32)])
        audio = np.resize(np.roll(turn, -rng.randrange(len(turn))), frames * FRAME)
    else:
        audio = np.tile(noise, frames)

    async def send(frame: np.ndarray) -> None:
        sent_at.append(time.monotonic())
        await client.send_pcm(frame)

    with contextlib.suppress(ConnectionClosed):
        await send_paced(send, audio)
        await asyncio.sleep(0.5)
        if transport == "moshi":  # a drop among the last frames is told by the next stats event (1 s)
            await _settle(lambda: matcher.back + matcher.offset >= len(sent_at) - 2, 1.5)
    await client.close()
    await task
    matcher.end()
    if transport == "live-webrtc":  # the track's frames, matched once the session's timeline is known
        back, untimed = client.frames_back()
        received_at.extend(back)
        matcher.unmatched += untimed
    # each frame back answers the frame sent it names (the Realtime endpoint does not send the first
    # ones, before the model's audio is ready and its speech opens a response)
    trips = [at - sent_at[frame] for frame, at in received_at if frame < len(sent_at)]
    run.frames_sent += len(sent_at)
    # frames back past the last sent: silence GPT-Live's server fed once the client stopped
    run.frames_received += sum(frame < len(sent_at) for frame, _ in received_at) + matcher.unmatched
    run.frames_unmatched += matcher.unmatched
    run.frames_dropped += matcher.offset
    if isinstance(client, PhoneCall):
        run.leads.extend(client.leads)
    if transport == "sip":
        run.rtp_jitter_ms.extend(client.send_jitter_ms())
    run.round_trips.extend(trips[3:])  # the first frames carry the connection's warm-up


class _MoshiFrames:
    """Which frame sent each frame of Moshi's audio answers. Frame k back answers frame k sent, but
    for the frames the server dropped before it (skipped to stay live, or output dropped for a slow
    reader), which its stats events count once a second. Frames back since the last stats event
    wait there: if the next one counts new drops, which of them it shifts is unknown, so they are
    left out (`unmatched`) rather than timed against the wrong frame, 80 ms per drop off."""

    def __init__(self, into: list[tuple[int, float]]) -> None:
        self.into, self.samples, self.back, self.offset, self.unmatched = into, 0, 0, 0, 0
        self.pending: list[tuple[int, float]] = []

    def audio(self, samples: int) -> None:
        self.samples += samples
        while self.samples >= FRAME * (self.back + 1):
            self.pending.append((self.back + self.offset, time.monotonic()))
            self.back += 1

    def dropped(self, count: int) -> None:
        if count == self.offset:
            self.into.extend(self.pending)
        else:
            self.unmatched += len(self.pending)
            self.offset = count
        self.pending = []

    def end(self) -> None:
        self.into.extend(self.pending)  # no drop counted after them: none seen, at least
        self.pending = []


async def load_level(url: str, sessions: int, seconds: float, seed: int = 0, transport: str = "moshi",
                     speech: np.ndarray | None = None) -> LatencyRun:
    """`sessions` timed sessions at once, each sending noise (or `speech`, 24 kHz, and a pause, looped) in
    real time."""
    run = LatencyRun(sessions, seconds)
    rng = random.Random(seed)
    await asyncio.gather(*(_timed_session(url, seconds, run, random.Random(rng.random()), transport, speech)
                           for _ in range(sessions)))
    return run


def load_level_timed(url: str, sessions: int, seconds: float, seed: int = 0, transport: str = "moshi",
                     speech: np.ndarray | None = None) -> tuple[LatencyRun, float]:
    """`load_level` run to its end in this process (or a load generator child's share of a level), and
    the CPU seconds it took."""
    cpu = time.process_time()
    run = asyncio.run(load_level(url, sessions, seconds, seed, transport, speech))
    return run, time.process_time() - cpu


def load_level_in_processes(url: str, sessions: int, seconds: float, processes: int, transport: str = "moshi",
                            speech: np.ndarray | None = None) -> tuple[LatencyRun, float]:
    """A level's sessions spread over `processes` load generators (each session's Opus encoding holds its
    process' GIL for ~1 ms a frame, so one process cannot carry many): their runs merged, and their CPU
    seconds summed."""
    import concurrent.futures
    import multiprocessing

    shares = [sessions // processes + (i < sessions % processes) for i in range(processes)]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(len(shares), mp_context=context) as pool:
        parts = list(pool.map(load_level_timed, *zip(*[(url, n, seconds, i, transport, speech)
                                                  for i, n in enumerate(shares) if n], strict=True)))
    merged = LatencyRun(sessions, seconds)
    for run, _ in parts:
        merged.round_trips.extend(run.round_trips)
        merged.frames_sent += run.frames_sent
        merged.frames_received += run.frames_received
        merged.refused += run.refused
        merged.frames_unmatched += run.frames_unmatched
        merged.leads.extend(run.leads)
        merged.rtp_jitter_ms.extend(run.rtp_jitter_ms)
    return merged, sum(cpu for _, cpu in parts)


def percentile_ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 2) if values else None
