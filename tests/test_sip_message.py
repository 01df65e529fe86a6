"""SIP messages (kame/sip/message.py) against RFC 4475's torture tests, written out by hand from the RFC (§3.1.1
valid, §3.1.2 and §3.3 invalid or semantically odd), plus compact forms, list headers, round trips, stream framing
and a randomized check that garbled messages raise SipError and nothing else.

Each RFC fixture below is typed as the RFC prints it (LF line ends here, CRLF on the wire); bodies are the RFC's
SDP where its Content-Length can be checked, or a body whose length the fixture computes. Where the RFC calls a
message invalid and our parser accepts it on purpose, the test says `lenient` and why it does no harm."""

from __future__ import annotations

import random

import pytest

from kame.sip.message import (
    MAX_MESSAGE_BYTES,
    REASONS,
    NameAddr,
    Request,
    Response,
    SipError,
    SipUri,
    StreamFramer,
    Via,
    parse,
    response_to,
    split_list,
)


def wire(text: str, body: bytes = b"") -> bytes:
    """The header section as typed (LF, one leading newline allowed) with CRLF line ends, the empty line, the body."""
    head = text.strip("\n").replace("\n", "\r\n")
    return head.encode("utf-8") + b"\r\n\r\n" + body


def sdp(host: str, origin: str = "mhandley 29739 7272939") -> bytes:
    """The SDP body most of RFC 4475's INVITEs carry (150 bytes with 192.0.2.x hosts of one digit)."""
    return (f"v=0\r\no={origin} IN IP4 {host}\r\ns=-\r\nc=IN IP4 {host}\r\nt=0 0\r\n"
            "m=audio 49217 RTP/AVP 0 12\r\nm=video 3227 RTP/AVP 31\r\na=rtpmap:31 LPC\r\n").encode()


def request(data: bytes) -> Request:
    message = parse(data)
    assert isinstance(message, Request)
    return message


def response(data: bytes) -> Response:
    message = parse(data)
    assert isinstance(message, Response)
    return message


# ---------------------------------------------------------------- RFC 4475 §3.1.1: valid messages

# §3.1.1.1 wsinv, "A Short Tortuous INVITE": folding, odd case, whitespace around every separator
WSINV = wire('''
INVITE sip:vivekg@chair-dnrc.example.com;unknownparam SIP/2.0
TO :
 sip:vivekg@chair-dnrc.example.com ;   tag    = 1918181833n
from   : "J Rosenberg \\\\\\""       <sip:jdrosen@example.com>
  ;
  tag = 98asjd8
MaX-fOrWaRdS: 0068
Call-ID: wsinv.ndaksdj@192.0.2.1
Content-Length   : 150
cseq: 0009
  INVITE
Via  : SIP  /   2.0
 /UDP
    192.0.2.2;branch=390skdjuw
s :
NewFangledHeader:   newfangled value
 continued newfangled value
UnknownHeaderWithUnusualValue: ;;,,;;,;
Content-Type: application/sdp
Route:
 <sip:services.example.com;lr;unknownwith=value;unknown-no-value>
v:  SIP  / 2.0  / TCP     spindle.example.com   ;
  branch  =   z9hG4bK9ikj8  ,
 SIP  /    2.0   / UDP  192.168.255.111   ; branch=
 z9hG4bK30239
m:"Quoted string \\"\\"" <sip:jdrosen@example.com> ; newparam =
      newvalue ;
  secondparam ; q = 0.33
''', sdp("192.0.2.3").replace(b"c=IN IP4 192.0.2.3", b"c=IN IP4 192.0.2.4"))

# §3.1.1.2 intmeth, "Wide Range of Valid Characters": every token character, escaped controls in a quoted string
# (BEL, NUL and DEL after backslashes), UTF-8 in a quoted parameter and a BOM-led extension header value
INTMETH_METHOD = "!interesting-Method0123456789_*+`.%indeed'~"
INTMETH_USER = "1_unusual.URI~(to-be!sure)&isn't+it$/crazy?,/;;*"
INTMETH = wire(
    f"{INTMETH_METHOD} sip:1_unusual.URI~(to-be!sure)&isn't+it$/crazy?,/;;*:&it+has=1,weird!*pas$wo~d_too."
    "(doesn't-it)@example.com SIP/2.0\n"
    "Via: SIP/2.0/TCP host1.example.com;branch=z9hG4bK-.!%66*_+`'~\n"
    f'To: "BEL:\\\x07 NUL:\\\x00 DEL:\\\x7f" <sip:{INTMETH_USER}@example.com>\n'
    "From: token1~` token2'+_ token3*%!.- <sip:mundane@example.com>;fromParam''~+*_!.-%=\"работающий\";"
    "tag=_token~1'+`*%!-.\n"
    "Call-ID: intmeth.word%ZK-!.*_+'@word`~)(><:\\/\"][?}{\n"
    f"CSeq: 139122385 {INTMETH_METHOD}\n"
    "Max-Forwards: 255\n"
    "extensionHeader-!.%*+_`'~:\ufeff大停電\n"
    "Content-Length: 0\n")

# §3.1.1.3 esc01, "Valid Use of the % Escaping Mechanism": escapes are kept as written (compared escaped)
ESC01 = wire('''
INVITE sip:sips%3Auser%40example.com@example.net SIP/2.0
To: sip:%75se%72@example.com
From: <sip:I%20have%20spaces@example.net>;tag=938
Max-Forwards: 87
i: esc01.239409asdfakjkn23onasd0-3234
CSeq: 234234 INVITE
Via: SIP/2.0/UDP host5.example.net;branch=z9hG4bKkdjuw
C: application/sdp
Contact:
  <sip:cal%6Cer@host5.example.net;%6C%72;n%61me=v%61lue%25%34%31>
Content-Length: 150
''', sdp("192.0.2.1"))

# §3.1.1.4 escnull, "Escaped Nulls in URIs"
ESCNULL = wire('''
REGISTER sip:example.com SIP/2.0
To: sip:null-%00-null@example.com
From: sip:null-%00-null@example.com;tag=839923423
Max-Forwards: 70
Call-ID: escnull.39203ndfvkjdasfkq3w4otrq0adsf
CSeq: 3923239 REGISTER
Via: SIP/2.0/UDP host5.example.com;branch=z9hG4bKkdjuw
Contact: <sip:%00@host5.example.com>
Contact: <sip:%00%00@host5.example.com>
L:0
''')

# §3.1.1.6 lwsdisp, "No LWS between Display Name and <"
LWSDISP = wire('''
OPTIONS sip:user@example.com SIP/2.0
To: sip:user@example.com
From: caller<sip:caller@example.com>;tag=323
Max-Forwards: 70
Call-ID: lwsdisp.1234abcd@funky.example.com
CSeq: 60 OPTIONS
Via: SIP/2.0/UDP funky.example.com;branch=z9hG4bKkdjuw
l: 0
''')


def longreq() -> bytes:
    """§3.1.1.7 longreq, "Long Values in Header Fields": the RFC's shape (a long display name right before '<', long
    URI parameters, a long tag, Call-ID and unknown header, many Via fields in full and compact form, some upper-case
    'V'), its long runs written as repetitions rather than typed out."""
    extreme = "extreme" * 10
    vias = []
    for number in range(33, 0, -1):
        name = ("Via", "v", "V")[number % 3]
        vias.append(f"{name}: SIP/2.0/TCP sip{number}.example.com")
    caller = "amazinglylongcallername" * 8
    return wire(
        "INVITE sip:user@example.com SIP/2.0\n"
        f'To: "I have a user name of {extreme} proportion"<sip:user@example.com:6000;'
        f"unknownparam1=very{'long' * 40}value;longparam{'name' * 30}=shortvalue;"
        f"verylonngparameternamewithnovalue>\n"
        f"F: sip:{caller}@example.net;tag={'1298' * 30};unknownheaderparam{'name' * 25}="
        f"unknowheaderparam{'value' * 20};unknownValueless{'paramname' * 10}\n"
        f"Call-ID: longreq.one{'really' * 50}longcallid\n"
        "CSeq: 3882340 INVITE\n"
        f"Unknown-{'Long' * 20}-Name: unknown-{'long' * 20}-value; unknown-{'long' * 20}-parameter-name = "
        f"unknown-{'long' * 20}-parameter-value\n"
        + "\n".join(vias) + "\n"
        "Max-Forwards: 70\n"
        f"Contact: <sip:{caller}@host5.example.net>\n"
        "Content-Type: application/sdp\n"
        "l: 150\n", sdp("192.0.2.1"))


LONGREQ = longreq()

# §3.1.1.8 dblreq, "Extra Trailing Octets in a UDP Datagram": a REGISTER (Content-Length: 0), then an INVITE
DBLREQ_REGISTER = wire('''
REGISTER sip:example.com SIP/2.0
To: sip:j.user@example.com
From: sip:j.user@example.com;tag=43251j3j324
Max-Forwards: 8
I: dblreq.0ha0isndaksdj99sdfafnl3lk233412
Contact: sip:j.user@host.example.com
CSeq: 8 REGISTER
Via: SIP/2.0/UDP 192.0.2.125;branch=z9hG4bKkdjuw23492
Content-Length: 0
''')
DBLREQ_INVITE = wire('''
INVITE sip:joe@example.com SIP/2.0
t: sip:joe@example.com
From: sip:caller@example.net;tag=141334
Max-Forwards: 8
Call-ID: dblreq.0ha0isnda977644900765@192.0.2.15
CSeq: 8 INVITE
Via: SIP/2.0/UDP 192.0.2.15;branch=z9hG4bKkdjuw380234
Content-Type: application/sdp
Content-Length: 150
''', sdp("192.0.2.5"))
DBLREQ = DBLREQ_REGISTER + b"\r\n" + DBLREQ_INVITE

# §3.1.1.9 semiuri, "Semicolon-Separated Parameters in URI User Part"
SEMIURI = wire('''
OPTIONS sip:user;par=u%40example.net@example.com SIP/2.0
To: sip:j_user@example.com
From: sip:caller@example.org;tag=33242
Max-Forwards: 3
Call-ID: semiuri.0ha0isndaksdj
CSeq: 8 OPTIONS
Accept: application/sdp, application/pkcs7-mime,
        multipart/mixed, multipart/signed,
        message/sip, message/sipfrag
Via: SIP/2.0/UDP 192.0.2.1;branch=z9hG4bKkdjuw
l: 0
''')

# §3.1.1.10 transports, "Varied and Unknown Transport Types"
TRANSPORTS = wire('''
OPTIONS sip:user@example.com SIP/2.0
To: sip:user@example.com
From: <sip:caller@example.com>;tag=323
Max-Forwards: 70
Call-ID:  transports.kijh4akdnaqjkwendsasfdj
Accept: application/sdp
CSeq: 60 OPTIONS
Via: SIP/2.0/UDP t1.example.com;branch=z9hG4bKkdjuw
Via: SIP/2.0/SCTP t2.example.com;branch=z9hG4bKklasjdhf
Via: SIP/2.0/TLS t3.example.com;branch=z9hG4bK2980unddj
Via: SIP/2.0/UNKNOWN t4.example.com;branch=z9hG4bKasd0f3en
Via: SIP/2.0/TCP t5.example.com;branch=z9hG4bK0a9idfnee
l: 0
''')

# §3.1.1.11 mpart01, "Multipart MIME Message": the RFC's headers; its binary signature part stood in for by
# bytes that are not UTF-8 and hold an empty line of their own (the body is never decoded, nor split there)
MPART01_BODY = (b"--7a9cbec02ceef655\r\nContent-Type: text/plain\r\nContent-Transfer-Encoding: binary\r\n\r\n"
                b"Hello\r\n--7a9cbec02ceef655\r\nContent-Type: application/octet-stream\r\n"
                b"Content-Transfer-Encoding: binary\r\n\r\n0\x82\x01R\x06\t*\x86H\x86\xf7\r\n\r\n\x01\x07\x02\xa0"
                + bytes(range(256)) + b"\r\n--7a9cbec02ceef655--\r\n")
MPART01 = wire(f'''
MESSAGE sip:kumiko@example.org SIP/2.0
Via: SIP/2.0/UDP 127.0.0.1:5070;branch=z9hG4bK-d87543-4dade06d0bdb11ee-1--d87543-;rport
Max-Forwards: 70
Route: <sip:127.0.0.1:5080>
Identity: r5mwreLuyDRYBi/0TiPwEsY3rEVsk/G2WxhgTV1PF7hHuLIK0YWVKZhKv9Mj8UeXqkMVbnVq37CD+813gvYjcBUaZngQmXc9WNZSDNGCzA+fWl9MEUHWIZo1CeJebdY/XlgKeTa0Olvq0rt70Q5jiSfbqMJmQFteeivUhkMWYUA=
Contact: <sip:fluffy@127.0.0.1:5070>
To: <sip:kumiko@example.org>
From: <sip:fluffy@example.com>;tag=2fb0dcc9
Call-ID: 3d9485ad0c49859b@Zmx1ZmZ5LW1hYy0xNi5sb2NhbA..
CSeq: 1 MESSAGE
Content-Transfer-Encoding: binary
Content-Type: multipart/mixed;boundary=7a9cbec02ceef655
Date: Sat, 15 Oct 2005 04:44:56 GMT
User-Agent: SIPimp.org/0.2.5 (curses)
Content-Length: {len(MPART01_BODY)}
''', MPART01_BODY)  # noqa: E501 (the Identity value is one line in the RFC)

# §3.1.1.12 unreason, "Unusual Reason Phrase": UTF-8 and odd characters in the reason phrase
UNREASON_PHRASE = "= 2**3 * 5**2 но сто девяносто девять - простое"
UNREASON_BODY = (b"v=0\r\no=- 3149328700 0 IN IP4 192.0.2.198\r\ns=-\r\nc=IN IP4 192.0.2.198\r\nt=0 0\r\n"
                 b"m=audio 3456 RTP/AVP 0\r\na=rtpmap:0 PCMU/8000\r\n")
UNREASON = wire(f'''
SIP/2.0 200 {UNREASON_PHRASE}
Via: SIP/2.0/UDP 192.0.2.198;branch=z9hG4bK1324923
Call-ID: unreason.1234ksdfak3j2erwedfsASdf
CSeq: 35 INVITE
From: sip:user@example.com;tag=11141343
To: sip:user@example.edu;tag=2229
Content-Length: {len(UNREASON_BODY)}
Content-Type: application/sdp
Contact: <sip:user@host198.example.com>
''', UNREASON_BODY)

# §3.1.1.13 noreason, "Empty Reason Phrase" (the SP after the code is there, nothing after it)
NOREASON = wire('''
SIP/2.0 100\x20
Via: SIP/2.0/UDP 192.0.2.105;branch=z9hG4bK2398ndaoe
Call-ID: noreason.asndj203insdf99223ndf
CSeq: 35 INVITE
From: <sip:user@example.com>;tag=39ansfi3
To: <sip:user@example.edu>;tag=902jndnke3
Content-Length: 0
Contact: <sip:user@host105.example.com>
''')

# RFC 3261 §4: Alice's INVITE to Bob (F1 of the SIP trapezoid), with a body of our own
RFC3261_F1 = wire('''
INVITE sip:bob@biloxi.com SIP/2.0
Via: SIP/2.0/UDP pc33.atlanta.com;branch=z9hG4bK776asdhds
Max-Forwards: 70
To: Bob <sip:bob@biloxi.com>
From: Alice <sip:alice@atlanta.com>;tag=1928301774
Call-ID: a84b4c76e66710@pc33.atlanta.com
CSeq: 314159 INVITE
Contact: <sip:alice@pc33.atlanta.com>
Content-Type: application/sdp
Content-Length: 150
''', sdp("192.0.2.1"))

VALID = {"wsinv": WSINV, "intmeth": INTMETH, "esc01": ESC01, "escnull": ESCNULL, "lwsdisp": LWSDISP,
         "longreq": LONGREQ, "dblreq": DBLREQ, "semiuri": SEMIURI, "transports": TRANSPORTS, "mpart01": MPART01,
         "unreason": UNREASON, "noreason": NOREASON, "rfc3261_f1": RFC3261_F1}


def test_bodies_have_the_rfc_lengths():
    """The SDP typed here is the RFC's: 150 bytes where its INVITEs say so, 152 with a two-digit host."""
    assert len(sdp("192.0.2.1")) == 150
    assert len(sdp("192.0.2.15")) == 152


def test_wsinv_short_tortuous_invite():
    message = request(WSINV)
    assert (message.method, message.uri) == ("INVITE", "sip:vivekg@chair-dnrc.example.com;unknownparam")
    assert message.cseq == (9, "INVITE")  # "0009\r\n  INVITE" unfolded
    assert message.headers.get("Max-Forwards") == "0068"
    assert message.call_id == "wsinv.ndaksdj@192.0.2.1"
    to = NameAddr.parse(message.headers.get("To") or "")
    assert (to.uri, to.tag) == ("sip:vivekg@chair-dnrc.example.com", "1918181833n")
    sender = NameAddr.parse(message.headers.get("From") or "")
    assert sender.display == 'J Rosenberg \\"'  # the quoted-string's content, its escapes undone
    assert (sender.uri, sender.tag) == ("sip:jdrosen@example.com", "98asjd8")
    vias = [Via.parse(value) for value in message.headers.all("Via")]
    assert [(via.transport, via.host, via.port, via.branch) for via in vias] == [
        ("UDP", "192.0.2.2", None, "390skdjuw"),
        ("TCP", "spindle.example.com", None, "z9hG4bK9ikj8"),
        ("UDP", "192.168.255.111", None, "z9hG4bK30239")]
    assert message.top_via.branch == "390skdjuw"
    assert message.headers.get("Subject") == ""
    assert message.headers.get("NewFangledHeader") == "newfangled value continued newfangled value"
    assert message.headers.get("UnknownHeaderWithUnusualValue") == ";;,,;;,;"  # not a list header: kept whole
    assert message.headers.all("Route") == ["<sip:services.example.com;lr;unknownwith=value;unknown-no-value>"]
    contact = NameAddr.parse(message.headers.get("Contact") or "")
    assert contact.display == 'Quoted string ""'
    assert contact.params == {"newparam": "newvalue", "secondparam": "", "q": "0.33"}
    assert len(message.body) == 150 and message.body.startswith(b"v=0\r\n") and message.body.endswith(b"LPC\r\n")


def test_intmeth_wide_range_of_valid_characters():
    """Methods are case-sensitive in RFC 3261 (§7.1); ours are upper-cased on reading, CSeq's as well, so the two
    still compare equal. Lenient and harmless: we answer only methods we know, all upper-case anyway."""
    message = request(INTMETH)
    assert message.method == INTMETH_METHOD.upper()
    assert message.cseq == (139122385, INTMETH_METHOD.upper())
    assert message.uri.endswith("(doesn't-it)@example.com")
    assert message.top_via.branch == "z9hG4bK-.!%66*_+`'~"
    to = NameAddr.parse(message.headers.get("To") or "")
    assert to.display == "BEL:\x07 NUL:\x00 DEL:\x7f"
    uri = SipUri.parse(to.uri)
    assert (uri.user, uri.host) == (INTMETH_USER, "example.com")  # ';', '?' and ',' belong to the user part
    sender = NameAddr.parse(message.headers.get("From") or "")
    assert sender.display == "token1~` token2'+_ token3*%!.-"
    assert sender.tag == "_token~1'+`*%!-."
    assert sender.params["fromparam''~+*_!.-%"] == "работающий"
    assert message.call_id == "intmeth.word%ZK-!.*_+'@word`~)(><:\\/\"][?}{"
    assert message.headers.get("extensionHeader-!.%*+_`'~") == "\ufeff大停電"


def test_esc01_escapes_kept_as_written():
    message = request(ESC01)
    assert SipUri.parse(message.uri).user == "sips%3Auser%40example.com"
    assert SipUri.parse(message.uri).host == "example.net"
    assert SipUri.parse(message.headers.get("To") or "").user == "%75se%72"
    assert message.call_id == "esc01.239409asdfakjkn23onasd0-3234"
    assert message.headers.get("Content-Type") == "application/sdp"  # "C:" is Content-Type's compact form
    contact = SipUri.parse(NameAddr.parse(message.headers.get("Contact") or "").uri)
    assert contact.user == "cal%6Cer" and contact.params == {"%6c%72": "", "n%61me": "v%61lue%25%34%31"}
    assert len(message.body) == 150


def test_escnull_escaped_nulls():
    message = request(ESCNULL)
    assert message.method == "REGISTER"
    assert [NameAddr.parse(value).uri for value in message.headers.all("Contact")] == [
        "sip:%00@host5.example.com", "sip:%00%00@host5.example.com"]
    assert message.body == b""


def test_lwsdisp_no_space_before_angle_bracket():
    sender = NameAddr.parse(request(LWSDISP).headers.get("From") or "")
    assert (sender.display, sender.uri, sender.tag) == ("caller", "sip:caller@example.com", "323")


def test_longreq_long_values():
    message = request(LONGREQ)
    assert len(message.headers.all("Via")) == 33
    assert [Via.parse(value).host for value in message.headers.all("Via")][:2] == [
        "sip33.example.com", "sip32.example.com"]
    to = NameAddr.parse(message.headers.get("To") or "")
    assert to.display == f"I have a user name of {'extreme' * 10} proportion"
    uri = SipUri.parse(to.uri)
    assert (uri.host, uri.port, uri.params[f"longparam{'name' * 30}"]) == ("example.com", 6000, "shortvalue")
    assert "verylonngparameternamewithnovalue" in uri.params
    sender = NameAddr.parse(message.headers.get("From") or "")
    assert sender.tag == "1298" * 30  # addr-spec form: the parameters are the header's
    assert sender.params[f"unknownvalueless{'paramname' * 10}"] == ""
    assert message.headers.get(f"Unknown-{'Long' * 20}-Name", "").endswith("-parameter-value")
    assert len(message.body) == 150


def test_dblreq_datagram_keeps_the_first_message_only():
    message = request(DBLREQ)  # as a datagram: Content-Length: 0 ends it; the INVITE after it is not read
    assert message.method == "REGISTER" and message.body == b""
    assert message.call_id == "dblreq.0ha0isndaksdj99sdfafnl3lk233412"


def test_dblreq_on_a_stream_is_two_messages():
    messages = list(StreamFramer().feed(DBLREQ))
    assert [message.method for message in messages] == ["REGISTER", "INVITE"]
    assert messages[1].headers.get("To") == "sip:joe@example.com" and len(messages[1].body) == 150


def test_semiuri_semicolons_in_the_user_part():
    message = request(SEMIURI)
    uri = SipUri.parse(message.uri)
    assert (uri.user, uri.host, uri.params) == ("user;par=u%40example.net", "example.com", {})
    assert message.headers.all("Accept") == ["application/sdp", "application/pkcs7-mime", "multipart/mixed",
                                             "multipart/signed", "message/sip", "message/sipfrag"]


def test_transports_varied_and_unknown():
    vias = [Via.parse(value) for value in request(TRANSPORTS).headers.all("Via")]
    assert [via.transport for via in vias] == ["UDP", "SCTP", "TLS", "UNKNOWN", "TCP"]
    assert [via.host for via in vias] == [f"t{number}.example.com" for number in range(1, 6)]


def test_mpart01_binary_multipart_body():
    message = request(MPART01)
    assert message.body == MPART01_BODY  # byte for byte, its own empty line and non-UTF-8 bytes included
    assert message.headers.get("Content-Type") == "multipart/mixed;boundary=7a9cbec02ceef655"
    assert message.top_via.params == {"branch": "z9hG4bK-d87543-4dade06d0bdb11ee-1--d87543-", "rport": ""}
    assert (message.top_via.host, message.top_via.port) == ("127.0.0.1", 5070)


def test_unreason_unusual_reason_phrase():
    message = response(UNREASON)
    assert (message.status, message.reason) == (200, UNREASON_PHRASE)
    assert message.cseq == (35, "INVITE") and message.body == UNREASON_BODY


def test_noreason_empty_reason_phrase():
    message = response(NOREASON)
    assert (message.status, message.reason) == (100, "")
    without_space = response(NOREASON.replace(b"SIP/2.0 100 \r\n", b"SIP/2.0 100\r\n"))  # no SP at all: lenient
    assert (without_space.status, without_space.reason) == (100, "")


# ---------------------------------------------------------------- RFC 4475 §3.1.2 and §3.3: invalid messages

# §3.1.2.1 badinv01, "Extraneous Header Field Separators"
BADINV01 = wire('''
INVITE sip:user@example.com SIP/2.0
To: sip:j.user@example.com
From: sip:caller@example.net;tag=134161461246
Max-Forwards: 7
Call-ID: badinv01.0ha0isndaksdjasdf3234nas
CSeq: 8 INVITE
Via: SIP/2.0/UDP 192.0.2.15;;,;,,
Contact: "Joe" <sip:joe@example.org>;;;;
Content-Length: 152
Content-Type: application/sdp
''', sdp("192.0.2.15"))

# §3.1.2.2 clerr, "Content Length Larger Than Message"
CLERR = wire('''
INVITE sip:user@example.com SIP/2.0
Max-Forwards: 80
To: sip:j.user@example.com
From: sip:caller@example.net;tag=93942939o2
Contact: <sip:caller@hungry.example.net>
Call-ID: clerr.0ha0isndaksdjweiafasdk3
CSeq: 8 INVITE
Via: SIP/2.0/UDP host5.example.com;branch=z9hG4bK-39234-23523
Content-Type: application/sdp
Content-Length: 9999
''', sdp("192.0.2.155"))

# §3.1.2.3 scalar02, "Negative Content-Length"
SCALAR02 = wire('''
INVITE sip:user@example.com SIP/2.0
Via: SIP/2.0/UDP host5.example.net;branch=z9hG4bK-39234-23523
Max-Forwards: 70
From: sip:caller@example.net;tag=2234923
To: sip:user@example.com
Call-ID: scalar02.23o0pd9vanlq3wnrlnewofjas9ui32
CSeq: 300 INVITE
Contact: <sip:caller@host5.example.net>
Content-Type: application/sdp
Content-Length: -999
''', sdp("192.0.2.1"))

# §3.1.2.4 scalarlg, "Request Scalar Fields with Overlarge Values"
SCALARLG = wire('''
REGISTER sip:example.com SIP/2.0
Via: SIP/2.0/TCP host129.example.com;branch=z9hG4bK342sdfoi3
To: <sip:user@example.com>
From: <sip:user@example.com>;tag=239232jh3
CSeq: 36893488147419103232 REGISTER
Call-ID: scalarlg.98asdh@192.0.2.1
Max-Forwards: 300
Expires: 1000000000000000000000000000000000000000000000000
Contact: <sip:user@host129.example.com>
  ;expires=280297596632815
Content-Length: 0
''')

# §3.1.2.5 quotbal, "Unterminated Quoted String in Display Name"
QUOTBAL = wire('''
INVITE sip:user@example.com SIP/2.0
To: "Mr. J. User <sip:j.user@example.com>
From: sip:caller@example.net;tag=93334
Max-Forwards: 10
Call-ID: quotbal.aksdj
Contact: <sip:caller@host59.example.net>
CSeq: 8 INVITE
Via: SIP/2.0/UDP 192.0.2.15:5060;branch=z9hG4bKkdjuw
Content-Type: application/sdp
Content-Length: 152
''', sdp("192.0.2.15"))

# §3.1.2.6 ltgtruri, "<> Enclosing Request-URI"
LTGTRURI = wire('''
INVITE <sip:user@example.com> SIP/2.0
To: sip:user@example.com
From: sip:caller@example.net;tag=39291
Max-Forwards: 23
Call-ID: ltgtruri.1@192.0.2.5
CSeq: 1 INVITE
Via: SIP/2.0/UDP 192.0.2.5
Contact: <sip:caller@host5.example.net>
Content-Type: application/sdp
Content-Length: 150
''', sdp("192.0.2.5"))

# §3.1.2.7 lwsruri, "Malformed SIP Request-URI (embedded LWS)"
LWSRURI = wire('''
INVITE sip:user@example.com; lr SIP/2.0
To: sip:user@example.com;tag=3xfe-9921883-z9f
From: sip:caller@example.net;tag=231413434
Max-Forwards: 5
Call-ID: lwsruri.asdfasdoeoi2323-asdfwrn23-asd834rk423
CSeq: 2130706432 INVITE
Via: SIP/2.0/UDP 192.0.2.1:5060;branch=z9hG4bKkdjuw2395
Contact: <sip:caller@host1.example.net>
Content-Type: application/sdp
Content-Length: 150
''', sdp("192.0.2.1"))

# §3.1.2.8 lwsstart, "Multiple SP Separating Request-Line Elements"
LWSSTART = wire('''
INVITE  sip:user@example.com  SIP/2.0
Max-Forwards: 8
To: sip:user@example.com
From: sip:caller@example.net;tag=8814
Call-ID: lwsstart.dfknq234oi243099adsdfnawe3@example.com
CSeq: 1893884 INVITE
Via: SIP/2.0/UDP host1.example.com;branch=z9hG4bKkdjuw3923
Contact: <sip:caller@host1.example.net>
Content-Type: application/sdp
Content-Length: 150
''', sdp("192.0.2.1"))

# §3.1.2.9 trws, "SP Characters at End of Request-Line" (two SPs after SIP/2.0)
TRWS = wire('''
OPTIONS sip:remote-target@example.com SIP/2.0\x20\x20
Via: SIP/2.0/TCP host1.example.com;branch=z9hG4bK299342093
To: <sip:remote-target@example.com>
From: <sip:local-resource@example.com>;tag=329429089
Call-ID: trws.oicu34958239neffasdhr2345r
Accept: application/sdp
CSeq: 238923 OPTIONS
Max-Forwards: 70
Content-Length: 0
''')

# §3.1.2.11 baddate, "Invalid Time Zone in Date Header Field"
BADDATE = wire('''
INVITE sip:user@example.com SIP/2.0
To: sip:user@example.com
From: sip:caller@example.net;tag=2234923
Max-Forwards: 70
Call-ID: baddate.239423mnsadf3j23lj42--sedfnm234
CSeq: 1392934 INVITE
Via: SIP/2.0/UDP host.example.com;branch=z9hG4bKkdjuw
Date: Fri, 01 Jan 2010 16:00:00 EST
Contact: <sip:caller@host5.example.net>
Content-Type: application/sdp
Content-Length: 150
''', sdp("192.0.2.5"))

# §3.1.2.12 regbadct, "Failure to Enclose name-addr URI in <>"
REGBADCT = wire('''
REGISTER sip:example.com SIP/2.0
To: sip:user@example.com
From: sip:user@example.com;tag=998332
Max-Forwards: 70
Call-ID: regbadct.k345asrl3fdbv@10.0.0.1
CSeq: 1 REGISTER
Via: SIP/2.0/UDP 135.180.130.133:5060;branch=z9hG4bKkdjuw
Contact: sip:user@example.com?Route=%3Csip:sip.example.com%3E
l: 0
''')

# §3.1.2.13 badaspec, "Spaces within addr-spec"
BADASPEC = wire('''
OPTIONS sip:user@example.org SIP/2.0
Via: SIP/2.0/UDP host4.example.com:5060;branch=z9hG4bKkdju43234
Max-Forwards: 70
From: "Bell, Alexander" <sip:a.g.bell@example.com>;tag=433423
To: "Watson, Thomas" < sip:t.watson@example.org >
Call-ID: badaspec.sdf0234n2nds0a099u23h3hnnw009cdkne3
Accept: application/sdp
CSeq: 3923239 OPTIONS
l: 0
''')

# §3.1.2.15 badvers, "Unknown Protocol Version"
BADVERS = wire('''
OPTIONS sip:t.watson@example.org SIP/7.0
Via:     SIP/7.0/UDP c.example.com;branch=z9hG4bKkdjuw
Max-Forwards:     70
From:    A. Bell <sip:a.g.bell@example.com>;tag=qweoiqpe
To:      T. Watson <sip:t.watson@example.org>
Call-ID: badvers.31417@c.example.com
CSeq:    1 OPTIONS
l: 0
''')

# §3.1.2.16 mismatch01, "Mismatched Method in CSeq"
MISMATCH01 = wire('''
OPTIONS sip:user@example.com SIP/2.0
To: sip:j.user@example.com
From: sip:caller@example.net;tag=34525
Max-Forwards: 6
Call-ID: mismatch01.dj0234sxdfl3
CSeq: 8 INVITE
Via: SIP/2.0/UDP host.example.com;branch=z9hG4bKkdjuw
l: 0
''')

# §3.1.2.18 bigcode, "Overlarge Response Code"
BIGCODE = wire('''
SIP/2.0 4294967301 better not break the receiver
Via: SIP/2.0/UDP 192.0.2.105;branch=z9hG4bK2398ndaoe
Call-ID: bigcode.asdof3uj203asdnf3429uasdhfas3ehjasdfas9i
CSeq: 353494 INVITE
From: <sip:user@example.com>;tag=39ansfi3
To: <sip:user@example.edu>;tag=902jndnke3
Content-Length: 0
Contact: <sip:user@host105.example.com>
''')

# §3.3.1 insuf, "Missing Required Header Fields" (no Call-ID, From, To, Max-Forwards)
INSUF = wire('''
INVITE sip:user@example.com SIP/2.0
CSeq: 193942 INVITE
Via: SIP/2.0/UDP 192.0.2.95;branch=z9hG4bKkdj.insuf
Content-Type: application/sdp
l: 152
''', sdp("192.0.2.95"))

# §3.3.5 bext01, "Proxy-Require and Require for Extensions": valid syntax (the UA answers 420, test_sip_ua.py)
BEXT01 = wire('''
OPTIONS sip:user@example.com SIP/2.0
To: sip:j_user@example.com
From: sip:caller@example.net;tag=242etr
Max-Forwards: 6
Call-ID: bext01.0ha0isndaksdj
Require: nothingSupportsThis, nothingSupportsThisEither
Proxy-Require: noProxiesSupportThis, norDoAnyProxiesSupportThis
CSeq: 8 OPTIONS
Via: SIP/2.0/TLS fold-and-staple.example.com;branch=z9hG4bKkdjuw
Content-Length: 0
''')

# §3.3.9 mcl01, "Multiple Content-Length Values"
MCL01 = wire('''
OPTIONS sip:user@example.com SIP/2.0
Via: SIP/2.0/UDP host5.example.net;branch=z9hG4bK293423
To: sip:user@example.com
From: sip:other@example.net;tag=3923942
Call-ID: mcl01.fhn2323orihawfdoa3o4r52o3irsdf
CSeq: 15932 OPTIONS
Content-Length: 13
Max-Forwards: 60
Content-Length: 5
Content-Type: text/plain
''', b"There's no way to know how many octets are supposed to be here.\r\n")

# §3.3.10 bcast, "200 OK Response with Broadcast Via Header Field Value"
BCAST = wire(f'''
SIP/2.0 200 OK
Via: SIP/2.0/UDP 192.0.2.198;branch=z9hG4bK1324923
Via: SIP/2.0/UDP 255.255.255.255;branch=z9hG4bK1saber23
Call-ID: bcast.0293lkdjfa9sd9f0asdf0kjj
CSeq: 35 INVITE
From: sip:user@example.com;tag=11141343
To: sip:user@example.edu;tag=2229
Content-Length: {len(UNREASON_BODY)}
Content-Type: application/sdp
Contact: <sip:user@host28.example.com>
''', UNREASON_BODY)


@pytest.mark.parametrize(("name", "data", "status", "words"), [
    ("clerr", CLERR, 400, "Content-Length 9999"),
    ("scalar02 negative Content-Length", SCALAR02, 400, "Content-Length"),
    ("scalarlg CSeq beyond 2**31", SCALARLG, 400, "CSeq"),
    ("quotbal", QUOTBAL, 400, "quoted"),
    ("lwsruri", LWSRURI, 400, "request line"),
    ("lwsstart: strict, RFC 4475 lets an element accept it", LWSSTART, 400, "request line"),
    ("trws: strict, RFC 4475 lets an element accept it", TRWS, 400, "request line"),
    ("badvers", BADVERS, 505, "SIP/7.0"),
    ("mismatch01", MISMATCH01, 400, "CSeq"),
    ("bigcode", BIGCODE, 400, "status line"),
    ("insuf", INSUF, 400, "no From"),
    ("mcl01", MCL01, 400, "Content-Length"),
])
def test_rfc4475_invalid_messages_are_sip_errors(name, data, status, words):
    with pytest.raises(SipError) as caught:
        parse(data)
    assert caught.value.status == status, name
    assert words in str(caught.value), (name, str(caught.value))


def test_badinv01_lenient_extra_separators_in_via_and_contact():
    """Lenient: only the top Via is read by a user agent (the others are copied back unread), and empty parameters
    are skipped. The RFC expects a 400; answering the request instead harms no one."""
    message = request(BADINV01)
    assert message.headers.all("Via") == ["SIP/2.0/UDP 192.0.2.15;;", ";"]
    assert message.top_via.host == "192.0.2.15" and message.top_via.branch == ""
    assert NameAddr.parse(message.headers.get("Contact") or "").params == {}


def test_ltgtruri_lenient_request_uri_not_read():
    """Lenient: a UAS never routes on the Request-URI of a request it receives, so it is kept as written."""
    assert request(LTGTRURI).uri == "<sip:user@example.com>"


def test_baddate_lenient_date_not_read():
    assert request(BADDATE).headers.get("Date") == "Fri, 01 Jan 2010 16:00:00 EST"


def test_regbadct_lenient_contact_in_addr_spec_form():
    """Lenient: the '?' header stays in the URI (the endpoint answers REGISTER 405 anyway)."""
    contact = NameAddr.parse(request(REGBADCT).headers.get("Contact") or "")
    assert contact.uri == "sip:user@example.com?Route=%3Csip:sip.example.com%3E"
    assert SipUri.parse(contact.uri).host == "example.com"


def test_badaspec_lenient_spaces_inside_angle_brackets():
    message = request(BADASPEC)
    assert NameAddr.parse(message.headers.get("To") or "").uri == "sip:t.watson@example.org"
    sender = NameAddr.parse(message.headers.get("From") or "")
    assert (sender.display, sender.tag) == ("Bell, Alexander", "433423")  # the comma inside quotes


def test_bext01_require_lists_split():
    message = request(BEXT01)
    assert message.headers.all("Require") == ["nothingSupportsThis", "nothingSupportsThisEither"]
    assert message.headers.get("Proxy-Require") == "noProxiesSupportThis, norDoAnyProxiesSupportThis"


def test_bcast_broadcast_via_below_ours_parsed():
    """A response's lower Vias are a proxy's business; a user agent matches on the top one only."""
    message = response(BCAST)
    assert message.top_via.branch == "z9hG4bK1324923"
    assert Via.parse(message.headers.all("Via")[1]).host == "255.255.255.255"


def test_version_of_a_response_and_odd_status_lines():
    with pytest.raises(SipError):
        parse(NOREASON.replace(b"SIP/2.0 100", b"SIP/3.0 100"))
    for line in (b"SIP/2.0 2000 OK", b"SIP/2.0 20 OK", b"SIP/2.0 700 Seven", b"SIP/2.0 OK"):
        with pytest.raises(SipError):
            parse(NOREASON.replace(b"SIP/2.0 100 ", line))


# ---------------------------------------------------------------- header forms


COMPACT = wire('''
OPTIONS sip:bob@biloxi.example.com SIP/2.0
v: SIP/2.0/UDP pc33.atlanta.example.com;branch=z9hG4bKcompact
f: Alice <sip:alice@atlanta.example.com>;tag=1928
t: Bob <sip:bob@biloxi.example.com>
i: compact.1@pc33
CSeq: 1 OPTIONS
m: <sip:alice@pc33.atlanta.example.com>
c: text/plain
k: replaces, timer
o: refer
l: 5
''', b"hello")


def test_compact_forms_read_as_full_names():
    message = request(COMPACT)
    assert [name for name, _ in message.headers.items] == [
        "Via", "From", "To", "Call-ID", "CSeq", "Contact", "Content-Type", "Supported", "Supported", "Event",
        "Content-Length"]
    assert message.top_via.branch == "z9hG4bKcompact"
    assert message.call_id == "compact.1@pc33"
    assert message.headers.get("f") == message.headers.get("From") == "Alice <sip:alice@atlanta.example.com>;tag=1928"
    assert message.headers.get("contact") == "<sip:alice@pc33.atlanta.example.com>"
    assert message.headers.all("Supported") == ["replaces", "timer"]
    assert message.body == b"hello"


def test_list_headers_split_with_commas_in_quotes_and_brackets_kept():
    message = request(wire('''
INVITE sip:bob@example.com SIP/2.0
Via: SIP/2.0/UDP a.example.com;branch=z9hG4bKa, SIP/2.0/TCP b.example.com:5070;branch=z9hG4bKb
Via: SIP/2.0/UDP c.example.com;branch=z9hG4bKc
From: "Doe, Jane" <sip:jane@example.com>;tag=1
To: <sip:bob@example.com>
Call-ID: lists@example.com
CSeq: 1 INVITE
Contact: "Doe, \\"J,\\" <x>" <sip:jane@a.example.com;x=1,2>;q=0.5, <sip:jane@b.example.com>;q=0.1
Subject: one, two, three
Content-Length: 0
'''))
    assert [Via.parse(value).branch for value in message.headers.all("Via")] == [
        "z9hG4bKa", "z9hG4bKb", "z9hG4bKc"]
    contacts = message.headers.all("Contact")
    assert contacts == ['"Doe, \\"J,\\" <x>" <sip:jane@a.example.com;x=1,2>;q=0.5', "<sip:jane@b.example.com>;q=0.1"]
    first = NameAddr.parse(contacts[0])
    assert (first.display, first.uri, first.params) == ('Doe, "J," <x>', "sip:jane@a.example.com;x=1,2", {"q": "0.5"})
    assert NameAddr.parse(message.headers.get("From") or "").display == "Doe, Jane"
    assert message.headers.get("Subject") == "one, two, three"  # not a list header
    assert split_list(' a , "b,c" ,, <d,e> ') == ["a", '"b,c"', "<d,e>"]


@pytest.mark.parametrize("name", sorted(VALID))
def test_round_trip(name):
    """parse -> bytes -> parse: the same start line, header fields (Content-Length written last, with the body's
    length) and body; writing again gives the same bytes."""
    first = parse(VALID[name])
    data = bytes(first)
    second = parse(data)
    assert type(second) is type(first)
    if isinstance(first, Request):
        assert (second.method, second.uri) == (first.method, first.uri)
    else:  # an empty reason phrase (noreason) is written as the standard one
        assert (second.status, second.reason) == (first.status, first.reason or REASONS[first.status])

    def fields(message):
        return [(key, value) for key, value in message.headers.items if key != "Content-Length"]

    assert fields(second) == fields(first)
    assert second.headers.all("Content-Length") == [str(len(first.body))]
    assert second.body == first.body
    assert bytes(second) == data


def test_name_addr_forms():
    alice = NameAddr.parse('"Alice \\"A\\" Liddell" <sip:alice@atlanta.example.com;transport=tcp>;tag=88sja8x')
    assert alice.display == 'Alice "A" Liddell'
    assert alice.uri == "sip:alice@atlanta.example.com;transport=tcp"  # URI parameters stay in the URI
    assert alice.params == {"tag": "88sja8x"} and alice.tag == "88sja8x"
    assert NameAddr.parse(str(alice)) == alice and NameAddr.parse(str(alice)).display == alice.display
    assert str(alice) == '"Alice \\"A\\" Liddell" <sip:alice@atlanta.example.com;transport=tcp>;tag=88sja8x'

    angle = NameAddr.parse('"a <b> c" <sip:c@example.com>')  # '<' inside the quotes is the display's
    assert (angle.display, angle.uri) == ("a <b> c", "sip:c@example.com")

    tokens = NameAddr.parse("Bob  Smith <sips:bob@biloxi.example.com>;Expires=60")
    assert (tokens.display, tokens.params) == ("Bob  Smith", {"expires": "60"})

    quoted = NameAddr.parse('<sip:x@example.com>;note="a;b=c";tag=9')
    assert quoted.params == {"note": "a;b=c", "tag": "9"}

    bare = NameAddr.parse("sip:carol@chicago.example.com;tag=887s;transport=udp")  # addr-spec: all the header's
    assert (bare.uri, bare.params) == ("sip:carol@chicago.example.com", {"tag": "887s", "transport": "udp"})
    assert bare.with_tag("x").tag == "x" and bare.tag == "887s"
    assert NameAddr.parse("*").uri == "*"

    for bad in ("", '"unclosed <sip:a@b>', "<sip:a@b", "Alice <>", "<http://example.com>", "sip:"):
        with pytest.raises(SipError):
            NameAddr.parse(bad)


def test_sip_uri_forms():
    v6 = SipUri.parse("sip:[2001:db8::10]:5070;transport=tcp")
    assert (v6.scheme, v6.user, v6.host, v6.port, v6.params) == ("sip", None, "2001:db8::10", 5070,
                                                                 {"transport": "tcp"})
    assert str(v6) == "sip:[2001:db8::10]:5070;transport=tcp"
    assert SipUri.parse("sip:alice@[::1]").host == "::1"
    full = SipUri.parse("SIPS:alice:secretword@atlanta.example.com:5061;maddr=239.255.255.1;ttl=15?subject=x@y")
    assert (full.scheme, full.user, full.host, full.port) == ("sips", "alice:secretword", "atlanta.example.com", 5061)
    assert full.params == {"maddr": "239.255.255.1", "ttl": "15"}
    assert SipUri.parse("sip:atlanta.example.com").user is None
    assert SipUri.parse("tel:+1-212-555-0101").host == "+1-212-555-0101"
    assert SipUri.parse("sip:alice@example.com").with_params(lr="").params == {"lr": ""}
    for bad in ("http://example.com", "sip:", "sip:alice@", "sip:[::1", "sip:host:0", "sip:host:70000",
                "sip:host:５０６０", "sip:host:²"):
        with pytest.raises(SipError):
            SipUri.parse(bad)


def test_via_forms():
    via = Via.parse("SIP/2.0/UDP [2001:db8::9:1]:5060;branch=z9hG4bK776;rport=5062;received=2001:db8::9:255")
    assert (via.transport, via.host, via.port, via.branch) == ("UDP", "2001:db8::9:1", 5060, "z9hG4bK776")
    assert via.params["received"] == "2001:db8::9:255"
    assert str(via) == "SIP/2.0/UDP [2001:db8::9:1]:5060;branch=z9hG4bK776;rport=5062;received=2001:db8::9:255"
    assert Via.parse("sip/2.0/tls host.example.com : 5061 ;branch=z9hG4bKx").port == 5061
    for bad in ("", "SIP/2.0/UDP", "SIP/2.0 host", "SIP/3.0/UDP host", "SIP/2.0/UDP ;branch=x", "HTTP/1.1/TCP x"):
        with pytest.raises(SipError):
            Via.parse(bad)


# ---------------------------------------------------------------- framing


def test_datagram_body_beyond_content_length_cut_and_absent_length_takes_all():
    assert request(COMPACT + b" and more").body == b"hello"
    no_length = COMPACT.replace(b"l: 5\r\n", b"")
    assert request(no_length + b" and more").body == b"hello and more"  # a datagram frames itself (§18.3)
    with pytest.raises(SipError):
        parse(COMPACT[:-1])  # fewer bytes than Content-Length
    for value in (b"five", b"+5", b"5_0", b"\xd9\xa5", b"-0x5", b""):
        with pytest.raises(SipError):
            parse(COMPACT.replace(b"l: 5", b"l: " + value))


def test_bare_lf_line_ends_tolerated():
    message = request(LWSDISP.replace(b"\r\n", b"\n"))
    assert message.method == "OPTIONS" and message.call_id == "lwsdisp.1234abcd@funky.example.com"


def test_stream_framer_two_messages_in_one_chunk():
    framer = StreamFramer()
    messages = list(framer.feed(COMPACT + RFC3261_F1))
    assert [message.method for message in messages] == ["OPTIONS", "INVITE"]
    assert messages[0].body == b"hello" and len(messages[1].body) == 150


def test_stream_framer_byte_by_byte_with_keep_alives():
    stream = b"\r\n\r\n" + RFC3261_F1 + b"\r\n" + COMPACT + b"\r\n\r\n" + RFC3261_F1
    framer, messages = StreamFramer(), []
    for index in range(len(stream)):
        messages += list(framer.feed(stream[index:index + 1]))
    assert [message.call_id for message in messages] == [
        "a84b4c76e66710@pc33.atlanta.com", "compact.1@pc33", "a84b4c76e66710@pc33.atlanta.com"]
    assert messages[0].body == messages[2].body == parse(RFC3261_F1).body


def test_stream_framer_partial_message_waits():
    framer = StreamFramer()
    assert list(framer.feed(RFC3261_F1[:-10])) == []
    assert [message.call_id for message in framer.feed(RFC3261_F1[-10:])] == ["a84b4c76e66710@pc33.atlanta.com"]


def test_stream_without_content_length_is_an_error():
    with pytest.raises(SipError) as caught:
        list(StreamFramer().feed(LWSDISP.replace(b"l: 0\r\n", b"")))
    assert "Content-Length" in str(caught.value)
    with pytest.raises(SipError):
        parse(LWSDISP.replace(b"l: 0\r\n", b""), stream=True)


def test_stream_negative_and_doubled_content_length_are_errors():
    with pytest.raises(SipError):
        list(StreamFramer().feed(SCALAR02))
    with pytest.raises(SipError):
        list(StreamFramer().feed(MCL01))


def test_oversize_is_413():
    with pytest.raises(SipError) as caught:
        list(StreamFramer().feed(b"INVITE sip:a@b SIP/2.0\r\nX-Long: " + b"x" * (MAX_MESSAGE_BYTES + 10)))
    assert caught.value.status == 413
    huge = COMPACT.replace(b"l: 5", f"l: {MAX_MESSAGE_BYTES}".encode())
    with pytest.raises(SipError) as caught:
        list(StreamFramer().feed(huge))  # refused when the header section is read, before the body arrives
    assert caught.value.status == 413
    with pytest.raises(SipError) as caught:
        parse(COMPACT + b"x" * MAX_MESSAGE_BYTES)
    assert caught.value.status == 413
    many = "".join(f"X-{number}: {number}\n" for number in range(200))
    with pytest.raises(SipError) as caught:
        parse(wire("OPTIONS sip:a@b SIP/2.0\n" + many))
    assert caught.value.status == 413


# ---------------------------------------------------------------- responses


def test_response_to_copies_what_section_8_2_6_2_asks():
    invite = request(wire('''
INVITE sip:bob@biloxi.example.com SIP/2.0
Via: SIP/2.0/UDP proxy.example.com;branch=z9hG4bK2d4790.1;received=192.0.2.3
Via: SIP/2.0/UDP pc33.atlanta.example.com;branch=z9hG4bK74bf9;rport=5060
Max-Forwards: 69
From: "Alice" <sip:alice@atlanta.example.com>;tag=9fxced76sl
To: Bob <sip:bob@biloxi.example.com>
Call-ID: 3848276298220188511@atlanta.example.com
CSeq: 2 INVITE
Record-Route: <sip:proxy.example.com;lr>
Contact: <sip:alice@pc33.atlanta.example.com>
Content-Length: 0
'''))
    ringing = response_to(invite, 180, to_tag="a6c85cf", headers=[("Contact", "<sip:bob@192.0.2.4>")])
    assert (ringing.status, ringing.reason) == (180, "Ringing")
    assert ringing.headers.all("Via") == invite.headers.all("Via")
    assert ringing.headers.get("From") == invite.headers.get("From")
    assert ringing.headers.get("To") == "\"Bob\" <sip:bob@biloxi.example.com>;tag=a6c85cf"
    assert NameAddr.parse(ringing.headers.get("To") or "").tag == "a6c85cf"
    assert (ringing.call_id, ringing.cseq) == (invite.call_id, (2, "INVITE"))
    assert ringing.headers.get("Contact") == "<sip:bob@192.0.2.4>"
    assert "Record-Route" not in ringing.headers and "Max-Forwards" not in ringing.headers
    assert parse(bytes(ringing)).headers.get("To") == ringing.headers.get("To")  # written, read back

    trying = response_to(invite, 100, to_tag="a6c85cf")
    assert trying.headers.get("To") == "Bob <sip:bob@biloxi.example.com>"  # a 100 carries no tag (§8.2.6.1)

    ok = response_to(invite, 200, to_tag="a6c85cf", body=b"v=0\r\n")
    assert ok.headers.get("Content-Type") == "application/sdp" and ok.body == b"v=0\r\n"
    assert parse(bytes(ok)).headers.get("Content-Length") == "5"

    tagged = request(bytes(invite).replace(b"To: Bob <sip:bob@biloxi.example.com>",
                                           b"To: Bob <sip:bob@biloxi.example.com>;tag=theirs"))
    kept = response_to(tagged, 481, to_tag="ignored")
    assert NameAddr.parse(kept.headers.get("To") or "").tag == "theirs"  # an existing tag is never replaced
    assert kept.reason == "Call/Transaction Does Not Exist"


# ---------------------------------------------------------------- garbled messages


def _garble(rng: random.Random, data: bytes) -> bytes:
    alphabet = ("abcXYZ09 \t:;,=<>@\"'\\/[]?*%.-_²٥５\ufeff\x00\x7f\r\nSIP/2.0 INVITE sip: tag= branch=z9hG4bK "
                "Content-Length: l: CSeq: Via: v: To: From: Call-ID: ")
    names = ["Via", "v", "From", "f", "To", "t", "Call-ID", "i", "CSeq", "Content-Length", "l", "Contact", "m",
             "Max-Forwards", "Require", "X-Junk", "", " ", "Content-Type"]
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.randrange(8)
        if choice == 0 and data:  # truncated
            del data[rng.randrange(len(data)):]
        elif choice == 1 and data:  # bytes flipped
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif choice == 2:  # a random header line somewhere in the header section
            value = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
            line = f"{rng.choice(names)}:{value}\r\n".encode()
            end = data.find(b"\r\n")
            at = rng.randint(end + 2, max(end + 2, data.find(b"\r\n\r\n") + 2)) if end >= 0 else 0
            data[at:at] = line
        elif choice == 3:  # a line removed
            lines = bytes(data).split(b"\r\n")
            if len(lines) > 1:
                del lines[rng.randrange(len(lines))]
            data = bytearray(b"\r\n".join(lines))
        elif choice == 4 and data:  # a slice inserted again elsewhere
            start = rng.randrange(len(data))
            piece = data[start:start + rng.randint(1, 30)]
            at = rng.randrange(len(data))
            data[at:at] = piece
        elif choice == 5:  # a header value replaced by random text
            lines = bytes(data).split(b"\r\n")
            index = rng.randrange(len(lines))
            name = lines[index].partition(b":")[0]
            value = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
            lines[index] = name + b":" + value.encode()
            data = bytearray(b"\r\n".join(lines))
        elif choice == 6:  # an ASCII digit swapped for another script's (str.isdigit() says yes, int() no)
            digits = [index for index, byte in enumerate(data) if 0x30 <= byte <= 0x39]
            if digits:
                index = rng.choice(digits)
                data[index:index + 1] = rng.choice(["²", "٥", "５", "߃"]).encode()
        else:  # random bytes
            data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 20)))
    return bytes(data)


def test_garbled_messages_raise_only_sip_error():
    """Truncations, byte flips, random header lines and values over every fixture: parse() returns a message or
    raises SipError, the stream framer too, never another exception (an IndexError, a ValueError from int())."""
    rng = random.Random(4475)
    corpus = [*VALID.values(), COMPACT, BEXT01, BCAST, BADASPEC, REGBADCT]
    outcomes = {"parsed": 0, "refused": 0}
    for _ in range(4000):
        data = _garble(rng, rng.choice(corpus))
        try:
            message = parse(data)
        except SipError as exc:
            assert 400 <= exc.status < 600
            outcomes["refused"] += 1
        else:
            assert isinstance(message, Request | Response)
            message.top_via  # noqa: B018 (readable once parsed)
            NameAddr.parse(message.headers.get("To") or "")
            outcomes["parsed"] += 1
        framer = StreamFramer()
        try:
            for cut in range(0, len(data), 97):
                for message in framer.feed(data[cut:cut + 97]):
                    assert isinstance(message, Request | Response)
        except SipError:
            pass
    assert outcomes["parsed"] > 300 and outcomes["refused"] > 300, outcomes
