"""Lean GPT-Live clients of `/v1/live/sessions` for the load benchmark: the WebSocket (PCM16 in JSON
events) and WebRTC (an aiortc peer: Opus on an RTP track, events on `oai-events`). Neither parses
events with the openai SDK, whose pydantic model per event would be measured instead of the server.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fractions
import itertools
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import av
import numpy as np
import websockets
from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from client.client import ServerRefused, opening
from kame import opus
from kame.audio import SAMPLE_RATE
from kame.pcm import Resampler, pcm16_decode, pcm16_encode
from kame.rtc import OpusInput, ptime, receive_opus, send_cheaply, sends_opus_packets

LIVE_PATH = "/v1/live/sessions"
# client delegation: KAME calls no LLM (as /api/chat without ASR calls none: it has no transcript)
CLIENT_DELEGATION = {"model": "gpt-live-1", "delegation": {"type": "client"}}
WIRE_RATE = 48000  # Opus on the track
PACKET = 960  # 20 ms at 48 kHz: the slot packets are counted in (a 40 ms packet takes two)
PROBE_EVERY = 6  # frames between two questions on where the session's timeline is
FRAME_S = 0.08


def live_url(url: str, scheme: str | None = None) -> str:
    """A server URL (ws://HOST:PORT or any of its paths) as its /v1/live/sessions URL."""
    parts = urlsplit(url)
    return urlunsplit((scheme or parts.scheme, parts.netloc, LIVE_PATH, "", ""))


class LiveAudio:
    """GPT-Live over WebSocket: `session.input_audio.append` in, `session.output_audio.delta` out."""

    def __init__(self, ws) -> None:
        self.ws = ws

    @classmethod
    async def connect(cls, url: str, token: str | None = None, session: dict | None = None) -> LiveAudio:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        with opening(live_url(url)):
            ws = await websockets.connect(live_url(url), additional_headers=headers, max_size=None)
        await ws.send(json.dumps({"type": "session.start", "session": session or CLIENT_DELEGATION}))
        while (event := json.loads(await ws.recv()))["type"] != "session.started":
            if event["type"] == "error":
                await ws.close()
                raise ServerRefused(event["error"]["message"], 503)
        return cls(ws)

    async def send_pcm(self, pcm: np.ndarray) -> None:
        await self.ws.send(json.dumps({"type": "session.input_audio.append",
                                       "audio": base64.b64encode(pcm16_encode(pcm)).decode()}))

    async def audio(self) -> AsyncIterator[tuple[int | None, np.ndarray]]:
        """Each output frame's audio (one delta per 80 ms frame of the front-end, silence included); no
        frame index on the wire: (None, PCM)."""
        async for raw in self.ws:
            event = json.loads(raw)
            if event["type"] == "session.output_audio.delta":
                yield None, pcm16_decode(base64.b64decode(event["delta"]))

    async def close(self) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            await self.ws.send(json.dumps({"type": "session.close"}))
        await self.ws.close()


def client_frames(back: list[tuple[int, float]], probes: list[tuple[int, int]], said: int
                  ) -> tuple[list[tuple[int, float]], int]:
    """The session's frames back, (frame, arrival), as the client's frames they answer, and how many
    could not be matched. `probes`: (the session's timeline in ms, frames the client had said) at
    moments between two frames, the first before the client spoke. The first gives the silence the
    server fed while the connection came up; later ones lag what was said by the audio in flight
    (under a frame on loopback), and a jump of over half a frame
    between two is silence fed because the client's audio lagged. Frames back between two probes
    that agree are matched; after the last probe, or across a jump, they are not (which frame the
    silence came before is unknown)."""
    if not probes:
        return [], 0
    fed, (first_ms, _) = [], probes[0]
    silence, previous = round(first_ms / 80), None
    for ms, n in probes:
        lag = ms / 80 - n
        if previous is not None and lag - previous >= 0.5:
            silence += round(lag - previous)
        fed.append((ms / 80, silence))
        previous = lag
    matched, unmatched = [], 0
    for frame, at in back:
        after = next((i for i, (pushed, _) in enumerate(fed) if pushed > frame), None)
        if after == 0:
            continue  # silence fed before the client spoke
        if after is None or fed[after - 1][1] != fed[after][1]:
            unmatched += frame - fed[-1][1] < said  # not the silence fed after its last frame
            continue
        if 0 <= (mine := frame - fed[after][1]) < said:
            matched.append((mine, at))
    return matched, unmatched


class _Microphone(MediaStreamTrack):
    """The client's track: each 80 ms frame given to `say` goes out at once (the moment the whole frame
    exists, as the WebSocket client sends it) as packets of the length the server's answer asks for
    (a=ptime, `ptime_ms`, as Chromium follows it), encoded here with libopus at 24 kHz; where this
    aiortc cannot send encoded packets or there is no libopus to call, 20 ms frames for aiortc's
    encoder. Nothing between frames."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self.ptime_ms = 20
        self._packets: asyncio.Queue[np.ndarray | None] = asyncio.Queue()
        self._encoder = opus.Encoder(SAMPLE_RATE, 48000, complexity=5) if (
            sends_opus_packets() and opus.library() is not None) else None
        self._upsample = Resampler(SAMPLE_RATE, WIRE_RATE)
        self._pending = np.zeros(0, np.float32)
        self._pts = 0

    def say(self, pcm: np.ndarray) -> None:
        self._pending = np.concatenate([self._pending, pcm.astype(np.float32)])
        size = SAMPLE_RATE * (self.ptime_ms if self._encoder is not None else 20) // 1000
        while len(self._pending) >= size:
            self._packets.put_nowait(self._pending[:size])
            self._pending = self._pending[size:]

    def end(self) -> None:
        self._packets.put_nowait(None)

    async def recv(self) -> av.Packet | av.AudioFrame:
        chunk = await self._packets.get()
        if chunk is None or self.readyState != "live":
            raise MediaStreamError
        if self._encoder is not None:
            media = av.Packet(self._encoder.encode((np.clip(chunk, -1.0, 1.0) * 32767).astype(np.int16)))
        else:
            pcm16 = (np.clip(self._upsample(chunk), -1.0, 1.0) * 32767).astype(np.int16)
            media = av.AudioFrame.from_ndarray(pcm16.reshape(1, -1), format="s16", layout="mono")
            media.sample_rate = WIRE_RATE
        media.pts, media.time_base = self._pts, fractions.Fraction(1, WIRE_RATE)
        self._pts += len(chunk) * WIRE_RATE // SAMPLE_RATE
        return media


class LiveWebRTC:
    """GPT-Live over WebRTC: the offer POSTed to /v1/live/sessions, audio on one Opus track each way.
    `timing`: the server says which RTP packet carried the start of each of the session's frames
    (`kame.output_audio.sent`, asked for with `?kame_timing=1`, as the 20 ms slot of the RTP clock where
    it begins, whatever the packet time; a batch of frames an event) and each packet's arrival is kept, so
    that every frame back is timed exactly (`frames_back`)."""

    def __init__(self, pc: RTCPeerConnection, microphone: _Microphone) -> None:
        self.pc, self.microphone = pc, microphone
        self.channel = None
        self.opus: OpusInput | None = None
        self.started = asyncio.Event()
        self.remote: asyncio.Future = asyncio.get_running_loop().create_future()
        self.said = 0  # frames given to the track
        self.sent: list[tuple[int, int]] = []  # (the session's frame, the slot of the RTP packet its start went in)
        self.arrivals: dict[int, float] = {}  # RTP packet's slot (from the track's first) -> arrival
        self.probes: list[tuple[int, int]] = []  # (the session's timeline ms, frames said when asked)
        self._first_timestamp: int | None = None
        self._asked: dict[str, int] = {}
        self._ids = itertools.count()

    @classmethod
    async def connect(cls, url: str, token: str | None = None, session: dict | None = None,
                      timing: bool = False) -> LiveWebRTC:
        send_cheaply()
        pc, microphone = RTCPeerConnection(RTCConfiguration(iceServers=[])), _Microphone()
        client = cls(pc, microphone)
        client.channel = pc.createDataChannel("oai-events")
        client.channel.on("message", client._on_event)
        pc.on("track", lambda track: client.remote.done() or client.remote.set_result(track))
        pc.addTrack(microphone)
        await pc.setLocalDescription(await pc.createOffer())
        try:
            answer = await asyncio.to_thread(_post_offer, url, token, session or CLIENT_DELEGATION,
                                             pc.localDescription.sdp, timing)
            await pc.setRemoteDescription(RTCSessionDescription(answer, "answer"))
            microphone.ptime_ms = ptime(answer)
            audio = next(t for t in pc.getTransceivers() if t.kind == "audio")
            client.opus = receive_opus(audio, name="bench-opus-in", observe=client._arrived)
            await asyncio.wait_for(client.started.wait(), 30)
        except BaseException:
            await pc.close()
            raise
        return client

    def _arrived(self, packet) -> None:
        if self._first_timestamp is None:
            self._first_timestamp = packet.timestamp
        index = ((packet.timestamp - self._first_timestamp) % (1 << 32)) // PACKET
        self.arrivals.setdefault(index, time.monotonic())

    def _on_event(self, message: str) -> None:
        event = json.loads(message)
        if event["type"] == "session.started":
            self.started.set()
        elif event["type"] == "kame.output_audio.sent":
            # a batch of frames an event; an earlier server's named one frame (`frame`, `packet`)
            pairs = event["frames"] if "frames" in event else [(event["frame"], event["packet"])]
            self.sent.extend((frame, slot) for frame, slot in pairs)
        elif event["type"] == "session.thinking.appended" and event.get("client_event_id") in self._asked:
            self.probes.append((event["start_ms"], self._asked.pop(event["client_event_id"])))

    def probe(self) -> None:
        """Ask where the session's timeline is (an empty `session.thinking.append`: its answer's
        `start_ms`), between two frames."""
        if self.channel.readyState == "open":
            self._asked[event_id := f"probe_{next(self._ids)}"] = self.said
            self.channel.send(json.dumps({"type": "session.thinking.append", "event_id": event_id,
                                          "delegation_id": None, "content": ""}))

    async def send_pcm(self, pcm: np.ndarray) -> None:
        if self.said == 0:
            self.probe()  # the silence fed while the connection came up
        self.microphone.say(pcm)
        self.said += 1
        if self.said % PROBE_EVERY == 0:  # half a frame on: this frame is in, the next not yet sent
            asyncio.get_running_loop().call_later(0.5 * FRAME_S, self.probe)

    async def audio(self) -> AsyncIterator[tuple[int | None, np.ndarray]]:
        """Nothing until the track ends (the frames back are timed at the end: `frames_back`); the
        audio is decoded all the same, as a listener's would be."""
        if self.opus is not None:
            while await self.opus.frames.get() is not None:
                pass
        else:
            track = await self.remote
            with contextlib.suppress(MediaStreamError):
                while True:
                    await track.recv()
        return
        yield

    def frames_back(self) -> tuple[list[tuple[int, float]], int]:
        """(the client's frame, arrival of its first packet) of every frame back that could be matched;
        how many could not."""
        back = [(frame, self.arrivals[packet]) for frame, packet in self.sent if packet in self.arrivals]
        matched, unmatched = client_frames(back, self.probes, self.said)
        first: dict[int, float] = {}
        for frame, at in matched:  # probes off under overload can match two frames back to one said
            first.setdefault(frame, at)
        return sorted(first.items()), unmatched + len(matched) - len(first)

    async def close(self) -> None:
        self.microphone.end()
        if self.opus is not None:
            self.opus.close()
        if self.channel is not None and self.channel.readyState == "open":
            self.channel.send(json.dumps({"type": "session.close"}))
            await asyncio.sleep(0.1)  # the data channel's message out before the connection goes
        await self.pc.close()


def _post_offer(url: str, token: str | None, session: dict, sdp: str, timing: bool = False) -> str:
    """The SDP answer to `sdp`; ServerRefused with the server's status if it says no."""
    body = json.dumps({"session": session, "transport": {"type": "webrtc", "sdp": sdp}}).encode()
    headers = {"content-type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    scheme = "https" if urlsplit(url).scheme == "wss" else "http"
    target = live_url(url, scheme) + ("?kame_timing=1" if timing else "")
    request = urllib.request.Request(target, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return json.loads(reply.read())["transport"]["sdp"]
    except urllib.error.HTTPError as exc:
        raise ServerRefused(exc.read().decode(errors="replace"), exc.code) from exc
