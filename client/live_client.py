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
import soxr
import websockets
from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from client.client import ServerRefused, opening
from kame.codec import pcm16_decode, pcm16_encode
from kame.protocol import SAMPLE_RATE as RATE

LIVE_PATH = "/v1/live/sessions"
# client delegation: KAME calls no LLM (as /api/chat without ASR calls none: it has no transcript)
CLIENT_DELEGATION = {"model": "gpt-live-1", "delegation": {"type": "client"}}
WIRE_RATE = 48000  # Opus on the track
PACKET = 960  # 20 ms at 48 kHz: one RTP packet
PACKETS_PER_FRAME = 4  # an 80 ms frame
PROBE_EVERY = 6  # frames between two questions on where the session's timeline is
FRAME_S = 0.08
SILENT_PEAK = 1e-3  # a received packet under this peak (of full scale) is silence the server's track filled in


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


class TrackFrames:
    """Which of the session's frames each stretch of the received track answers. The server's track
    plays the front-end's 80 ms frames back to back at 48 kHz and fills silence when none is queued:
    before the first frame with audio (frame `first`, after the model's acoustic delay) and whenever a
    frame comes late (an underrun). So packets with sound are counted from the first one, silent ones
    skipped, and the 4th packet of each group of 4 completes the next frame. Error: about a packet
    (20 ms) either way (the resamplers' and Opus' delays shift the frame edges within packets; an
    underrun that fills part of a packet is counted as sound). The session's frames count the silence
    the server fed while the client's audio lagged (`client_frames` takes it out)."""

    def __init__(self, first: int) -> None:
        self.first, self.sounding = first, 0

    def packet(self, peak: float) -> int | None:
        """A received packet's peak (of full scale): the input frame it completes, if any."""
        if peak < SILENT_PEAK:
            return None
        self.sounding += 1
        if self.sounding % PACKETS_PER_FRAME:
            return None
        return self.first + self.sounding // PACKETS_PER_FRAME - 1


def client_frames(back: list[tuple[int, float]], probes: list[tuple[int, int]], said: int
                  ) -> tuple[list[tuple[int, float]], int]:
    """The session's frames back, (frame, arrival), as the client's frames they answer, and how many
    could not be matched. `probes`: (the session's timeline in ms, frames the client had said) at
    moments between two frames, the first before the client spoke. The first gives the silence the
    server fed while the connection came up; later ones lag what was said by the audio in flight
    (~1.5 frames on loopback: aiortc's receiver holds 4 packets), and a jump of over half a frame
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
    """The client's track: each 80 ms frame given to `say` goes out at once as four 20 ms packets (the
    moment the whole frame exists, as the WebSocket client sends it); nothing between frames."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self._packets: asyncio.Queue[np.ndarray | None] = asyncio.Queue()
        self._upsample = soxr.ResampleStream(RATE, WIRE_RATE, 1, dtype="float32")
        self._pending = np.zeros(0, np.float32)
        self._pts = 0

    def say(self, pcm: np.ndarray) -> None:
        self._pending = np.concatenate([self._pending, self._upsample.resample_chunk(pcm.astype(np.float32))])
        while len(self._pending) >= PACKET:
            self._packets.put_nowait(self._pending[:PACKET])
            self._pending = self._pending[PACKET:]

    def end(self) -> None:
        self._packets.put_nowait(None)

    async def recv(self) -> av.AudioFrame:
        chunk = await self._packets.get()
        if chunk is None or self.readyState != "live":
            raise MediaStreamError
        pcm16 = (np.clip(chunk, -1.0, 1.0) * 32767).astype(np.int16)
        frame = av.AudioFrame.from_ndarray(pcm16.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = WIRE_RATE, self._pts, fractions.Fraction(1, WIRE_RATE)
        self._pts += PACKET
        return frame


class LiveWebRTC:
    """GPT-Live over WebRTC: the offer POSTed to /v1/live/sessions, audio on one Opus track each way."""

    def __init__(self, pc: RTCPeerConnection, microphone: _Microphone, first_frame: int) -> None:
        self.pc, self.microphone, self.first_frame = pc, microphone, first_frame
        self.channel = None
        self.started = asyncio.Event()
        self.remote: asyncio.Future = asyncio.get_running_loop().create_future()
        self.said = 0  # frames given to the track
        self.back: list[tuple[int, float]] = []  # (the session's frame, arrival)
        self.probes: list[tuple[int, int]] = []  # (the session's timeline ms, frames said when asked)
        self._asked: dict[str, int] = {}
        self._ids = itertools.count()

    @classmethod
    async def connect(cls, url: str, token: str | None = None, session: dict | None = None,
                      first_frame: int = 0) -> LiveWebRTC:
        """`first_frame`: the first output frame with sound (the model's acoustic delay; `first_sounding_frame`)."""
        pc, microphone = RTCPeerConnection(RTCConfiguration(iceServers=[])), _Microphone()
        client = cls(pc, microphone, first_frame)
        client.channel = pc.createDataChannel("oai-events")
        client.channel.on("message", client._on_event)
        pc.on("track", lambda track: client.remote.done() or client.remote.set_result(track))
        pc.addTrack(microphone)
        await pc.setLocalDescription(await pc.createOffer())
        try:
            answer = await asyncio.to_thread(_post_offer, url, token, session or CLIENT_DELEGATION,
                                             pc.localDescription.sdp)
            await pc.setRemoteDescription(RTCSessionDescription(answer, "answer"))
            await asyncio.wait_for(client.started.wait(), 30)
        except BaseException:
            await pc.close()
            raise
        return client

    def _on_event(self, message: str) -> None:
        event = json.loads(message)
        if event["type"] == "session.started":
            self.started.set()
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
        """Nothing until the track ends: the frames back are matched at the end (`frames_back`)."""
        track, frames = await self.remote, TrackFrames(self.first_frame)
        with contextlib.suppress(MediaStreamError):
            while True:
                packet = (await track.recv()).to_ndarray().reshape(-1)
                frame = frames.packet(float(np.abs(packet).max(initial=0)) / 32768)
                if frame is not None:
                    self.back.append((frame, time.monotonic()))
        return
        yield

    def frames_back(self) -> tuple[list[tuple[int, float]], int]:
        """(the client's frame, arrival) of every frame back that could be matched; how many could not."""
        return client_frames(self.back, self.probes, self.said)

    async def close(self) -> None:
        self.microphone.end()
        if self.channel is not None and self.channel.readyState == "open":
            self.channel.send(json.dumps({"type": "session.close"}))
            await asyncio.sleep(0.1)  # the data channel's message out before the connection goes
        await self.pc.close()


def _post_offer(url: str, token: str | None, session: dict, sdp: str) -> str:
    """The SDP answer to `sdp`; ServerRefused with the server's status if it says no."""
    body = json.dumps({"session": session, "transport": {"type": "webrtc", "sdp": sdp}}).encode()
    headers = {"content-type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    scheme = "https" if urlsplit(url).scheme == "wss" else "http"
    request = urllib.request.Request(live_url(url, scheme), data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return json.loads(reply.read())["transport"]["sdp"]
    except urllib.error.HTTPError as exc:
        raise ServerRefused(exc.read().decode(errors="replace"), exc.code) from exc


async def first_sounding_frame(url: str, token: str | None = None, limit: int = 50) -> int:
    """The index of the first output frame with sound (the front-end's acoustic delay), from a short
    WebSocket session fed noise one frame at a time: what `TrackFrames` needs, since the track's
    silence before it has no frame boundaries."""
    client = await LiveAudio.connect(url, token)
    noise = (np.random.default_rng(0).standard_normal(RATE * 80 // 1000) * 0.05).astype(np.float32)
    deltas = client.audio()
    try:
        for index in range(limit):
            await client.send_pcm(noise)
            _, pcm = await anext(deltas)
            if np.abs(pcm).max(initial=0) >= SILENT_PEAK:
                return index
    finally:
        await deltas.aclose()
        await client.close()
    raise RuntimeError(f"no output frame with sound in the first {limit}")
