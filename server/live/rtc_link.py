"""A Live session's link over one aiortc peer connection: the `oai-events` data channel carries the
events both ways, one sendrecv Opus track the audio (48 kHz on the wire, 24 kHz in the session). Only
sending and receiving: the protocol is the carrier's (`adapter.LiveCarrier`)."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Coroutine

import av
import numpy as np
from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from kame.audio import SAMPLE_RATE
from kame.opus import PEER_PTIME_MS, VOICE_COMPLEXITY
from kame.pcm import Resampler
from kame.rtc import OpusInput, receive_opus, send_cheaply, with_ptime
from server.live.assistant_track import AssistantTrack
from server.live.client_events import LiveError
from server.live.sctp_bound import bound_messages
from server.runner import CLOSE_LIMIT_S, Disconnected, Message

logger = logging.getLogger(__name__)

EVENTS_LABEL = "oai-events"  # the data channel the client creates
MAX_OFFER_BYTES = 64 * 1024  # a browser's offer is a few kB; aiortc's parsing is slow on a large one
MAX_CANDIDATES = 64  # aioice matches every remote candidate against the others: quadratic in their number
OPUS = re.compile(r"^a=rtpmap:\d+ opus/48000", re.IGNORECASE | re.MULTILINE)
SENT_GRACE_S = 0.1  # after SCTP took the last message, before the peer connection closes (unacked)


def check_offer(sdp: str) -> None:
    """What aiortc would take badly, refused before it parses: a huge offer, too many candidates, no
    DTLS fingerprint or role (the connection would fail later, holding its slot), audio without Opus."""
    size = len(sdp.encode())
    if size > MAX_OFFER_BYTES:
        raise LiveError("invalid_sdp", f"The SDP offer is {size} bytes; at most {MAX_OFFER_BYTES}.", "transport.sdp")
    lines = sdp.splitlines()
    candidates = len({line for line in lines if line.startswith("a=candidate:")})  # aiortc repeats them a section
    if candidates > MAX_CANDIDATES:
        raise LiveError("invalid_sdp", f"The SDP offer has {candidates} ICE candidates; at most {MAX_CANDIDATES}.",
                        "transport.sdp")
    for attribute in ("a=fingerprint:", "a=setup:"):
        if not any(line.startswith(attribute) for line in lines):
            raise LiveError("invalid_sdp", f"The SDP offer has no {attribute.rstrip(':')} (DTLS).", "transport.sdp")
    audio = next((section for section in re.split(r"^(?=m=)", sdp, flags=re.MULTILINE)
                  if section.startswith("m=audio")), None)
    if audio is not None and not OPUS.search(audio):
        raise LiveError("invalid_sdp", "The offer's audio has no Opus (opus/48000): this server speaks Opus only.",
                        "transport.sdp")


class WebRTCLink:
    idle_limited = False  # the audio comes on the track: the data channel may stay quiet
    unopened = "no data channel 'oai-events'"

    def __init__(self, complexity: int = VOICE_COMPLEXITY, ptime_ms: int = PEER_PTIME_MS) -> None:
        self.name = ""  # the session's id, for the logs and the decoder's thread
        send_cheaply()
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))  # host candidates: no STUN round trip
        self.track = AssistantTrack(complexity=complexity)
        self.hear: Callable[[np.ndarray], None] | None = None  # the user's audio, 24 kHz float32 mono
        self._inbox: asyncio.Queue[Message | LiveError | None] = asyncio.Queue()  # None: the peer has gone
        self._channel = None
        self._channel_open = asyncio.Event()
        self._remote: MediaStreamTrack | None = None
        self._opus: OpusInput | None = None  # the user's audio, decoded as it arrives (`answer`)
        self._max_message: int | None = None  # what SCTP takes of one message (`answer`); None: aiortc's whole
        self._pc_closing: asyncio.Task | None = None
        self._ptime_ms = ptime_ms

    async def answer(self, offer: str) -> str:
        """The SDP answer to the client's offer (LiveError for a bad one). Media beyond the first audio
        track (video, a second microphone) is answered inactive: nothing would read it."""
        check_offer(offer)
        self.pc.on("datachannel", self._on_channel)
        self.pc.on("track", self._on_track)
        self.pc.on("connectionstatechange", self._on_state)
        try:
            await self.pc.setRemoteDescription(RTCSessionDescription(offer, "offer"))
        except Exception as exc:  # aiortc's parser asserts as often as it raises
            raise LiveError("invalid_sdp", f"The SDP offer cannot be read: {exc!r}", "transport.sdp") from exc
        kinds = {t.kind for t in self.pc.getTransceivers()}
        if "audio" not in kinds or self.pc.sctp is None:
            raise LiveError("invalid_sdp", "The offer needs one audio track and a data channel.", "transport.sdp")
        self._max_message = bound_messages(self.pc.sctp, self._on_refused)
        audio = next(t for t in self.pc.getTransceivers() if t.kind == "audio")
        for transceiver in self.pc.getTransceivers():
            if transceiver is not audio:
                transceiver.direction = "inactive"
        self.pc.addTrack(self.track)  # (on the offer's audio transceiver: the one above)
        await self.pc.setLocalDescription(await self.pc.createAnswer())
        self._opus = receive_opus(audio, name=f"opus-in-{self.name}")
        return with_ptime(self.pc.localDescription.sdp, self._ptime_ms)

    @property
    def peer_packet_ms(self) -> int | None:
        """How long the peer's last Opus packet lasted (None before one, or on aiortc's own path)."""
        return self._opus.packet_ms if self._opus is not None else None

    # ---------------------------------------------------------------- the runner's side

    async def opened(self) -> None:
        await self._channel_open.wait()

    async def receive(self) -> Message:
        message = await self._inbox.get()
        if message is None:
            raise Disconnected
        if isinstance(message, LiveError):  # one refused unread (`_on_refused`): the session goes on
            raise message
        return message

    async def send(self, message: Message) -> None:
        if self._channel.readyState != "open":
            raise Disconnected
        self._channel.send(message)

    async def flush(self, messages: list[Message]) -> None:
        """What is queued (session.closed above all) goes out before the peer connection closes."""
        channel = self._channel
        if channel is None or channel.readyState != "open":
            return
        for message in messages:
            channel.send(message)
        sent = asyncio.Event()
        if channel.bufferedAmount:
            channel.once("bufferedamountlow", sent.set)  # fired as the amount reaches 0
        else:
            sent.set()
        await sent.wait()
        await asyncio.sleep(SENT_GRACE_S)

    async def close(self, code: int, reason: str) -> None:
        logger.info("session %s: closing the peer connection (%d %s)", self.name, code, reason)
        await self.close_peer()

    def tasks(self) -> list[Coroutine]:
        return [self._listen()]

    async def close_peer(self) -> None:
        """Close the peer connection, once, waiting at most CLOSE_LIMIT_S. The close runs in a task of
        its own and is never cut short: aiortc's `close`, once interrupted, makes every later call wait
        forever (and this session's task with it, holding its place among the server's sessions)."""
        if self._opus is not None:
            self._opus.close()
        if self._pc_closing is None:
            self._pc_closing = asyncio.get_running_loop().create_task(self.pc.close(), name=f"pc-close-{self.name}")
        try:
            async with asyncio.timeout(CLOSE_LIMIT_S):
                await asyncio.shield(self._pc_closing)
        except TimeoutError:
            logger.warning("session %s: the peer connection did not close within %.0f s", self.name, CLOSE_LIMIT_S)
        except Exception:  # closing is the last thing done: log it, end anyway
            logger.exception("session %s: closing the peer connection failed", self.name)

    # ---------------------------------------------------------------- the peer connection's events

    def _on_channel(self, channel) -> None:
        if channel.label != EVENTS_LABEL or self._channel is not None:
            logger.info("session %s: data channel %r ignored", self.name, channel.label)
            return
        self._channel = channel
        channel.on("message", self._inbox.put_nowait)
        channel.on("close", lambda: self._inbox.put_nowait(None))
        if channel.readyState == "open":
            self._channel_open.set()
        else:
            channel.on("open", self._channel_open.set)

    def _on_refused(self, stream_id: int, held: int) -> None:
        """SCTP dropped a message past the size the answer announced as it came (`sctp_bound`); on the
        events channel, the session is told in its turn, after the messages before it."""
        logger.info("session %s: a message on SCTP stream %d dropped at %d bytes (max %s)", self.name, stream_id,
                    held, self._max_message)
        if self._channel is not None and self._channel.id == stream_id:
            self._inbox.put_nowait(LiveError(
                "event_too_large", f"A data channel message over {self._max_message} bytes (the answer's "
                "a=max-message-size) was dropped unread."))

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio" and self._remote is None:
            self._remote = track

    def _on_state(self) -> None:
        if self.pc.connectionState in ("failed", "closed"):
            self._inbox.put_nowait(None)

    async def _listen(self) -> None:
        """The user's audio as 24 kHz mono float32 for `hear`: from `OpusInput` as each packet decodes,
        or (another codec) from aiortc's track."""
        if self._opus is not None:
            while (pcm := await self._opus.frames.get()) is not None:
                self.hear(pcm)
            return
        if self._remote is None:
            return
        mono, resample = None, None  # PyAV to float mono at the codec's rate, then kame/pcm.py's resampler
        while True:
            try:
                frame = await self._remote.recv()
            except MediaStreamError as exc:
                raise Disconnected from exc
            if resample is None:
                mono = av.AudioResampler(format="flt", layout="mono", rate=frame.sample_rate)
                resample = Resampler(frame.sample_rate, SAMPLE_RATE)
            for out in mono.resample(frame):
                self.hear(resample(out.to_ndarray().reshape(-1)))

