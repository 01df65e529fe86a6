"""SDP and offer/answer (kame/sip/sdp.py) against the RFCs' own examples (RFC 3264 §10.1, RFC 4317, RFC 4566 §5)
and offers written the way softphones and PBXs write them, plus a randomized check over shuffled codec lists."""

from __future__ import annotations

import random

import pytest

from kame.sip.sdp import (
    MAX_SDP_BYTES,
    SUPPORTED,
    Codec,
    NoCommonCodec,
    SdpError,
    SessionDescription,
    answer,
    codecs_for,
    negotiated,
    offer,
    parse,
)

US = {"address": "192.0.2.1", "port": 30000, "session_id": 42, "session_version": 1}
PCMU = Codec(0, "PCMU", 8000)
PCMA = Codec(8, "PCMA", 8000)

# --- the RFCs' examples, as printed (LF line ends) ---

RFC3264_10_1_OFFER = """\
v=0
o=alice 2890844526 2890844526 IN IP4 host.anywhere.com
s=
c=IN IP4 host.anywhere.com
t=0 0
m=audio 49170 RTP/AVP 0
a=rtpmap:0 PCMU/8000
m=video 51372 RTP/AVP 31
a=rtpmap:31 H261/90000
m=video 53000 RTP/AVP 32
a=rtpmap:32 MPV/90000
"""

# Bob's later offer: a new audio port and a receive-only stream of events ("telephone-events", sic)
RFC3264_10_1_BOB_OFFER = """\
v=0
o=bob 2890844730 2890844731 IN IP4 host.example.com
s=
c=IN IP4 host.example.com
t=0 0
m=audio 65422 RTP/AVP 0
a=rtpmap:0 PCMU/8000
m=video 0 RTP/AVP 31
m=video 53000 RTP/AVP 32
a=rtpmap:32 MPV/90000
m=audio 51434 RTP/AVP 110
a=rtpmap:110 telephone-events/8000
a=recvonly
"""

RFC4317_2_1_OFFER = """\
v=0
o=alice 2890844526 2890844526 IN IP4 host.atlanta.example.com
s=
c=IN IP4 host.atlanta.example.com
t=0 0
m=audio 49170 RTP/AVP 0 8 97
a=rtpmap:0 PCMU/8000
a=rtpmap:8 PCMA/8000
a=rtpmap:97 iLBC/8000
m=video 51372 RTP/AVP 31 32
a=rtpmap:31 H261/90000
a=rtpmap:32 MPV/90000
"""

RFC4317_2_1_ANSWER = """\
v=0
o=bob 2808844564 2808844564 IN IP4 host.biloxi.example.com
s=
c=IN IP4 host.biloxi.example.com
t=0 0
m=audio 49174 RTP/AVP 0
a=rtpmap:0 PCMU/8000
m=video 49170 RTP/AVP 32
a=rtpmap:32 MPV/90000
"""

# the answerer maps iLBC to 99 where the offer had 97
RFC4317_2_3_ANSWER = """\
v=0
o=bob 2808844564 2808844564 IN IP4 host.biloxi.example.com
s=
c=IN IP4 host.biloxi.example.com
t=0 0
m=audio 49172 RTP/AVP 99
a=rtpmap:99 iLBC/8000
m=video 51374 RTP/AVP 31
a=rtpmap:31 H261/90000
"""

RFC4317_2_4_OFFER = """\
v=0
o=alice 2890844526 2890844526 IN IP4 host.atlanta.example.com
s=
c=IN IP4 host.atlanta.example.com
t=0 0
m=audio 49170 RTP/AVP 0 97
a=rtpmap:0 PCMU/8000
a=rtpmap:97 iLBC/8000
m=audio 49172 RTP/AVP 98
a=rtpmap:98 telephone-event/8000
a=sendonly
"""

RFC4317_2_6_OFFER = """\
v=0
o=alice 2890844526 2890844526 IN IP4 host.atlanta.example.com
s=
c=IN IP4 host.atlanta.example.com
t=0 0
m=audio 49170 RTP/AVP 0
a=rtpmap:0 PCMU/8000
m=audio 51372 RTP/AVP 97 101
a=rtpmap:97 iLBC/8000
a=rtpmap:101 telephone-event/8000
"""

RFC4317_2_6_ANSWER = """\
v=0
o=bob 2808844564 2808844564 IN IP4 host.biloxi.example.com
s=
c=IN IP4 host.biloxi.example.com
t=0 0
m=audio 0 RTP/AVP 0
a=rtpmap:0 PCMU/8000
m=audio 49170 RTP/AVP 97 101
a=rtpmap:97 iLBC/8000
a=rtpmap:101 telephone-event/8000
"""

# Bob answers and puts Alice on hold at once (3.1's answer)
RFC4317_3_1_ANSWER = """\
v=0
o=bob 2808844564 2808844564 IN IP4 host.biloxi.example.com
s=
c=IN IP4 placeholder.biloxi.example.com
t=0 0
m=audio 49172 RTP/AVP 97
a=rtpmap:97 iLBC/8000
a=sendonly
"""

# Bob holds the audio stream, not the tones stream (3.2's second offer)
RFC4317_3_2_SECOND_OFFER = """\
v=0
o=bob 2808844564 2808844565 IN IP4 host.biloxi.example.com
s=
c=IN IP4 host.biloxi.example.com
t=0 0
m=audio 49172 RTP/AVP 97
a=rtpmap:97 iLBC/8000
a=sendonly
m=audio 49174 RTP/AVP 98
a=rtpmap:98 telephone-event/8000
a=recvonly
"""

# a stream added by a media server at another address (4.1's second offer)
RFC4317_4_1_SECOND_OFFER = """\
v=0
o=bob 2808844564 2808844565 IN IP4 host.biloxi.example.com
s=
c=IN IP4 host.biloxi.example.com
t=0 0
m=audio 49170 RTP/AVP 97
a=rtpmap:97 iLBC/8000
m=audio 48282 RTP/AVP 98
c=IN IP4 mediaserver.biloxi.example.com
a=rtpmap:98 telephone-event/8000
a=recvonly
"""

RFC4566_5_EXAMPLE = """\
v=0
o=jdoe 2890844526 2890842807 IN IP4 10.47.16.5
s=SDP Seminar
i=A Seminar on the session description protocol
u=http://www.example.com/seminars/sdp.pdf
e=j.doe@example.com (Jane Doe)
c=IN IP4 224.2.17.12/127
t=2873397496 2873404696
a=recvonly
m=audio 49170 RTP/AVP 0
m=video 51372 RTP/AVP 99
a=rtpmap:99 h263-1998/90000
"""

# --- offers as phones and PBXs write them (CRLF line ends) ---

BARESIP = """\
v=0\r
o=- 2073590519 1848291474 IN IP4 192.168.1.42\r
s=-\r
c=IN IP4 192.168.1.42\r
t=0 0\r
m=audio 10002 RTP/AVP 0 8 9 101\r
b=AS:64\r
a=rtpmap:0 PCMU/8000\r
a=rtpmap:8 PCMA/8000\r
a=rtpmap:9 G722/8000\r
a=rtpmap:101 telephone-event/8000\r
a=fmtp:101 0-15\r
a=rtcp-mux\r
a=ptime:20\r
a=sendrecv\r
a=label:1\r
"""

# Asterisk: the connection at session level only, and PCMA listed first
ASTERISK = """\
v=0\r
o=- 1426714316 1426714318 IN IP4 203.0.113.10\r
s=Asterisk\r
c=IN IP4 203.0.113.10\r
t=0 0\r
m=audio 17652 RTP/AVP 8 0 3 101\r
a=rtpmap:8 PCMA/8000\r
a=rtpmap:0 PCMU/8000\r
a=rtpmap:3 GSM/8000\r
a=rtpmap:101 telephone-event/8000\r
a=fmtp:101 0-16\r
a=ptime:20\r
a=maxptime:150\r
a=sendrecv\r
"""

ASTERISK_HOLD = ASTERISK.replace("1426714318", "1426714319").replace("a=sendrecv", "a=sendonly")

# the RFC 2543 hold: the connection address zeroed, no direction attribute
OLD_HOLD = """\
v=0\r
o=- 1426714316 1426714320 IN IP4 203.0.113.10\r
s=Asterisk\r
c=IN IP4 0.0.0.0\r
t=0 0\r
m=audio 17652 RTP/AVP 0 101\r
a=rtpmap:0 PCMU/8000\r
a=rtpmap:101 telephone-event/8000\r
a=fmtp:101 0-16\r
"""

# FreeSWITCH: opus and G722 before G.711, and telephone-event at two clock rates
FREESWITCH = """\
v=0\r
o=FreeSWITCH 1718000000 1718000001 IN IP4 192.0.2.50\r
s=FreeSWITCH\r
c=IN IP4 192.0.2.50\r
t=0 0\r
m=audio 24680 RTP/AVP 102 9 0 8 100 101\r
a=rtpmap:102 opus/48000/2\r
a=fmtp:102 useinbandfec=1; maxaveragebitrate=30000; maxplaybackrate=48000; ptime=20; minptime=10; maxptime=40\r
a=rtpmap:9 G722/8000\r
a=rtpmap:0 PCMU/8000\r
a=rtpmap:8 PCMA/8000\r
a=rtpmap:100 telephone-event/48000\r
a=fmtp:100 0-16\r
a=rtpmap:101 telephone-event/8000\r
a=fmtp:101 0-16\r
a=ptime:20\r
a=sendrecv\r
a=rtcp:24681 IN IP4 192.0.2.50\r
"""

# a video phone: video first, payload type 96 meaning something else in each m= line
VIDEO_AND_AUDIO = """\
v=0\r
o=linphone 1931 3452 IN IP4 198.51.100.23\r
s=Talk\r
c=IN IP4 198.51.100.23\r
t=0 0\r
a=rtcp-xr:rcvr-rtt=all:10000 stat-summary=loss,dup,jitt,TTL voip-metrics\r
m=video 9078 RTP/AVP 96 97\r
a=rtpmap:96 VP8/90000\r
a=rtpmap:97 H264/90000\r
a=fmtp:97 profile-level-id=42801F\r
a=rtcp-fb:* ccm fir\r
m=audio 7078 RTP/AVP 96 97 0 8 101\r
a=rtpmap:96 opus/48000/2\r
a=fmtp:96 useinbandfec=1\r
a=rtpmap:97 speex/16000\r
a=rtpmap:101 telephone-event/8000\r
m=audio 7080 RTP/SAVP 0\r
a=crypto:1 AES_CM_128_HMAC_SHA1_80 inline:WVNfX19zZW1jdGwgKCkgewkyMjA7fQp9CnVubGVz\r
m=image 0 udptl t38\r
"""

G729_ONLY = """\
v=0\r
o=- 3710 3710 IN IP4 192.0.2.99\r
s=-\r
c=IN IP4 192.0.2.99\r
t=0 0\r
m=audio 5004 RTP/AVP 18\r
a=rtpmap:18 G729/8000\r
a=fmtp:18 annexb=no\r
"""

NO_CONNECTION = """\
v=0\r
o=- 3710 3710 IN IP4 192.0.2.99\r
s=-\r
t=0 0\r
m=audio 5004 RTP/AVP 0\r
"""


def _answered(offer_text: str, **kwargs) -> tuple[SessionDescription, Codec, Codec | None]:
    """answer() to `offer_text`, read back with parse() (the round trip)."""
    fields = US | kwargs
    text, codec, dtmf = answer(parse(offer_text), **fields)
    assert text.endswith("\r\n") and "\n" not in text.replace("\r\n", "")
    reply = parse(text)
    assert (reply.origin_user, reply.session_id, reply.session_version, reply.origin_address) == (
        "kame", fields["session_id"], fields["session_version"], fields["address"])
    return reply, codec, dtmf


def test_rfc3264_basic_exchange():
    """§10.1: audio accepted, both video streams refused in place with port 0 and their format."""
    sdp = parse(RFC3264_10_1_OFFER)
    assert (sdp.origin_user, sdp.session_id, sdp.session_version, sdp.origin_address) == (
        "alice", 2890844526, 2890844526, "host.anywhere.com")
    assert [(m.kind, m.port) for m in sdp.media] == [("audio", 49170), ("video", 51372), ("video", 53000)]
    assert sdp.audio() == sdp.media[0]
    assert sdp.media[1].codecs == (Codec(31, "H261", 90000),)
    text, codec, dtmf = answer(sdp, **US)
    assert (codec, dtmf) == (PCMU, None)
    assert text == ("v=0\r\no=kame 42 1 IN IP4 192.0.2.1\r\ns=kame\r\nc=IN IP4 192.0.2.1\r\nt=0 0\r\n"
                    "m=audio 30000 RTP/AVP 0\r\na=rtpmap:0 PCMU/8000\r\na=ptime:20\r\na=sendrecv\r\n"
                    "m=video 0 RTP/AVP 31\r\nm=video 0 RTP/AVP 32\r\n")


def test_rfc3264_bobs_second_offer():
    """A stream already at port 0 stays refused; a second audio stream (events only, recvonly) is refused."""
    reply, codec, dtmf = _answered(RFC3264_10_1_BOB_OFFER)
    assert (codec, dtmf) == (PCMU, None)
    assert [(m.kind, m.port, m.formats) for m in reply.media] == [
        ("audio", 30000, ("0",)), ("video", 0, ("31",)), ("video", 0, ("32",)), ("audio", 0, ("110",))]
    assert parse(RFC3264_10_1_BOB_OFFER).media[3].direction == "recvonly"


def test_rfc4317_audio_and_video():
    """2.1: the offerer's first codec we speak; iLBC is read (dynamic, by rtpmap) though we do not choose it."""
    sdp = parse(RFC4317_2_1_OFFER)
    assert sdp.media[0].codecs == (PCMU, PCMA, Codec(97, "ILBC", 8000))
    reply, codec, dtmf = _answered(RFC4317_2_1_OFFER)
    assert (codec, dtmf) == (PCMU, None)
    audio, video = reply.media
    assert (audio.port, audio.codecs, audio.address, audio.direction, audio.ptime) == (
        30000, (PCMU,), "192.0.2.1", "sendrecv", 20)
    assert (video.kind, video.port, video.formats) == ("video", 0, ("31",))


def test_rfc4317_two_audio_streams():
    """2.4: the first audio stream is ours; the second (telephone-event only, sendonly) is refused."""
    reply, codec, dtmf = _answered(RFC4317_2_4_OFFER)
    assert (codec, dtmf) == (PCMU, None)
    assert [(m.port, m.formats) for m in reply.media] == [(30000, ("0",)), (0, ("98",))]


def test_rfc4317_audio_only_two_choices():
    """2.6: two alternative audio streams; we take the first we can speak, and the RFC's answer, which refused the
    first, has its audio() in the second."""
    reply, codec, _ = _answered(RFC4317_2_6_OFFER)
    assert codec == PCMU and [m.port for m in reply.media] == [30000, 0]
    reply, codec, dtmf = _answered(RFC4317_2_6_OFFER, supported=("iLBC",))
    assert (codec, dtmf) == (Codec(97, "ILBC", 8000), Codec(101, "telephone-event", 8000))
    assert [(m.port, m.formats) for m in reply.media] == [(0, ("0",)), (30000, ("97", "101"))]
    theirs = parse(RFC4317_2_6_ANSWER)
    assert theirs.audio() == theirs.media[1] and theirs.audio().port == 49170


def test_rfc4317_hold_answer_is_read():
    """3.1: sendonly from the session's c= (a placeholder host), while o= names another host."""
    sdp = parse(RFC4317_3_1_ANSWER)
    media = sdp.audio()
    assert (sdp.origin_address, media.address, media.direction) == (
        "host.biloxi.example.com", "placeholder.biloxi.example.com", "sendonly")
    assert negotiated(sdp, (Codec(97, "iLBC", 8000),)) == (Codec(97, "ILBC", 8000), None)


def test_rfc4317_hold_with_two_streams():
    """3.2: the held (sendonly) stream is answered recvonly."""
    reply, codec, _ = _answered(RFC4317_3_2_SECOND_OFFER, supported=("ILBC",))
    assert codec == Codec(97, "ILBC", 8000)
    assert [(m.port, m.direction) for m in reply.media[:1]] == [(30000, "recvonly")]
    assert reply.media[1].port == 0


def test_rfc4317_media_level_connection():
    """4.1: a c= in an m= section overrides the session's for that stream only."""
    sdp = parse(RFC4317_4_1_SECOND_OFFER)
    assert [m.address for m in sdp.media] == ["host.biloxi.example.com", "mediaserver.biloxi.example.com"]


def test_rfc4566_example():
    """RFC 4566 §5: session-level recvonly applies to every stream; a multicast c= loses its /ttl; a static type
    without rtpmap is known; a video codec's name stays as written."""
    sdp = parse(RFC4566_5_EXAMPLE)
    assert (sdp.origin_user, sdp.session_id, sdp.session_version) == ("jdoe", 2890844526, 2890842807)
    audio, video = sdp.media
    assert (audio.address, audio.direction, audio.codecs) == ("224.2.17.12", "recvonly", (PCMU,))
    assert (video.direction, video.codecs) == ("recvonly", (Codec(99, "h263-1998", 90000),))
    reply, _, _ = _answered(RFC4566_5_EXAMPLE)
    assert [(m.port, m.direction) for m in reply.media[:1]] == [(30000, "sendonly")]
    assert (reply.media[1].port, reply.media[1].formats) == (0, ("99",))


def test_baresip_offer():
    sdp = parse(BARESIP)
    media = sdp.audio()
    assert media.codecs == (PCMU, PCMA, Codec(9, "G722", 8000), Codec(101, "telephone-event", 8000, fmtp="0-15"))
    assert (media.port, media.address, media.direction, media.ptime) == (10002, "192.168.1.42", "sendrecv", 20)
    text, codec, dtmf = answer(sdp, **US)
    assert (codec, dtmf) == (PCMU, Codec(101, "telephone-event", 8000, fmtp="0-15"))
    assert text == ("v=0\r\no=kame 42 1 IN IP4 192.0.2.1\r\ns=kame\r\nc=IN IP4 192.0.2.1\r\nt=0 0\r\n"
                    "m=audio 30000 RTP/AVP 0 101\r\na=rtpmap:0 PCMU/8000\r\na=rtpmap:101 telephone-event/8000\r\n"
                    "a=fmtp:101 0-15\r\na=ptime:20\r\na=sendrecv\r\n")


def test_g722_is_ours_when_we_say_so():
    reply, codec, dtmf = _answered(BARESIP, supported=("G722", "PCMU"))
    assert codec == PCMU  # the offerer's order, not ours: PCMU comes first in the offer
    reply, codec, dtmf = _answered(BARESIP, supported=("G722",))
    assert codec == Codec(9, "G722", 8000) and reply.media[0].codecs[0] == codec


def test_asterisk_offer_keeps_the_offerers_preference():
    """Session-level c= only; PCMA is listed first, so PCMA it is, though our own order puts PCMU first."""
    reply, codec, dtmf = _answered(ASTERISK)
    assert SUPPORTED[0] == "PCMU"
    assert (codec, dtmf) == (PCMA, Codec(101, "telephone-event", 8000, fmtp="0-16"))
    assert reply.media[0].codecs == (PCMA, Codec(101, "telephone-event", 8000, fmtp="0-16"))
    assert parse(ASTERISK).audio().address == "203.0.113.10"
    assert _answered(RFC4317_2_1_OFFER, supported=("PCMA", "PCMU"))[1] == PCMU


def test_freeswitch_offer():
    """opus and G722 passed over; the telephone-event whose clock matches the chosen codec's (8000, not 48000)."""
    sdp = parse(FREESWITCH)
    assert sdp.audio().codecs[0] == Codec(102, "OPUS", 48000, 2, "useinbandfec=1; maxaveragebitrate=30000; "
                                          "maxplaybackrate=48000; ptime=20; minptime=10; maxptime=40")
    reply, codec, dtmf = _answered(FREESWITCH)
    assert (codec, dtmf) == (PCMU, Codec(101, "telephone-event", 8000, fmtp="0-16"))
    assert reply.media[0].formats == ("0", "101")


@pytest.mark.parametrize(("offer_text", "mirrored"), [
    (ASTERISK_HOLD, "recvonly"),
    (ASTERISK.replace("a=sendrecv", "a=recvonly"), "sendonly"),
    (ASTERISK.replace("a=sendrecv", "a=inactive"), "inactive"),
    (ASTERISK, "sendrecv"),
    (ASTERISK.replace("a=sendrecv\r\n", ""), "sendrecv"),
])
def test_direction_is_mirrored(offer_text, mirrored):
    reply, _, _ = _answered(offer_text)
    assert reply.audio().direction == mirrored


def test_old_hold_keeps_the_zero_address():
    sdp = parse(OLD_HOLD)
    assert (sdp.audio().address, sdp.audio().direction) == ("0.0.0.0", "sendrecv")
    reply, codec, dtmf = _answered(OLD_HOLD)
    assert codec == PCMU and dtmf.payload_type == 101 and reply.audio().address == "192.0.2.1"


def test_video_second_audio_savp_and_fax_are_refused():
    """Video, a second audio stream, SRTP audio and T.38 fax each get port 0 and their first format, in place."""
    sdp = parse(VIDEO_AND_AUDIO)
    assert sdp.audio() == sdp.media[1]
    assert sdp.media[0].codecs[0] == Codec(96, "VP8", 90000)
    assert sdp.media[1].codecs[:2] == (Codec(96, "OPUS", 48000, 2, "useinbandfec=1"), Codec(97, "SPEEX", 16000))
    assert sdp.media[3].codecs == () and sdp.media[3].formats == ("t38",)
    text, codec, dtmf = answer(sdp, **US)
    assert (codec, dtmf) == (PCMU, Codec(101, "telephone-event", 8000))
    assert [line for line in text.split("\r\n") if line.startswith("m=")] == [
        "m=video 0 RTP/AVP 96", "m=audio 30000 RTP/AVP 0 101", "m=audio 0 RTP/SAVP 0", "m=image 0 udptl t38"]


@pytest.mark.parametrize(("offer_text", "named"), [
    (G729_ONLY, "G729"),
    (RFC4317_2_4_OFFER.replace("0 97", "97").replace("a=rtpmap:0 PCMU/8000\n", ""), "telephone-event"),
    (VIDEO_AND_AUDIO.replace("m=audio 7078 RTP/AVP 96 97 0 8 101", "m=audio 7078 RTP/AVP 96 97"), "RTP/SAVP"),
    (BARESIP.replace("m=audio 10002", "m=audio 0"), "PCMU"),  # the only stream with PCMU is disabled
])
def test_no_common_codec_names_what_was_offered(offer_text, named):
    with pytest.raises(NoCommonCodec, match=named) as caught:
        answer(parse(offer_text), **US)
    assert isinstance(caught.value, SdpError) and "PCMU, PCMA" in str(caught.value)


def test_static_payload_types_need_no_rtpmap():
    text = "v=0\no=- 1 1 IN IP4 192.0.2.5\ns=-\nc=IN IP4 192.0.2.5\nt=0 0\nm=audio 4000 RTP/AVP 9 18 3 13 96\n"
    codecs = parse(text).audio().codecs
    assert codecs == (Codec(9, "G722", 8000), Codec(18, "G729", 8000), Codec(3, "GSM", 8000), Codec(13, "CN", 8000))
    # 96 has no rtpmap: nothing we could choose, left out


def test_tolerated_variations():
    """LF or CRLF, blank lines, trailing and repeated spaces, unknown lines and attributes, a port count, IPv6."""
    text = ("v=0  \n\no=-   7  8 IN IP6 2001:db8::5\r\ns= \nt=0 0\nb=CT:128\nk=prompt\nz=0 0\n"
            "m=audio  5006/2 RTP/AVP  0 \r\nc=IN IP6 2001:db8::5\na=x-unknown:1\na=ptime:abc\na=rtcp-fb:0 nack\n"
            "a=mid:audio\n")
    media = parse(text).audio()
    assert (media.port, media.address, media.codecs, media.ptime) == (5006, "2001:db8::5", (PCMU,), None)
    reply, _, _ = _answered(text, address="2001:db8::1")
    assert reply.audio().address == "2001:db8::1"


def test_session_level_ptime_and_media_level_override():
    base = "v=0\no=- 1 1 IN IP4 192.0.2.5\ns=-\nc=IN IP4 192.0.2.5\nt=0 0\na=ptime:30\n"
    sdp = parse(base + "m=audio 4000 RTP/AVP 0\nm=audio 4002 RTP/AVP 8\na=ptime:10\na=inactive\n")
    assert [(m.ptime, m.direction) for m in sdp.media] == [(30, "sendrecv"), (10, "inactive")]


@pytest.mark.parametrize(("text", "message"), [
    ("", "no v= line"),
    ("hello world", "not <type>=<value>"),
    ("<html><body>404</body></html>", "not <type>=<value>"),
    ("INVITE sip:bob@example.com SIP/2.0\r\n", "not <type>=<value>"),
    ("o=- 1 1 IN IP4 192.0.2.5\nv=0\n", "starts with v=0"),
    ("v=1\n", "version '1'"),
    ("v=0\ns=-\nm=audio 4000 RTP/AVP 0\n", "no o= line"),
    ("v=0\no=- 1 1 IN IP4 192.0.2.5\ns=-\nc=IN IP4 192.0.2.5\nt=0 0\n", "no m= line"),
    ("v=0\no=- 1 IN IP4 192.0.2.5\n", "o="),
    ("v=0\no=- abc 1 IN IP4 192.0.2.5\n", "sess-id"),
    ("v=0\no=- 1 -1 IN IP4 192.0.2.5\n", "sess-version"),
    ("v=0\no=- " + "9" * 5000 + " 1 IN IP4 192.0.2.5\n", "sess-id"),
    (NO_CONNECTION, "no c= line"),
    (NO_CONNECTION.replace("t=0 0", "c=IN IP4"), "c="),
    (NO_CONNECTION.replace("t=0 0", "c=ATM NSAP 47.0005"), "c="),
    (NO_CONNECTION.replace("t=0 0", "c=IN IP4 /127"), "no address"),
    (G729_ONLY.replace("m=audio 5004 RTP/AVP 18", "m=audio 5004 RTP/AVP"), "m="),
    (G729_ONLY.replace("m=audio 5004", "m=audio five"), "port"),
    (G729_ONLY.replace("m=audio 5004", "m=audio 70000"), "port"),
    (G729_ONLY.replace("RTP/AVP 18", "RTP/AVP 18 x"), "payload type: 'x'"),
    (G729_ONLY.replace("RTP/AVP 18", "RTP/AVP 128"), "payload type"),
    (G729_ONLY.replace("a=rtpmap:18 G729/8000", "a=rtpmap:18 G729"), "a=rtpmap"),
    (G729_ONLY.replace("a=rtpmap:18 G729/8000", "a=rtpmap:18 G729/fast"), "clock rate"),
    (G729_ONLY.replace("a=rtpmap:18 G729/8000", "a=rtpmap:eighteen G729/8000"), "a=rtpmap"),
    (G729_ONLY.replace("s=-", "S=-"), "not <type>=<value>"),
])
def test_unreadable_sdp(text, message):
    with pytest.raises(SdpError, match=message):
        parse(text)


def test_size_is_bounded():
    padding = "a=x-pad:" + "p" * 100 + "\r\n"
    big = ASTERISK + padding * (MAX_SDP_BYTES // len(padding))
    assert len(big) > MAX_SDP_BYTES
    with pytest.raises(SdpError, match="over 16384 bytes"):
        parse(big)
    with pytest.raises(SdpError, match="over"):
        parse(ASTERISK.replace("s=Asterisk", "s=" + "\u00e9" * (MAX_SDP_BYTES // 2)))  # 2 bytes each in UTF-8
    assert parse(ASTERISK + padding * 10).audio().codecs[0] == PCMA


def test_codecs_for():
    assert codecs_for(("PCMU", "PCMA")) == (PCMU, PCMA, Codec(101, "telephone-event", 8000, fmtp="0-16"))
    assert codecs_for(("pcma", "G722"), dtmf=False) == (PCMA, Codec(9, "G722", 8000))
    with pytest.raises(ValueError, match="'OPUS' has no static RTP payload type"):
        codecs_for(("OPUS",))


def test_our_offer_reads_back():
    codecs = codecs_for(("PCMU", "PCMA"))
    text = offer(address="192.0.2.1", port=30000, session_id=7, session_version=8, codecs=codecs,
                 direction="sendonly", ptime=20)
    assert text.endswith("\r\n")
    sdp = parse(text)
    assert (sdp.origin_user, sdp.session_id, sdp.session_version, sdp.origin_address) == ("kame", 7, 8, "192.0.2.1")
    (media,) = sdp.media
    assert (media.kind, media.port, media.proto, media.codecs) == ("audio", 30000, "RTP/AVP", codecs)
    assert (media.address, media.direction, media.ptime) == ("192.0.2.1", "sendonly", 20)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"direction": "both"}, "direction"),
    ({"codecs": ()}, "codecs"),
    ({"port": 0}, "port"),
    ({"port": 70000}, "port"),
    ({"address": ""}, "address"),
    ({"session_id": -1}, "session_id"),
])
def test_offer_arguments(kwargs, message):
    fields = US | {"codecs": codecs_for(("PCMU",))} | kwargs
    with pytest.raises(ValueError, match=message):
        offer(**fields)


def test_negotiated_from_rfc_answers():
    ours = codecs_for(("PCMU", "PCMA"))
    assert negotiated(parse(RFC4317_2_1_ANSWER), ours) == (PCMU, None)
    # 2.3: the answer's payload type (99) is the one to send, not the offer's (97)
    assert negotiated(parse(RFC4317_2_3_ANSWER), (Codec(97, "iLBC", 8000),)) == (Codec(99, "ILBC", 8000), None)
    with pytest.raises(NoCommonCodec, match="ILBC"):
        negotiated(parse(RFC4317_2_3_ANSWER), ours)


def test_negotiated_takes_the_answers_payload_types():
    """A phone's answer may number telephone-event differently from our offer; we send with its numbers."""
    their_answer = """\
v=0\r
o=- 99 99 IN IP4 198.51.100.7\r
s=-\r
c=IN IP4 198.51.100.7\r
t=0 0\r
m=audio 16384 RTP/AVP 8 96\r
a=rtpmap:8 PCMA/8000\r
a=rtpmap:96 telephone-event/8000\r
a=fmtp:96 0-15\r
a=ptime:20\r
"""
    codec, dtmf = negotiated(parse(their_answer), codecs_for(("PCMU", "PCMA")))
    assert (codec, dtmf) == (PCMA, Codec(96, "telephone-event", 8000, fmtp="0-15"))
    assert negotiated(parse(their_answer), codecs_for(("PCMA",), dtmf=False)) == (PCMA, None)
    refused = their_answer.replace("m=audio 16384", "m=audio 0")
    with pytest.raises(NoCommonCodec, match="no audio stream"):
        negotiated(parse(refused), codecs_for(("PCMA",)))


# --- randomized: shuffled codec lists, with and without rtpmap, directions, line ends ---

POOL = [(0, "PCMU/8000"), (8, "PCMA/8000"), (9, "G722/8000"), (18, "G729/8000"), (3, "GSM/8000"),
        (97, "iLBC/8000"), (111, "opus/48000/2"), (101, "telephone-event/8000")]


def _random_offer(rng: random.Random) -> tuple[str, list[tuple[int, str]], str | None]:
    chosen = rng.sample(POOL, rng.randint(1, len(POOL)))
    direction = rng.choice([None, "sendrecv", "sendonly", "recvonly", "inactive"])
    lines = ["v=0", f"o=- {rng.randint(0, 2**40)} 1 IN IP4 192.0.2.9", "s=-", "c=IN IP4 192.0.2.9", "t=0 0",
             f"m=audio {rng.randint(1024, 65535)} RTP/AVP {' '.join(str(pt) for pt, _ in chosen)}"]
    for payload_type, mapping in chosen:
        if payload_type >= 96 or rng.random() < 0.5:  # static types only sometimes mapped
            lines.append(f"a=rtpmap:{payload_type} {mapping}")
        if mapping.startswith("telephone-event"):
            lines.append(f"a=fmtp:{payload_type} 0-15")
    if direction:
        lines.append(f"a={direction}")
    end = rng.choice(["\r\n", "\n"])
    return end.join(lines) + end, chosen, direction


def test_randomized_offers():
    rng = random.Random(3264)
    mirrored = {None: "sendrecv", "sendrecv": "sendrecv", "sendonly": "recvonly", "recvonly": "sendonly",
                "inactive": "inactive"}
    for _ in range(400):
        text, chosen, direction = _random_offer(rng)
        supported = tuple(rng.sample(["PCMU", "PCMA", "G722", "OPUS"], rng.randint(1, 4)))
        names = [mapping.split("/")[0].upper() for _, mapping in chosen]
        expected = next((name for name in names if name in supported), None)
        if expected is None:
            with pytest.raises(NoCommonCodec):
                answer(parse(text), **US, supported=supported)
            continue
        reply, codec, dtmf = _answered(text, supported=supported)
        assert codec.name == expected, (text, supported)
        has_dtmf = any(pt == 101 for pt, _ in chosen) and codec.clock_rate == 8000
        assert (dtmf is not None) == has_dtmf
        media = reply.audio()
        assert media.codecs == ((codec, dtmf) if dtmf else (codec,))
        assert (media.port, media.direction, media.ptime) == (US["port"], mirrored[direction], 20)


def test_g722_written_at_its_sample_rate_keeps_its_8000_clock_and_the_digits():
    """baresip writes `G722/16000`; G.722's RTP clock is 8000 (RFC 3551 §4.5.2), so telephone-event/8000 pairs
    with it and the caller's digits stay negotiated."""
    offer = parse("v=0\r\no=- 1 1 IN IP4 192.0.2.2\r\ns=-\r\nc=IN IP4 192.0.2.2\r\nt=0 0\r\n"
                  "m=audio 40000 RTP/AVP 9 101\r\na=rtpmap:9 G722/16000\r\na=rtpmap:101 telephone-event/8000\r\n"
                  "a=fmtp:101 0-15\r\na=ptime:20\r\n")
    _, codec, dtmf = answer(offer, address="192.0.2.1", port=5000, session_id=1, session_version=1,
                            supported=("PCMU", "PCMA", "G722"))
    assert (codec.name, codec.clock_rate) == ("G722", 8000)
    assert dtmf is not None and dtmf.payload_type == 101
