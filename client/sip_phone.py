"""A softphone's side of one SIP call, for `kame bench load --transport sip`: an INVITE to `kame serve --sip`
(PCMU), the caller's audio up as 20 ms RTP packets, the server's audio back a frame at a time, and the
arrival times of its packets (the server's RTP send jitter, as the phone sees it)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import numpy as np

from client.client import ServerRefused
from kame.audio import FRAME_S, SAMPLE_RATE
from kame.pcm import Resampler, ulaw_decode, ulaw_encode
from kame.sip import sdp
from kame.sip.rtp import RtpFormat, RtpSession
from kame.sip.transport import SipTransport
from kame.sip.ua import CallFailed, SipCall, SipEndpoint

PACKET_S = 0.02
FRAME_BYTES = round(8000 * FRAME_S)  # 80 ms of mu-law


class _TimedRtp(RtpSession):
    """An RTP session that notes when each packet from the server arrived."""

    arrivals: list[float]

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        self.arrivals.append(time.monotonic())
        super().datagram_received(data, addr)


def sip_address(url: str) -> tuple[str, int]:
    """`sip://HOST:PORT` (or `HOST:PORT`) -> (host, port); 5060 by default."""
    parts = urlsplit(url if "://" in url else f"sip://{url}")
    return parts.hostname or "127.0.0.1", parts.port or 5060


class SipPhone:
    """One call: `send_pcm` (24 kHz float32 frames) as RTP, `audio()` the server's audio a frame at a time."""

    def __init__(self, transport: SipTransport, call: SipCall, rtp: _TimedRtp) -> None:
        self.transport, self.call, self.rtp = transport, call, rtp
        self.leads: list[float] = []  # (a carrier's figure; a phone plays what comes)
        self._down, self._up = Resampler(SAMPLE_RATE, 8000), Resampler(8000, SAMPLE_RATE)
        self._back = bytearray()
        self._frames: asyncio.Queue[np.ndarray | None] = asyncio.Queue()

    @classmethod
    async def connect(cls, url: str) -> SipPhone:
        host, port = sip_address(url)
        transport = SipTransport(lambda message, flow: None)
        endpoint = SipEndpoint(transport, lambda call: call.reject(603), user_agent="kame-bench")
        await transport.start("127.0.0.1" if host in ("127.0.0.1", "localhost") else "0.0.0.0", 0, tcp=False)
        rtp = await _TimedRtp.open(transport.host, jitter_ms=20)
        rtp.arrivals = []
        try:
            flow = await transport.connect("UDP", (host, port))
            codecs = sdp.codecs_for(("PCMU",))
            local = endpoint.local_address(flow)[0]
            offer = sdp.offer(address=local, port=rtp.port, session_id=secrets.randbelow(2**31), session_version=1,
                              codecs=codecs)
            call = await endpoint.invite(f"sip:kame@{host}:{port}", offer.encode(), flow,
                                         from_uri=f"sip:bench@{local}")
            answer = sdp.parse(call.answer.decode())
            codec, dtmf = sdp.negotiated(answer, codecs)
        except CallFailed as exc:
            await rtp.close()
            await transport.close()
            if exc.status in (486, 503):
                raise ServerRefused(f"{exc.status} {exc.reason}") from None
            raise
        phone = cls(transport, call, rtp)
        audio = answer.audio()
        assert audio is not None
        rtp.start((audio.address, audio.port), RtpFormat(codec.payload_type,
                                                         dtmf_payload_type=dtmf.payload_type if dtmf else None),
                  on_audio=phone._heard, on_digit=lambda digit: None, on_timeout=lambda: phone._frames.put_nowait(None))
        return phone

    async def send_pcm(self, pcm: np.ndarray) -> None:
        self.rtp.send_audio(ulaw_encode(self._down(pcm)))

    def _heard(self, payload: bytes) -> None:
        self._back += payload
        while len(self._back) >= FRAME_BYTES:
            self._frames.put_nowait(self._up(ulaw_decode(bytes(self._back[:FRAME_BYTES]))))
            del self._back[:FRAME_BYTES]

    async def audio(self) -> AsyncIterator[tuple[int | None, np.ndarray]]:
        ended = asyncio.ensure_future(self.call.ended.wait())
        try:
            while True:
                frame = asyncio.ensure_future(self._frames.get())
                await asyncio.wait([frame, ended], return_when=asyncio.FIRST_COMPLETED)
                if not frame.done():
                    frame.cancel()
                    return
                if frame.result() is None:
                    return
                yield None, frame.result()
        finally:
            ended.cancel()

    def send_jitter_ms(self) -> list[float]:
        """How far each packet of the server's arrived off the 20 ms beat of the one before it (in talk spurts:
        a gap over 100 ms is a pause, not jitter)."""
        gaps = np.diff(np.array(self.rtp.arrivals)) if len(self.rtp.arrivals) > 1 else np.zeros(0)
        return [abs(gap - PACKET_S) * 1000 for gap in gaps if gap < 0.1]

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.call.hangup("the bench's call is over"), 5)
        await self.rtp.close()
        await self.transport.close()
