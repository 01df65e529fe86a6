"""The offers a WebRTC session refuses before aiortc parses them, and the media it answers inactive: each
built from aiortc's own offer (as a client makes it), then changed the way a bad or hostile client would."""

from __future__ import annotations

import asyncio
import re

import pytest
from aiortc import RTCPeerConnection
from aiortc.mediastreams import AudioStreamTrack, VideoStreamTrack

from server.live.client_events import LiveError
from server.live.rtc_link import MAX_CANDIDATES, MAX_OFFER_BYTES, WebRTCLink, check_offer


def offer(video: bool = False) -> str:
    async def make():
        pc = RTCPeerConnection()
        pc.createDataChannel("oai-events")
        pc.addTrack(AudioStreamTrack())
        if video:
            pc.addTrack(VideoStreamTrack())
        await pc.setLocalDescription(await pc.createOffer())
        sdp = pc.localDescription.sdp
        await pc.close()
        return sdp

    return asyncio.run(make())


def test_a_clients_own_offer_passes():
    check_offer(offer())


def test_candidates_repeated_in_every_section_count_once():
    """aiortc's offers (the bench's client's) list every candidate again in each m-section."""
    one = "".join(f"a=candidate:{i} 1 udp 2130706431 10.0.0.{i} {9000 + i} typ host\r\n"
                  for i in range(MAX_CANDIDATES * 2 // 3))
    sdp = offer().replace("a=mid:0\r\n", "a=mid:0\r\n" + one, 1).replace("a=mid:1\r\n", "a=mid:1\r\n" + one, 1)
    assert sdp.count("a=candidate:") > MAX_CANDIDATES
    check_offer(sdp)


@pytest.mark.parametrize("change", ["huge", "candidates", "no_fingerprint", "no_setup", "no_opus"])
def test_what_aiortc_takes_badly_is_refused_first(change):
    sdp = offer()
    if change == "huge":
        sdp += "a=x-padding:" + "x" * MAX_OFFER_BYTES + "\r\n"
    elif change == "candidates":  # aioice's matching is quadratic in them: 20,000 froze the loop for 45 s
        fake = "".join(f"a=candidate:{i} 1 udp 2130706431 10.0.{i // 250}.{i % 250} {9000 + i} typ host\r\n"
                       for i in range(MAX_CANDIDATES + 1))
        sdp = sdp.replace("a=mid:0\r\n", "a=mid:0\r\n" + fake, 1)
    elif change == "no_fingerprint":
        sdp = re.sub(r"a=fingerprint:[^\r\n]*\r\n", "", sdp)
    elif change == "no_setup":
        sdp = re.sub(r"a=setup:[^\r\n]*\r\n", "", sdp)
    else:  # a client that offers G.711 only would hear Opus bytes labelled PCMU
        sdp = re.sub(r"a=rtpmap:\d+ opus/48000/2\r\n", "", sdp)
    with pytest.raises(LiveError) as refused:
        check_offer(sdp)
    assert refused.value.code == "invalid_sdp" and refused.value.param == "transport.sdp"


def answered(sdp: str) -> str:
    """The server's link's answer to `sdp` (its peer connection closed after)."""
    async def answer():
        link = WebRTCLink()
        try:
            return await link.answer(sdp)
        finally:
            await link.close_peer()

    return asyncio.run(answer())


def test_a_malformed_offer_is_invalid_sdp_whatever_aiortc_raises():
    sdp = re.sub(r"m=audio \d+", "m=audio port", offer(), count=1)  # aiortc asserts on it
    with pytest.raises(LiveError) as refused:
        answered(sdp)
    assert refused.value.code == "invalid_sdp"


def test_video_in_the_offer_is_answered_inactive():
    """A browser that asked getUserMedia for video too: nothing here reads it, so the answer says inactive
    (aiortc would decode it and queue every frame unread, ~13 MB a second)."""
    sections = re.split(r"\r\n(?=m=)", answered(offer(video=True)))
    audio = next(s for s in sections if s.startswith("m=audio"))
    video = next(s for s in sections if s.startswith("m=video"))
    assert "a=sendrecv" in audio and "a=inactive" in video
