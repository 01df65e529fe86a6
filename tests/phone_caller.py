"""A carrier's side of a phone call, for the tests (there is no local Twilio): it streams speech to the
server as a carrier does (the line's audio in 20 ms frames at real time, silence between words), plays
what comes back in a simulated playout buffer, acknowledges each mark once the audio before it has
played, drops the buffer on a clear (sending back the marks it held), presses keys and hangs up. It
records what a test checks: the lead it held (audio buffered, not yet played) over time, when each clear
came, and what it heard.

A carrier's own messages are a `Wire` (Twilio's here, written from Twilio's "Media Streams - WebSocket
Messages" reference; Telnyx's and Vonage's go beside it); the call, the playout and the timing are the
same for every carrier. The line's audio is coded here with Python's own G.711 (audioop) and soxr's
resampler, not the server's code, so a test does not take the code under test as its reference.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import contextlib
import json
import time
import uuid
import warnings
import wave
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
import soxr
import websockets

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop  # the reference G.711 coder (in the standard library up to 3.12)

FRAME_S = 0.02  # a carrier sends the caller's audio 20 ms at a time
Message = str | bytes


# -------------------------------------------------------------------- the line's audio


@dataclass(frozen=True)
class LineFormat:
    encoding: Literal["pcmu", "pcma", "pcm16"]  # G.711 mu-law or A-law, or 16-bit little-endian PCM
    rate: int

    @property
    def sample_bytes(self) -> int:
        return 2 if self.encoding == "pcm16" else 1

    @property
    def frame_bytes(self) -> int:
        return round(self.rate * FRAME_S) * self.sample_bytes

    def seconds(self, data: bytes) -> float:
        return len(data) / self.sample_bytes / self.rate

    def encode(self, pcm: np.ndarray) -> bytes:
        """float32 at the line's rate -> the line's bytes."""
        linear = (np.clip(pcm, -1.0, 1.0) * 32767).astype("<i2").tobytes()
        return {"pcmu": lambda: audioop.lin2ulaw(linear, 2), "pcma": lambda: audioop.lin2alaw(linear, 2),
                "pcm16": lambda: linear}[self.encoding]()

    def decode(self, data: bytes) -> np.ndarray:
        linear = {"pcmu": lambda: audioop.ulaw2lin(data, 2), "pcma": lambda: audioop.alaw2lin(data, 2),
                  "pcm16": lambda: data}[self.encoding]()
        return np.frombuffer(linear, "<i2").astype(np.float32) / 32768

    def from_pcm(self, pcm: np.ndarray, rate: int) -> bytes:
        """Speech at any rate, as the line carries it."""
        return self.encode(soxr.resample(pcm.astype(np.float32), rate, self.rate).astype(np.float32))


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """A 16-bit WAV file as mono float32, and its rate."""
    with wave.open(str(path)) as wav:
        assert wav.getsampwidth() == 2, f"{path}: 16-bit PCM expected"
        data = np.frombuffer(wav.readframes(wav.getnframes()), "<i2").astype(np.float32) / 32768
        return data.reshape(-1, wav.getnchannels()).mean(axis=1), wav.getframerate()


# -------------------------------------------------------------------- a carrier's messages


@dataclass(frozen=True)
class Audio:
    data: bytes  # the assistant's audio, in the line's format


@dataclass(frozen=True)
class MarkAsked:
    name: str  # to send back once the audio before it has played (or a clear dropped it)


@dataclass(frozen=True)
class Cleared:
    """Drop the audio not yet played."""


ServerSaid = Audio | MarkAsked | Cleared


class Wire(Protocol):
    """One carrier's messages, both ways; the caller keeps the time, the wire only says things."""

    name: str
    format: LineFormat

    def opening(self, parameters: dict[str, str]) -> list[Message]:
        """What the carrier sends once the socket is open (the call's start, with the application's parameters)."""

    def media(self, data: bytes) -> list[Message]:
        """One frame of the caller's audio."""

    def dtmf(self, digit: str) -> list[Message]: ...

    def marked(self, name: str) -> list[Message]:
        """A mark coming back: its audio has played, or a clear dropped it."""

    def stop(self) -> list[Message]:
        """The caller hung up."""

    def read(self, message: Message) -> list[ServerSaid]:
        """A message from the server; AssertionError for one the carrier would not accept."""


class TwilioWire:
    """Twilio Media Streams, bidirectional: JSON text frames, mu-law 8 kHz; every message from Twilio
    but `connected` carries a `sequenceNumber` and the `streamSid`, and the server's must name the stream."""

    name = "twilio"
    format = LineFormat("pcmu", 8000)

    def __init__(self, call_sid: str | None = None) -> None:
        self.call_sid = call_sid or "CA" + uuid.uuid4().hex
        self.account_sid = "AC" + uuid.uuid4().hex
        self.stream_sid = "MZ" + uuid.uuid4().hex
        self._sequence = 0
        self._chunk = 0

    def _say(self, event: str, **body) -> str:
        self._sequence += 1
        return json.dumps({"event": event, "sequenceNumber": str(self._sequence), **body, "streamSid": self.stream_sid})

    def opening(self, parameters: dict[str, str]) -> list[Message]:
        connected = json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        return [connected, self._say("start", start={
            "accountSid": self.account_sid, "streamSid": self.stream_sid, "callSid": self.call_sid,
            "tracks": ["inbound", "outbound"], "customParameters": parameters,
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}})]

    def media(self, data: bytes) -> list[Message]:
        self._chunk += 1  # chunks count from 1; the timestamp is the stream's time in ms
        return [self._say("media", media={"track": "inbound", "chunk": str(self._chunk),
                                          "timestamp": str(round((self._chunk - 1) * FRAME_S * 1000)),
                                          "payload": base64.b64encode(data).decode()})]

    def dtmf(self, digit: str) -> list[Message]:
        return [self._say("dtmf", dtmf={"track": "inbound_track", "digit": digit})]

    def marked(self, name: str) -> list[Message]:
        return [self._say("mark", mark={"name": name})]

    def stop(self) -> list[Message]:
        return [self._say("stop", stop={"accountSid": self.account_sid, "callSid": self.call_sid})]

    def read(self, message: Message) -> list[ServerSaid]:
        assert isinstance(message, str), "Twilio takes text frames only (a binary frame is error 31950)"
        data = json.loads(message)
        assert data.get("streamSid") == self.stream_sid, f"a message for another stream: {message[:120]}"
        match data.get("event"):
            case "media":
                try:
                    return [Audio(base64.b64decode(data["media"]["payload"], validate=True))]
                except (binascii.Error, KeyError, TypeError) as exc:
                    raise AssertionError(f"a media message without base64 media.payload: {message[:120]}") from exc
            case "mark":
                name = data.get("mark", {}).get("name")
                assert isinstance(name, str), f"a mark without mark.name: {message[:120]}"
                return [MarkAsked(name)]
            case "clear":
                return [Cleared()]
        raise AssertionError(f"Twilio takes media, mark and clear; the server sent {message[:120]}")


# -------------------------------------------------------------------- the playout buffer


class Playout:
    """The carrier's playback of the server's audio: what arrives plays back to back from when it arrives
    (or from when the audio before it ends); a mark is due once the audio sent before it has played; a
    clear drops what has not played and hands back every mark still pending. Pure: the time comes in."""

    def __init__(self, line: LineFormat) -> None:
        self.line = line
        self._end = 0.0  # when everything queued will have played
        self._chunks: list[tuple[float, bytes]] = []  # (when it starts playing, audio), played or queued
        self._marks: collections.deque[tuple[float, str]] = collections.deque()  # (due, name)

    def push(self, data: bytes, now: float) -> None:
        start = max(now, self._end)
        self._chunks.append((start, data))
        self._end = start + self.line.seconds(data)

    def mark(self, name: str, now: float) -> None:
        self._marks.append((max(now, self._end), name))

    def lead(self, now: float) -> float:
        """Audio queued and not yet played, in seconds."""
        return max(0.0, self._end - now)

    def next_due(self) -> float | None:
        return self._marks[0][0] if self._marks else None

    def due(self, now: float) -> list[str]:
        names = []
        while self._marks and self._marks[0][0] <= now:
            names.append(self._marks.popleft()[1])
        return names

    def clear(self, now: float) -> list[str]:
        self._chunks = [(start, self._played(start, data, now)) for start, data in self._chunks if start < now]
        self._end = min(self._end, now)
        names = [name for _, name in self._marks]
        self._marks.clear()
        return names

    def playing(self, t0: float, t1: float) -> np.ndarray:
        """What the loudspeaker played from `t0` to `t1` (silence between chunks), at the line's rate."""
        rate = self.line.rate
        out = np.zeros(max(0, round((t1 - t0) * rate)), np.float32)
        for start, data in reversed(self._chunks):  # in time order: the newest first, until they are too old
            end = start + self.line.seconds(data)
            if end <= t0 - 1.0:
                break
            if end <= t0 or start >= t1:
                continue
            pcm = self.line.decode(data)
            skip, at = max(0, round((t0 - start) * rate)), max(0, round((start - t0) * rate))
            count = min(len(out) - at, len(pcm) - skip)
            if count > 0:
                out[at:at + count] += pcm[skip:skip + count]
        return out

    def heard(self, now: float) -> bytes:
        """The audio played by `now`."""
        return b"".join(self._played(start, data, now) for start, data in self._chunks if start < now)

    def _played(self, start: float, data: bytes, now: float) -> bytes:
        samples = int((now - start) * self.line.rate + 1e-9)
        return data[:max(0, samples) * self.line.sample_bytes]


# -------------------------------------------------------------------- the call


class Caller:
    """One call on an open socket: the caller's audio goes up every 20 ms (speech from `say`, else
    silence), the server's audio plays in a `Playout`, marks go back as their audio plays. Use
    `async with Caller.dial(url, wire, parameters) as caller:`."""

    def __init__(self, ws, wire: Wire, echo: tuple[float, float] | None = None) -> None:
        self.ws, self.wire, self.line = ws, wire, wire.format
        self.echo = echo  # (level in dB, delay in s) of the loudspeaker heard back in the mouthpiece; None: none
        self.playout = Playout(self.line)
        self.leads: list[tuple[float, float]] = []  # (time, lead in s) as each frame of the server's audio came
        self.clears: list[float] = []  # when each clear came
        self.marks_back: list[str] = []  # marks sent back, in order
        self.frames_heard = 0  # media messages received
        self.spoken: list[tuple[float, float]] = []  # (start, end) of each `say` on the line
        self.faults: list[str] = []  # what the server sent that the carrier would not take
        self.closed: tuple[int | None, str] | None = None  # the server's close code and reason
        self._speech: collections.deque[bytes] = collections.deque()  # frames to send, before silence
        self._said: collections.deque[tuple[int, int, asyncio.Future]] = collections.deque()  # (first, end, done)
        self._queued = self._sent_speech = 0  # frames of speech queued and sent, ever
        self._said_from = 0.0  # when the `say` going out began
        self._sending = asyncio.Lock()
        self._marks_changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    @classmethod
    @contextlib.asynccontextmanager
    async def dial(cls, url: str, wire: Wire, parameters: dict[str, str] | None = None, greet: bool = True,
                   echo: tuple[float, float] | None = None):
        """Open the stream at `url` (a carrier connects there) and start the call; the caller's audio flows from
        then on. Leaving closes the socket (a dropped line, where the test has not hung up). `greet=False`: no
        opening messages (a test sends its own). `echo`: (dB, s) of what the caller's phone plays coming back
        into its microphone, as a handset's does (-35 dB: a faint one)."""
        async with websockets.connect(url, max_size=None, open_timeout=30) as ws:
            caller = cls(ws, wire, echo)
            if greet:
                for message in wire.opening(parameters or {}):
                    await caller.send(message)
            caller._start()
            try:
                yield caller
            finally:
                await caller.finish()

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        for coro, name in ((self._uplink(), "uplink"), (self._downlink(), "downlink"), (self._acknowledge(), "marks")):
            self._tasks.append(loop.create_task(coro, name=f"caller-{name}"))

    # ---------------------------------------------------------------- what the caller does

    def now(self) -> float:
        return time.monotonic()

    async def send(self, message: Message) -> None:
        async with self._sending:
            with contextlib.suppress(websockets.ConnectionClosed):  # the server hung up: nothing to tell it
                await self.ws.send(message)

    def say(self, pcm: np.ndarray, rate: int) -> asyncio.Future:
        """Speak `pcm` next on the line; the future's result, once its last frame went out: (when its first
        frame went out, when its last did)."""
        data, step, silence = self.line.from_pcm(pcm, rate), self.line.frame_bytes, self._silence()
        frames = [(data[i:i + step] + silence)[:step] for i in range(0, len(data), step)]  # the last one padded
        done = asyncio.get_running_loop().create_future()
        first = self._queued
        self._queued += len(frames)
        self._speech.extend(frames)
        self._said.append((first, self._queued, done))
        return done

    def _silence(self) -> bytes:
        """A frame of silence on the line."""
        return self.line.encode(np.zeros(self.line.frame_bytes // self.line.sample_bytes, np.float32))

    async def press(self, digit: str) -> None:
        for message in self.wire.dtmf(digit):
            await self.send(message)

    async def hang_up(self, timeout_s: float = 10.0) -> tuple[int | None, str]:
        """`stop`, then wait for the server to close the socket: its close code and reason."""
        for message in self.wire.stop():
            await self.send(message)
        async with asyncio.timeout(timeout_s):
            await self.ws.wait_closed()
        await self.finish()
        return self.closed

    async def finish(self) -> None:
        """Stop the caller's tasks (the socket closes with the `dial` block)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.closed is None and self.ws.close_code is not None:
            self.closed = (self.ws.close_code, self.ws.close_reason or "")

    # ---------------------------------------------------------------- what the caller heard

    @property
    def max_lead(self) -> float:
        return max((lead for _, lead in self.leads), default=0.0)

    def heard(self) -> np.ndarray:
        """The assistant's audio that played (what a clear dropped never did), at the line's rate."""
        return self.line.decode(self.playout.heard(self.now()))

    # ---------------------------------------------------------------- the tasks

    async def _uplink(self) -> None:
        """A frame every 20 ms on an absolute schedule, as a carrier sends (a late wake-up sends the frames
        it owes at once)."""
        silence = self._silence()
        start, sent = self.now(), 0
        while True:
            speaking = bool(self._speech)
            frame = self._speech.popleft() if speaking else silence
            if self.echo is not None:
                frame = self._with_echo(frame)
            for message in self.wire.media(frame):
                await self.send(message)
            if speaking:
                self._spoke()
            sent += 1
            await asyncio.sleep(max(0.0, start + sent * FRAME_S - self.now()))

    def _with_echo(self, frame: bytes) -> bytes:
        """The frame as the mouthpiece picks it up: with the loudspeaker's audio of `delay` ago, `level` down."""
        level_db, delay = self.echo
        now = self.now()
        echo = self.playout.playing(now - delay - FRAME_S, now - delay) * 10 ** (level_db / 20)
        pcm = self.line.decode(frame)
        return self.line.encode(np.clip(pcm + echo[:len(pcm)], -1, 1))

    def _spoke(self) -> None:
        """One more frame of speech went out: the `say` it starts or ends is told."""
        now, index = self.now(), self._sent_speech
        self._sent_speech += 1
        first, end, done = self._said[0]
        if index == first:
            self._said_from = now
        if self._sent_speech == end:
            self._said.popleft()
            self.spoken.append((self._said_from, now))
            if not done.done():
                done.set_result((self._said_from, now))

    async def _downlink(self) -> None:
        try:
            async for message in self.ws:
                try:
                    said = self.wire.read(message)
                except (AssertionError, ValueError) as exc:
                    self.faults.append(str(exc))
                    continue
                for event in said:
                    await self._heard(event)
        except websockets.ConnectionClosed:
            pass
        self.closed = (self.ws.close_code, self.ws.close_reason or "")

    async def _heard(self, event: ServerSaid) -> None:
        now = self.now()
        match event:
            case Audio(data=data):
                self.frames_heard += 1
                self.playout.push(data, now)
                self.leads.append((now, self.playout.lead(now)))
            case MarkAsked(name=name):
                self.playout.mark(name, now)
                self._marks_changed.set()
            case Cleared():
                self.clears.append(now)
                await self._mark_back(self.playout.clear(now))

    async def _acknowledge(self) -> None:
        """Each mark back once the audio before it has played."""
        while True:
            self._marks_changed.clear()
            due = self.playout.next_due()
            if due is None:
                await self._marks_changed.wait()
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, due - self.now())):
                    await self._marks_changed.wait()
            await self._mark_back(self.playout.due(self.now()))

    async def _mark_back(self, names: list[str]) -> None:
        for name in names:
            self.marks_back.append(name)
            for message in self.wire.marked(name):
                await self.send(message)


# -------------------------------------------------------------------- Twilio's webhook


def twilio_signature(auth_token: str, url: str, form: dict[str, str]) -> str:
    """X-Twilio-Signature as Twilio computes it (the twilio SDK's validator, not the server's code)."""
    from twilio.request_validator import RequestValidator

    return RequestValidator(auth_token).compute_signature(url, form)


def stream_of(twiml: str) -> tuple[str, dict[str, str]]:
    """The Stream URL of `<Connect><Stream>` TwiML, and its `<Parameter>`s (Twilio's customParameters)."""
    stream = ET.fromstring(twiml).find("./Connect/Stream")
    assert stream is not None, f"no <Connect><Stream> in {twiml}"
    return stream.get("url"), {p.get("name"): p.get("value") for p in stream.findall("Parameter")}
