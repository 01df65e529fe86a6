"""GPT-Live over WebRTC end to end: an aiortc peer connection (the client) sends its offer with the
openai SDK's `live.create` to the real server on loopback, speaks on its audio track and talks Live
events on `oai-events`; and the POST's refusals. Every server event is checked against the SDK's
`ServerEvent`."""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import json
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import av
import numpy as np
import pytest
import soxr
from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError
from openai import AsyncOpenAI
from openai.types.live import ServerEvent
from pydantic import TypeAdapter

from kame.rtc import ptime

from .conftest import words
from .server_harness import running_server, wait_until_all_slots_free

LIVE_EVENT = TypeAdapter(ServerEvent)
COMMENTARY = "Zebras sing in Oslo."  # words the scripted LLM never says: only the client's commentary has them
RATE = 48000
PTIME = 960


class SpeakingTrack(MediaStreamTrack):
    """The user's microphone: `pcm` (24 kHz) at 48 kHz, 20 ms frames at real-time pace, then silence."""

    kind = "audio"

    def __init__(self, pcm: np.ndarray) -> None:
        super().__init__()
        self.pcm = soxr.resample(pcm, 24000, RATE).astype(np.float32)
        self.pts, self.start = 0, None

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        loop = asyncio.get_running_loop()
        if self.start is None:
            self.start = loop.time()
        else:
            self.pts += PTIME
            await asyncio.sleep(self.start + self.pts / RATE - loop.time())
        chunk = np.zeros(PTIME, np.float32)
        part = self.pcm[self.pts:self.pts + PTIME]
        chunk[:len(part)] = part
        frame = av.AudioFrame.from_ndarray((chunk * 32767).astype(np.int16).reshape(1, -1), format="s16",
                                           layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = RATE, self.pts, fractions.Fraction(1, RATE)
        return frame


class Peer:
    """The client's side: a peer connection with `oai-events`, one sendrecv audio track; the events
    and the audio frames it received."""

    def __init__(self, pcm: np.ndarray) -> None:
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.channel = self.pc.createDataChannel("oai-events")
        self.events: list[dict] = []
        self.frames: list[np.ndarray] = []
        self._new = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.channel.on("message", self._on_message)
        self.pc.on("track", lambda track: self._tasks.append(asyncio.ensure_future(self._listen(track))))
        self.pc.addTrack(SpeakingTrack(pcm))

    def _on_message(self, message: str) -> None:
        event = json.loads(message)
        LIVE_EVENT.validate_python(event)  # the SDK's models accept it as it is
        self.events.append(event)
        self._new.set()

    async def _listen(self, track) -> None:
        with contextlib.suppress(MediaStreamError):
            while True:
                frame = await track.recv()
                self.frames.append(frame.to_ndarray().reshape(-1))

    async def offer(self) -> str:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        return self.pc.localDescription.sdp

    async def answer(self, sdp: str) -> None:
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp, "answer"))

    def send(self, event: dict) -> None:
        self.channel.send(json.dumps(event))

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]

    def said(self, kind: str) -> list[str]:
        return words("".join(e["delta"] for e in self.of(kind)))

    async def wait_for(self, predicate, limit_s: float, what: str) -> None:
        deadline = time.monotonic() + limit_s
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {what} within {limit_s} s; got {[e['type'] for e in self.events]}")
            self._new.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._new.wait(), remaining)

    async def close(self) -> None:
        await self.pc.close()
        for task in self._tasks:
            task.cancel()


def http(url: str) -> str:
    return url.replace("ws://", "http://") + "/v1/live/sessions"


@dataclass
class Reply:
    status_code: int
    headers: dict[str, str]
    text: str

    def json(self):
        return json.loads(self.text)


async def request(url: str, method: str = "POST", body: object = None, headers: dict | None = None) -> Reply:
    """One HTTP request to the Live endpoint (urllib, in a thread); errors are replies too."""
    data = body.encode() if isinstance(body, str) else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(http(url), data=data, method=method,
                                 headers={"content-type": "application/json"} | (headers or {}))

    def send() -> Reply:
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return Reply(resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read().decode())
        except urllib.error.HTTPError as exc:
            return Reply(exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read().decode())

    return await asyncio.to_thread(send)


@pytest.mark.slow
def test_a_spoken_question_over_webrtc_with_client_delegation(tandem_server, voices):
    url, services = tandem_server
    question = np.concatenate([np.zeros(12000, np.float32), voices["france"], np.zeros(24000 * 3, np.float32)])

    async def go():
        peer = Peer(question)
        sdk = AsyncOpenAI(base_url=url.replace("ws://", "http://") + "/v1", api_key="kame-test")
        try:
            created = await sdk.live.create(session={"model": "gpt-live-1", "delegation": {"type": "client"}},
                                            transport={"type": "webrtc", "sdp": await peer.offer()})
            body = created.model_dump()
            await peer.answer(created.transport.sdp)
            await peer.wait_for(lambda: peer.events, 15, "a first event")
            delegation = None
            await peer.wait_for(lambda: peer.of("session.delegation.created"), 25, "a delegation")
            for delegation in peer.of("session.delegation.created"):
                peer.send({"type": "session.commentary.append", "event_id": delegation["event_id"],
                           "delegation_id": delegation["delegation"]["id"], "content": COMMENTARY})
            await peer.wait_for(lambda: "zebras" in peer.said("session.output_transcript.delta"), 20,
                                "the commentary in the output transcript")
            await peer.wait_for(lambda: set(words("capital france")) <= set(peer.said(
                "session.input_transcript.delta")), 15, "the question in the input transcript")
            peer.send({"type": "session.close", "event_id": "bye"})
            await peer.wait_for(lambda: peer.of("session.closed"), 10, "session.closed")
            await asyncio.sleep(0.5)  # the server closes its side
            return body, peer
        finally:
            await peer.close()
            await sdk.close()

    body, peer = asyncio.run(go())
    assert body["session"]["id"] and body["transport"]["type"] == "webrtc"
    assert body["transport"]["sdp"].startswith("v=0") and "opus/48000" in body["transport"]["sdp"].lower()
    assert ptime(body["transport"]["sdp"]) == 40  # the client's packets: half the server's work of 20 ms ones
    assert peer.events[0]["type"] == "session.started"
    assert peer.events[0]["session"]["id"] == body["session"]["id"]
    assert "format" not in peer.events[0]["session"]["audio"]
    assert not peer.of("session.output_audio.delta") and not peer.of("error"), peer.of("error")
    assert peer.of("session.commentary.appended")
    assert peer.of("session.closed")[0]["reason"] == "close_requested"
    audio = np.concatenate(peer.frames)
    assert len(audio) > 48000 * 2  # seconds of the assistant's track (its silence included)
    assert np.abs(audio).max() > 0  # and not only silence: the front-end spoke
    wait_until_all_slots_free(services, 15)  # the session ended with the peer connection: its slot is back


@pytest.fixture(scope="module")
def guarded_server():
    """A server with a token, one allowed origin and no ASR (the POST's refusals need no session to run)."""
    with running_server(auth_tokens=["secret"], allowed_origins=["https://app.example"], max_sessions=1) as (
            url, services):
        yield url, services


async def _post(url: str, body, token: str | None = "secret") -> Reply:
    return await request(url, body=body, headers={"Authorization": f"Bearer {token}"} if token else {})


def test_the_post_refuses_bad_requests_with_openai_errors(guarded_server):
    url, _ = guarded_server
    offer = {"type": "webrtc", "sdp": "v=0\r\n"}

    async def go():
        return (await _post(url, {"session": {"model": "gpt-live-1"}, "transport": offer}, token=None),
                await _post(url, "{not json"),
                await _post(url, {"session": {"model": "gpt-live-1", "colour": "red"}, "transport": offer}),
                await _post(url, {"session": {"model": "gpt-live-1", "audio": {"output": {"pitch": 3}}},
                                  "transport": offer}),
                await _post(url, {"session": {"model": "gpt-live-1"}, "transport": {"type": "sip", "sdp": ""}}),
                await _post(url, {"session": {}, "transport": offer}),
                await _post(url, {"session": {"model": "gpt-live-1"}, "transport": offer}))

    no_auth, bad_json, unknown, nested, transport, missing, bad_sdp = asyncio.run(go())
    assert no_auth.status_code == 401 and no_auth.json()["error"]["code"] == "invalid_api_key"
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
    for reply, param in ((unknown, "session.colour"), (nested, "session.audio.output.pitch")):
        assert reply.status_code == 400
        assert reply.json()["error"] == {"type": "invalid_request_error", "code": "unknown_parameter",
                                         "message": f"Unknown parameter: '{param}'.", "param": param}
    assert transport.status_code == 400 and transport.json()["error"]["param"] == "transport.type"
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "session.model"
    assert bad_sdp.status_code == 400 and bad_sdp.json()["error"]["param"] == "transport.sdp"


def test_cors_preflight_answers_allowed_origins_only(guarded_server):
    url, _ = guarded_server

    async def go():
        preflight = {"Access-Control-Request-Method": "POST"}
        return (await request(url, "OPTIONS", headers=preflight | {"Origin": "https://app.example"}),
                await request(url, "OPTIONS", headers=preflight | {"Origin": "https://evil.example"}))

    ok, other = asyncio.run(go())
    assert ok.status_code == 204 and ok.headers["access-control-allow-origin"] == "https://app.example"
    assert "authorization" in ok.headers["access-control-allow-headers"]
    assert "access-control-allow-origin" not in other.headers


def test_one_slot_per_peer_connection_given_back_when_the_peer_goes(guarded_server):
    """A second offer finds the only slot taken (503); the first peer closing, without session.close,
    ends its session and frees the slot."""
    url, services = guarded_server
    body = {"session": {"model": "gpt-live-1"}}

    async def go():
        peer, second = Peer(np.zeros(24000, np.float32)), Peer(np.zeros(1, np.float32))
        try:
            first = await _post(url, body | {"transport": {"type": "webrtc", "sdp": await peer.offer()}})
            assert first.status_code == 200, first.text
            await peer.answer(first.json()["transport"]["sdp"])
            await peer.wait_for(lambda: peer.of("session.started"), 15, "session.started")
            busy = await _post(url, body | {"transport": {"type": "webrtc", "sdp": await second.offer()}})
        finally:
            await peer.close()
            await second.close()
        return busy

    busy = asyncio.run(go())
    assert busy.status_code == 503 and busy.json()["error"]["code"] == "server_busy"
    wait_until_all_slots_free(services, 15)


@pytest.mark.slow
def test_a_data_channel_message_past_the_announced_size_is_dropped_as_it_comes(guarded_server):
    """A client that ignores the answer's a=max-message-size sends a 12 MB event: the server's SCTP drops it
    as its fragments pass the size (aiortc alone held all 12 MB, rescanning them as each fragment came: 33 s
    of the loop before it could be refused), the client gets an error naming the size, and the session goes on."""
    url, services = guarded_server
    body = {"session": {"model": "gpt-live-1"}}

    async def go():
        peer = Peer(np.zeros(24000, np.float32))
        try:
            reply = await _post(url, body | {"transport": {"type": "webrtc", "sdp": await peer.offer()}})
            assert reply.status_code == 200, reply.text
            answer = reply.json()["transport"]["sdp"]
            size = int(re.search(r"a=max-message-size:(\d+)", answer)[1])
            await peer.answer(answer.replace(f"a=max-message-size:{size}", "a=max-message-size:0"))  # ignored
            await peer.wait_for(lambda: peer.of("session.started"), 15, "session.started")
            peer.send({"type": "session.update", "session": {"instructions": "x" * 12_000_000}})
            await peer.wait_for(lambda: peer.of("error"), 30, "error")
            peer.send({"type": "session.input_audio.mute"})
            await peer.wait_for(lambda: peer.of("session.input_audio.muted"), 60, "session.input_audio.muted")
        finally:
            await peer.close()
        return size, peer

    size, peer = asyncio.run(go())
    (error,) = peer.of("error")
    assert error["error"]["code"] == "event_too_large" and f"over {size} bytes" in error["error"]["message"]
    assert not peer.of("session.updated") and not peer.of("session.closed")
    wait_until_all_slots_free(services, 15)


def test_the_data_channel_permissions_limit_what_the_browser_sends_and_gets():
    """`session.client.data_channel`: an untrusted browser sends and gets only the allowed events."""
    from openai.types.live import DataChannelConfig

    from server.live.webrtc import ChannelPermissions

    everything = ChannelPermissions(None)
    assert everything.may_send("session.close") and everything.may_get({"type": "error"})
    assert ChannelPermissions(DataChannelConfig(allowed_client_events="all")).may_send("session.update")
    narrow = ChannelPermissions(DataChannelConfig.model_validate({
        "allowed_client_events": ["session.input_audio.mute"],
        "allowed_server_events": [{"type": "session.output_transcript.delta"},
                                  {"type": "response.event", "response_event": "response.completed"}]}))
    assert narrow.may_send("session.input_audio.mute") and not narrow.may_send("session.commentary.append")
    assert not narrow.may_send(None)
    assert narrow.may_get({"type": "session.output_transcript.delta", "delta": "hi"})
    assert narrow.may_get({"type": "response.event", "event": {"type": "response.completed"}})
    assert not narrow.may_get({"type": "response.event", "event": {"type": "response.created"}})
    assert not narrow.may_get({"type": "session.delegation.created"})
    none = ChannelPermissions(DataChannelConfig(allowed_client_events=[], allowed_server_events=[]))
    assert not none.may_send("session.close") and not none.may_get({"type": "session.closed"})


def test_a_peer_connection_that_never_closes_holds_nothing(monkeypatch):
    """aiortc's `close`, once cut short, makes every later call wait forever: the session closes its
    peer connection once, in a task of its own, and waits for it at most CLOSE_LIMIT_S each time."""
    from types import SimpleNamespace

    from server.live import rtc_link

    monkeypatch.setattr(rtc_link, "CLOSE_LIMIT_S", 0.05)
    closes = []

    async def never() -> None:
        closes.append("close")
        await asyncio.Event().wait()

    async def go():
        link = rtc_link.WebRTCLink()
        await link.pc.close()  # the real one, never used; in its place one that does not finish closing
        link.pc = SimpleNamespace(close=never)
        await asyncio.wait_for(link.close_peer(), 2)
        await asyncio.wait_for(link.close_peer(), 2)  # the session's end closes it again: no wait forever

    asyncio.run(go())
    assert closes == ["close"]


def test_without_aiortc_the_webrtc_route_says_why_and_the_rest_of_the_server_stands(monkeypatch):
    """A server whose image lacks aiortc/PyAV (a GPU image with only the core): WebSockets work, the
    WebRTC POST and its preflight answer 501 with the reason instead of a 500 or a failed start."""
    import httpx2 as httpx  # openai's HTTP client (the project has no httpx)

    import server.app as app_module
    from server.settings import ServerSettings

    monkeypatch.setattr(app_module, "webrtc", None)
    monkeypatch.setattr(app_module, "WEBRTC_MISSING", "GPT-Live over WebRTC is unavailable: No module named 'av'",
                        raising=False)
    app = app_module.create_app(ServerSettings())  # no lifespan here: nothing loads

    async def ask() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kame") as client:
            return [await client.post("/v1/live/sessions", content=b"v=0"),
                    await client.options("/v1/live/sessions")]

    for response in asyncio.run(ask()):
        assert response.status_code == 501
        error = response.json()["error"]
        assert error["code"] == "webrtc_unavailable" and "No module named 'av'" in error["message"]


def test_only_a_missing_aiortc_or_pyav_makes_webrtc_optional():
    """The server imports without PyAV (WebRTC then off, said at start); an import error of our own
    still stops the import, instead of hiding behind a 501."""
    import subprocess
    import sys

    def imports(blocked: str) -> subprocess.CompletedProcess:
        code = (f"import sys; sys.modules[{blocked!r}] = None\n"
                "import server.app as app\n"
                "print(app.webrtc is None, app.WEBRTC_MISSING if app.webrtc is None else '')")
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)

    without_av = imports("av")
    assert without_av.returncode == 0, without_av.stderr
    assert without_av.stdout.startswith("True") and "aiortc==1.16.0" in without_av.stdout
    broken = imports("server.live.client_events")
    assert broken.returncode != 0 and "server.live.client_events" in broken.stderr


def test_the_webrtc_settings_come_from_the_env_and_are_checked(monkeypatch):
    import os

    from server.settings import SettingsError, load_settings

    for name in [n for n in os.environ if n.startswith("KAME_")]:
        monkeypatch.delenv(name)
    defaults = load_settings(None).realtime
    assert (defaults.webrtc_opus_complexity, defaults.webrtc_uplink_ptime_ms) == (5, 40)
    monkeypatch.setenv("KAME_REALTIME__WEBRTC_UPLINK_PTIME_MS", "20")
    monkeypatch.setenv("KAME_REALTIME__WEBRTC_OPUS_COMPLEXITY", "10")
    realtime = load_settings(None).realtime
    assert (realtime.webrtc_opus_complexity, realtime.webrtc_uplink_ptime_ms) == (10, 20)
    monkeypatch.setenv("KAME_REALTIME__WEBRTC_UPLINK_PTIME_MS", "30")  # not a packet time Opus has
    with pytest.raises(SettingsError, match="webrtc_uplink_ptime_ms"):
        load_settings(None)
