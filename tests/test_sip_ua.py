"""The SIP user agent (kame/sip/ua.py over kame/sip/transport.py) on real loopback sockets: a SipEndpoint started in
the test, driven by a raw peer socket that writes its SIP by hand (f-strings, not our writer) and reads the answers
with our parser. Inbound calls (ringing, answer, retransmissions, CANCEL, BYE, re-INVITE, INFO, NOTIFY), requests
outside a dialog, our own requests in a dialog, the per-source rate limit, unreadable datagrams, an outbound call
through a trunk that challenges for digest credentials, and one call over TCP. Timers are patched small where a
test waits for one."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import re
import secrets

import pytest

from kame.sip import ua
from kame.sip.message import Message, NameAddr, Request, Response, SipError, SipUri, StreamFramer, parse
from kame.sip.transport import Flow, SipTransport
from kame.sip.ua import CallFailed, SipCall, SipEndpoint

LOOPBACK = "127.0.0.1"
OFFER = (b"v=0\r\no=caller 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
         b"m=audio 40000 RTP/AVP 0\r\na=rtpmap:0 PCMU/8000\r\na=sendrecv\r\n")
ANSWER = OFFER.replace(b"o=caller", b"o=kame").replace(b"40000", b"41000")
HOLD = OFFER.replace(b"a=sendrecv", b"a=sendonly").replace(b"1 1 IN", b"1 2 IN")
HELD = ANSWER.replace(b"a=sendrecv", b"a=recvonly")


def run(test):
    """An async test run in its own event loop, never longer than 15 s."""
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        asyncio.run(asyncio.wait_for(test(*args, **kwargs), 15))

    return wrapper


@pytest.fixture
def fast(monkeypatch):
    """Retransmission and transaction timers made small, for the tests that wait for them."""
    monkeypatch.setattr(ua, "T1", 0.05)
    monkeypatch.setattr(ua, "T2", 0.2)
    monkeypatch.setattr(ua, "TRANSACTION_S", 0.8)


# ---------------------------------------------------------------- the raw peer


class Peer(asyncio.DatagramProtocol):
    """A UDP socket that plays the far end: sends bytes, hands over what arrives (parsed) through a queue."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[bytes, tuple[str, int]]] = asyncio.Queue()
        self.socket: asyncio.DatagramTransport | None = None
        self.port = 0

    @classmethod
    async def open(cls, host: str = LOOPBACK) -> Peer:
        peer = cls()
        await asyncio.get_running_loop().create_datagram_endpoint(lambda: peer, local_addr=(host, 0))
        return peer

    def connection_made(self, transport) -> None:
        self.socket = transport
        self.host, self.port = transport.get_extra_info("sockname")[:2]

    def datagram_received(self, data: bytes, addr) -> None:
        self.queue.put_nowait((data, addr))

    def send(self, data: bytes, to: tuple[str, int]) -> None:
        assert self.socket is not None
        self.socket.sendto(data, to)

    async def raw(self, within: float = 2.0) -> bytes:
        data, _ = await asyncio.wait_for(self.queue.get(), within)
        return data

    async def receive(self, within: float = 2.0) -> Message:
        return parse(await self.raw(within))

    async def expect(self, wanted, within: float = 2.0) -> Message:
        """The next message `wanted(message)` accepts, skipping others (retransmissions of what came before)."""
        async with asyncio.timeout(within):
            while True:
                message = await self.receive(within)
                if wanted(message):
                    return message

    async def silent(self, seconds: float) -> None:
        """Nothing arrives for `seconds`."""
        with contextlib.suppress(TimeoutError):
            data = await self.raw(seconds)
            raise AssertionError(f"unexpected: {data[:80]!r}")

    def drain(self) -> list[Message]:
        out = []
        while not self.queue.empty():
            out.append(parse(self.queue.get_nowait()[0]))
        return out

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close()


def status(code: int, method: str = "INVITE"):
    return lambda message: isinstance(message, Response) and message.status == code and message.cseq[1] == method


def method(name: str):
    return lambda message: isinstance(message, Request) and message.method == name


def to_tag(message: Message) -> str | None:
    return NameAddr.parse(message.headers.get("To") or "").tag


class Dialog:
    """What the peer's side of a call keeps: its tag, the Call-ID, its CSeq, our tag once known."""

    def __init__(self, peer: Peer, endpoint_port: int, *, transport: str = "UDP", peer_port: int | None = None):
        self.peer, self.port, self.transport = peer, endpoint_port, transport
        self.peer_port = peer_port or peer.port
        self.call_id = f"{secrets.token_hex(6)}@peer.example.com"
        self.from_tag = secrets.token_hex(4)
        self.tag: str | None = None  # the endpoint's To tag
        self.cseq = 1

    def request(self, method: str, *, branch: str | None = None, cseq: int | None = None, body: bytes = b"",
                content_type: str = "application/sdp", to_tag: str | None = None, call_id: str | None = None,
                extra: str = "", cseq_method: str | None = None) -> tuple[bytes, str]:
        """The request as a softphone would write it, and its branch."""
        branch = branch or f"z9hG4bK{secrets.token_hex(6)}"
        tag = to_tag if to_tag is not None else self.tag
        to = f"<sip:kame@{LOOPBACK}:{self.port}>" + (f";tag={tag}" if tag else "")
        kind = f"Content-Type: {content_type}\r\n" if body else ""
        text = (f"{method} sip:kame@{LOOPBACK}:{self.port} SIP/2.0\r\n"
                f"Via: SIP/2.0/{self.transport} {LOOPBACK}:{self.peer_port};branch={branch};rport\r\n"
                f"Max-Forwards: 70\r\n"
                f"From: \"Caller\" <sip:caller@{LOOPBACK}:{self.peer_port}>;tag={self.from_tag}\r\n"
                f"To: {to}\r\n"
                f"Call-ID: {call_id or self.call_id}\r\n"
                f"CSeq: {cseq if cseq is not None else self.cseq} {cseq_method or method}\r\n"
                f"Contact: <sip:caller@{LOOPBACK}:{self.peer_port}>\r\n"
                f"{extra}{kind}"
                f"Content-Length: {len(body)}\r\n\r\n")
        return text.encode() + body, branch

    def ack(self, branch: str, cseq: int | None = None, tag: str | None = None) -> bytes:
        data, _ = self.request("ACK", branch=branch, cseq=cseq, to_tag=tag)
        return data


class Handler:
    """A CallHandler that records what it hears, each event also put on a queue."""

    def __init__(self, answer: bytes = HELD) -> None:
        self.answer = answer
        self.events: asyncio.Queue[tuple] = asyncio.Queue()
        self.confirmed_calls: list[SipCall] = []
        self.ended_reasons: list[str] = []
        self.offers: list[bytes] = []
        self.digits: list[str] = []
        self.transfers: list[str] = []

    def confirmed(self, call: SipCall) -> None:
        self.confirmed_calls.append(call)
        self.events.put_nowait(("confirmed",))

    def ended(self, call: SipCall, reason: str) -> None:
        self.ended_reasons.append(reason)
        self.events.put_nowait(("ended", reason))

    def reoffer(self, call: SipCall, offer: bytes) -> bytes:
        self.offers.append(offer)
        return self.answer

    def digit(self, call: SipCall, digit: str) -> None:
        self.digits.append(digit)
        self.events.put_nowait(("digit", digit))

    def transfer(self, call: SipCall, status_line: str) -> None:
        self.transfers.append(status_line)
        self.events.put_nowait(("transfer", status_line))

    async def next(self, within: float = 2.0) -> tuple:
        return await asyncio.wait_for(self.events.get(), within)


class Rig:
    """A SipTransport and SipEndpoint on loopback; each new call gets a Handler and waits on `calls`."""

    def __init__(self) -> None:
        self.calls: asyncio.Queue[SipCall] = asyncio.Queue()
        self.invites = 0
        self.transport = SipTransport(lambda message, flow: None)
        self.endpoint: SipEndpoint

    def on_invite(self, call: SipCall) -> None:
        self.invites += 1
        call.handler = Handler()
        self.calls.put_nowait(call)

    @property
    def address(self) -> tuple[str, int]:
        return LOOPBACK, self.transport.port

    async def next_call(self) -> SipCall:
        return await asyncio.wait_for(self.calls.get(), 2)


@contextlib.asynccontextmanager
async def started(**kwargs):
    rig = Rig()
    rig.endpoint = SipEndpoint(rig.transport, rig.on_invite, **kwargs)
    await rig.transport.start(LOOPBACK, 0)
    peer = await Peer.open()
    try:
        yield rig, peer
    finally:
        peer.close()
        await rig.transport.close()


async def ringing_call(rig: Rig, peer: Peer, *, extra: str = "") -> tuple[Dialog, SipCall, str, Response]:
    """The peer's INVITE answered 100, then 180 by call.ringing(): the dialog (its tag learnt), the call, the
    INVITE's branch and the 180."""
    dialog = Dialog(peer, rig.transport.port)
    data, branch = dialog.request("INVITE", body=OFFER, extra=extra)
    peer.send(data, rig.address)
    trying = await peer.receive()
    assert isinstance(trying, Response) and trying.status == 100 and to_tag(trying) is None
    call = await rig.next_call()
    call.ringing()
    ringing = await peer.receive()
    assert isinstance(ringing, Response) and ringing.status == 180
    dialog.tag = to_tag(ringing)
    return dialog, call, branch, ringing


async def confirmed_call(rig: Rig, peer: Peer, *, extra: str = "") -> tuple[Dialog, SipCall, Response]:
    """A call answered and ACKed: the dialog, the call and our 200."""
    dialog, call, branch, _ = await ringing_call(rig, peer, extra=extra)
    call.accept(ANSWER)
    ok = await peer.expect(status(200))
    peer.send(dialog.ack(f"z9hG4bK{secrets.token_hex(6)}"), rig.address)
    assert await call.handler.next() == ("confirmed",)
    peer.drain()
    dialog.cseq += 1
    return dialog, call, ok


def reply(request: Message, code: int, reason: str = "OK", *, tag: str | None = None, extra: str = "",
          body: bytes = b"", content_type: str = "application/sdp") -> bytes:
    """The peer's response to one of our requests, written by hand from the request's fields."""
    assert isinstance(request, Request)
    vias = "".join(f"Via: {value}\r\n" for value in request.headers.all("Via"))
    to = request.headers.get("To") or ""
    if tag and ";tag=" not in to:
        to += f";tag={tag}"
    kind = f"Content-Type: {content_type}\r\n" if body else ""
    text = (f"SIP/2.0 {code} {reason}\r\n{vias}"
            f"From: {request.headers.get('From')}\r\nTo: {to}\r\nCall-ID: {request.call_id}\r\n"
            f"CSeq: {request.headers.get('CSeq')}\r\n{extra}{kind}Content-Length: {len(body)}\r\n\r\n")
    return text.encode() + body


# ---------------------------------------------------------------- an inbound call


@run
async def test_invite_trying_ringing_ok_retransmitted_until_ack(monkeypatch):
    monkeypatch.setattr(ua, "T1", 0.2)
    monkeypatch.setattr(ua, "T2", 0.8)
    async with started() as (rig, peer):
        dialog, call, branch, ringing = await ringing_call(rig, peer)
        assert call.offer == OFFER and call.direction == "inbound" and call.state == "ringing"
        assert dialog.tag and dialog.tag == call.local.tag
        assert NameAddr.parse(ringing.headers.get("Contact") or "").uri == f"sip:kame@{LOOPBACK}:{rig.transport.port}"
        assert ringing.top_via.branch == branch and ringing.call_id == dialog.call_id
        assert dict(call.sip_headers())["Call-ID"] == dialog.call_id

        loop = asyncio.get_running_loop()
        call.accept(ANSWER)
        ok = await peer.receive()
        arrivals = [loop.time()]
        assert isinstance(ok, Response) and ok.status == 200 and ok.body == ANSWER
        assert ok.headers.get("Content-Type") == "application/sdp"
        assert to_tag(ok) == dialog.tag  # the 180's tag
        assert ok.headers.get("Contact") == f"<sip:kame@{LOOPBACK}:{rig.transport.port}>"
        assert ok.headers.all("Allow") == ["INVITE", "ACK", "CANCEL", "BYE", "OPTIONS", "INFO", "NOTIFY", "REFER"]
        for _ in range(3):  # T1, 2*T1, 4*T1 apart (the last capped at T2)
            again = await peer.receive()
            arrivals.append(loop.time())
            assert bytes(again) == bytes(ok)
        gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:], strict=False)]
        assert gaps[0] >= 0.15 and gaps[1] > 1.4 * gaps[0] and gaps[2] > 1.4 * gaps[1], gaps

        ack = dialog.ack(f"z9hG4bK{secrets.token_hex(6)}")
        peer.send(ack, rig.address)
        assert await call.handler.next() == ("confirmed",)
        peer.send(ack, rig.address)  # a retransmitted ACK changes nothing
        peer.drain()
        await peer.silent(1.0)  # more than the next retransmission interval (0.8 s): no more 200s
        assert call.state == "confirmed"
        assert call.handler.confirmed_calls == [call]
        assert rig.invites == 1


@run
async def test_no_ack_ends_the_call_with_a_bye(fast):
    async with started() as (rig, peer):
        dialog, call, _, _ = await ringing_call(rig, peer)
        call.accept(ANSWER)
        bye = await peer.expect(method("BYE"), within=3)  # after TRANSACTION_S of 200s never ACKed
        assert await call.handler.next() == ("ended", "no ACK")
        assert isinstance(bye, Request)
        assert bye.call_id == dialog.call_id and to_tag(bye) == dialog.from_tag
        assert NameAddr.parse(bye.headers.get("From") or "").tag == dialog.tag
        peer.send(reply(bye, 200), rig.address)
        await call.ended.wait()
        peer.drain()
        await peer.silent(0.5)  # neither 200s nor BYEs again


@run
async def test_retransmitted_invite_gets_the_last_response_not_a_second_call():
    async with started() as (rig, peer):
        dialog = Dialog(peer, rig.transport.port)
        data, branch = dialog.request("INVITE", body=OFFER)
        peer.send(data, rig.address)
        assert (await peer.receive()).status == 100
        call = await rig.next_call()
        peer.send(data, rig.address)  # before any answer of the application's: the 100 again
        assert (await peer.receive()).status == 100
        call.ringing()
        ringing = await peer.receive()
        peer.send(data, rig.address)
        assert bytes(await peer.receive()) == bytes(ringing)
        call.accept(ANSWER)
        ok = await peer.expect(status(200))
        peer.send(data, rig.address)
        assert bytes(await peer.expect(status(200))) == bytes(ok)
        assert rig.invites == 1 and rig.calls.empty()


@run
async def test_cancel_while_ringing(fast):
    async with started() as (rig, peer):
        dialog, call, branch, _ = await ringing_call(rig, peer)
        cancel, _ = dialog.request("CANCEL", branch=branch, to_tag="")  # the INVITE's branch, To as in the INVITE
        peer.send(cancel, rig.address)
        cancelled = await peer.receive()
        assert isinstance(cancelled, Response) and (cancelled.status, cancelled.cseq) == (200, (1, "CANCEL"))
        terminated = await peer.receive()
        assert isinstance(terminated, Response) and (terminated.status, terminated.cseq) == (487, (1, "INVITE"))
        assert to_tag(terminated) == dialog.tag and terminated.top_via.branch == branch
        assert await call.handler.next() == ("ended", "cancelled")
        assert call.state == "ended" and call.end_reason == "cancelled"

        assert bytes(await peer.receive()) == bytes(terminated)  # retransmitted (Timer G) until its ACK
        peer.send(dialog.ack(branch), rig.address)  # the ACK of a failure: the INVITE's branch
        await asyncio.sleep(0.05)
        peer.drain()
        await peer.silent(0.5)

        with pytest.raises(SipError):
            call.accept(ANSWER)  # too late: the call is over
        unknown, _ = dialog.request("CANCEL", branch="z9hG4bKnosuchinvite", to_tag="")
        peer.send(unknown, rig.address)
        assert (await peer.receive()).status == 481


@run
async def test_reject_486_retransmitted_until_ack(fast):
    async with started() as (rig, peer):
        dialog, call, branch, _ = await ringing_call(rig, peer)
        call.reject(486)
        busy = await peer.receive()
        assert isinstance(busy, Response) and busy.status == 486 and to_tag(busy) == dialog.tag
        assert "Contact" not in busy.headers
        assert await call.handler.next() == ("ended", "rejected 486")
        for _ in range(2):
            assert bytes(await peer.receive()) == bytes(busy)
        peer.send(dialog.ack(branch), rig.address)
        await asyncio.sleep(0.05)
        peer.drain()
        await peer.silent(0.5)
        await asyncio.sleep(0.4)  # TRANSACTION_S (0.8 s) after the call ended: nothing of it is kept
        assert rig.endpoint._invites == {} and rig.endpoint._dialogs == {}


@run
async def test_failure_never_acked_is_given_up_after_the_transaction_time(fast):
    """Timer H: a 486 whose ACK never comes is retransmitted for TRANSACTION_S (0.8 s here), not for ever."""
    async with started() as (rig, peer):
        _, call, _, _ = await ringing_call(rig, peer)
        call.reject(486)
        received = 0
        with contextlib.suppress(TimeoutError):
            while True:
                assert (await peer.receive(within=0.6)).status == 486
                received += 1
        assert 3 <= received <= 8  # 0.05 + 0.1 + 0.2 + 0.2 + 0.2 ... within 0.8 s


@run
async def test_bye_ends_the_call_and_unknown_dialogs_get_481():
    async with started() as (rig, peer):
        dialog, call, _ = await confirmed_call(rig, peer)
        wrong_tag, _ = dialog.request("BYE", to_tag="not-our-tag")
        peer.send(wrong_tag, rig.address)
        assert (await peer.receive()).status == 481
        wrong_call, _ = dialog.request("BYE", call_id="no-such-call@peer.example.com")
        peer.send(wrong_call, rig.address)
        assert (await peer.receive()).status == 481
        assert call.state == "confirmed"

        bye, _ = dialog.request("BYE")
        peer.send(bye, rig.address)
        ok = await peer.receive()
        assert isinstance(ok, Response) and (ok.status, ok.cseq) == (200, (dialog.cseq, "BYE"))
        assert to_tag(ok) == dialog.tag
        assert await call.handler.next() == ("ended", "bye")
        assert call.ended.is_set() and call.end_reason == "bye"


@run
async def test_reinvite_hold_and_cseq_order():
    async with started() as (rig, peer):
        dialog, call, _ = await confirmed_call(rig, peer)
        reinvite, branch = dialog.request("INVITE", body=HOLD)
        peer.send(reinvite, rig.address)
        ok = await peer.receive()
        assert isinstance(ok, Response) and (ok.status, ok.cseq) == (200, (2, "INVITE")) and ok.body == HELD
        assert to_tag(ok) == dialog.tag and ok.headers.get("Contact")
        assert call.handler.offers == [HOLD]
        peer.send(dialog.ack(f"z9hG4bK{secrets.token_hex(6)}", cseq=2), rig.address)

        old, _ = dialog.request("INFO", cseq=1, body=b"Signal=1\r\n", content_type="application/dtmf-relay")
        peer.send(old, rig.address)
        stale = await peer.receive()
        assert isinstance(stale, Response) and (stale.status, stale.cseq) == (500, (1, "INFO"))
        assert call.handler.digits == []
        older, _ = dialog.request("INVITE", cseq=1, body=HOLD)  # a new transaction, but an old CSeq
        peer.send(older, rig.address)
        assert (await peer.expect(status(500))).cseq == (1, "INVITE")
        assert call.handler.offers == [HOLD]

        dialog.cseq = 3
        bare, _ = dialog.request("INVITE")  # an offerless re-INVITE: not supported, 488
        peer.send(bare, rig.address)
        assert (await peer.receive()).status == 488
        assert call.state == "confirmed"


@run
async def test_info_digits_and_other_bodies():
    async with started() as (rig, peer):
        dialog, call, _ = await confirmed_call(rig, peer)
        handler = call.handler
        for body, kind in ((b"Signal=5\r\nDuration=160\r\n", "application/dtmf-relay"), (b"#", "application/dtmf"),
                           (b"<xml>7</xml>", "application/media_control+xml"), (b"Signal=Z\r\n",
                                                                                 "application/dtmf-relay")):
            info, _ = dialog.request("INFO", body=body, content_type=kind)
            dialog.cseq += 1
            peer.send(info, rig.address)
            answer = await peer.receive()
            assert isinstance(answer, Response) and (answer.status, answer.cseq[1]) == (200, "INFO")
        assert handler.digits == ["5", "#"]


@run
async def test_notify_refer_progress_reaches_transfer():
    async with started() as (rig, peer):
        dialog, call, _ = await confirmed_call(rig, peer)
        notify, _ = dialog.request("NOTIFY", body=b"SIP/2.0 200 OK\r\n", content_type="message/sipfrag;version=2.0",
                                   extra="Event: refer\r\nSubscription-State: terminated;reason=noresource\r\n")
        peer.send(notify, rig.address)
        assert (await peer.receive()).status == 200
        assert await call.handler.next() == ("transfer", "SIP/2.0 200 OK")


# ---------------------------------------------------------------- outside a dialog


@run
async def test_requests_outside_a_dialog():
    async with started() as (rig, peer):
        dialog = Dialog(peer, rig.transport.port)

        async def answer(method_name: str, **kwargs) -> Response:
            data, _ = dialog.request(method_name, **kwargs)
            peer.send(data, rig.address)
            message = await peer.receive()
            assert isinstance(message, Response) and message.call_id == dialog.call_id
            return message

        options = await answer("OPTIONS")
        assert options.status == 200 and "INVITE" in options.headers.all("Allow") and to_tag(options)
        register = await answer("REGISTER")
        assert register.status == 405 and "OPTIONS" in register.headers.all("Allow")
        assert (await answer("FOO")).status == 501
        assert (await answer("INFO")).status == 481  # no dialog to put it in
        hops, _ = dialog.request("OPTIONS")
        peer.send(hops.replace(b"Max-Forwards: 70", b"Max-Forwards: 0"), rig.address)
        assert (await peer.receive()).status == 483

        required = await answer("INVITE", body=OFFER, extra="Require: 100rel\r\n")
        assert required.status == 420 and required.headers.all("Unsupported") == ["100rel"]
        assert rig.invites == 0
        # RFC 4475 §3.3.5 bext01: any request but ACK and CANCEL; every extension listed back
        bext = await answer("OPTIONS", extra="Require: nothingSupportsThis, nothingSupportsThisEither\r\n")
        assert bext.status == 420
        assert bext.headers.all("Unsupported") == ["nothingSupportsThis", "nothingSupportsThisEither"]


@run
async def test_rate_limit_per_source_address():
    async with started() as (rig, peer):
        dialog = Dialog(peer, rig.transport.port)
        loop = asyncio.get_running_loop()
        began = loop.time()
        for number in range(200):
            data, _ = dialog.request("OPTIONS", cseq=number + 1)
            peer.send(data, rig.address)
            if number % 10 == 9:  # the endpoint reads one datagram a turn of the loop: no socket overflow
                await asyncio.sleep(0.002)
        answered = 0
        with contextlib.suppress(TimeoutError):
            while True:
                assert (await peer.receive(within=0.3)).status == 200
                answered += 1
        elapsed = loop.time() - began - 0.3
        limiter = rig.endpoint.limiter
        assert limiter.burst <= answered <= limiter.burst + limiter.rate * elapsed + 2, (answered, elapsed)
        assert rig.endpoint.dropped >= 100 and rig.endpoint.dropped + answered <= 200

        try:
            other = await Peer.open("127.0.0.2")
        except OSError:
            pytest.skip("127.0.0.2 is not usable here")
        try:
            data, _ = Dialog(other, rig.transport.port).request("OPTIONS")
            other.send(data, rig.address)
            assert (await other.receive()).status == 200
        finally:
            other.close()


@run
async def test_unreadable_datagrams():
    async with started() as (rig, peer):
        dialog = Dialog(peer, rig.transport.port)
        data, _ = dialog.request("OPTIONS", body=b"hello", content_type="text/plain")
        peer.send(data.replace(b"Content-Length: 5", b"Content-Length: 50"), rig.address)  # RFC 4475 clerr
        bad = await peer.receive()
        assert isinstance(bad, Response) and bad.status == 400 and "Content-Length" in bad.reason
        assert (bad.call_id, bad.cseq) == (dialog.call_id, (1, "OPTIONS"))
        assert bad.top_via.port == peer.port and NameAddr.parse(bad.headers.get("From") or "").tag == dialog.from_tag

        version, _ = dialog.request("OPTIONS", cseq=2)
        peer.send(version.replace(b" SIP/2.0\r\n", b" SIP/7.0\r\n", 1), rig.address)  # RFC 4475 badvers
        assert (await peer.receive()).status == 505

        peer.send(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(200)), rig.address)  # a TLS hello
        peer.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", rig.address)
        peer.send(b"\r\n\r\n", rig.address)  # a keep-alive
        ack, _ = dialog.request("ACK", cseq=3)
        peer.send(ack.replace(b"CSeq: 3 ACK", b"CSeq: x ACK"), rig.address)  # an ACK is never answered
        await peer.silent(0.3)
        assert rig.transport.stats.unreadable == 5

        good, _ = dialog.request("OPTIONS", cseq=4)
        peer.send(good, rig.address)
        assert (await peer.receive()).status == 200


def test_token_bucket_refills_and_forgets_full_sources():
    now = [0.0]
    bucket = ua.TokenBucket(rate=2.0, burst=3.0, clock=lambda: now[0])
    assert [bucket.allow("192.0.2.1") for _ in range(4)] == [True, True, True, False]
    assert bucket.allow("192.0.2.2")  # another source has its own bucket
    now[0] = 0.5
    assert bucket.allow("192.0.2.1") and not bucket.allow("192.0.2.1")  # one token back in half a second
    for number in range(10001):  # a scan from many addresses
        bucket.allow(f"10.0.{number // 256}.{number % 256}")
    assert len(bucket._levels) > 10000
    now[0] = 10.0  # every bucket full again: forgotten at the next request
    assert bucket.allow("192.0.2.3")
    assert len(bucket._levels) <= 2


@run
async def test_contact_of_an_ipv6_host_is_bracketed():
    async with started(public_host="2001:db8::5") as (rig, _):
        contact = rig.endpoint.contact(Flow("UDP", ("2001:db8::6", 5060)))
        assert contact == f"<sip:kame@[2001:db8::5]:{rig.transport.port}>"
        uri = SipUri.parse(NameAddr.parse(contact).uri)
        assert (uri.host, uri.port) == ("2001:db8::5", rig.transport.port)


# ---------------------------------------------------------------- our requests in a dialog


@run
async def test_refer_info_and_hangup_in_the_dialog():
    async with started() as (rig, peer):
        routes = "Record-Route: <sip:p1.example.com;lr>, <sip:p2.example.com;lr;transport=udp>\r\n"
        dialog, call, ok = await confirmed_call(rig, peer, extra=routes)
        assert ok.headers.all("Record-Route") == ["<sip:p1.example.com;lr>", "<sip:p2.example.com;lr;transport=udp>"]
        peer_contact = f"sip:caller@{LOOPBACK}:{peer.port}"

        def in_dialog(request: Message, name: str, number: int) -> None:
            assert isinstance(request, Request) and request.method == name
            assert request.uri == peer_contact  # the remote target: the peer's Contact
            assert request.call_id == dialog.call_id
            assert NameAddr.parse(request.headers.get("From") or "").tag == dialog.tag
            assert to_tag(request) == dialog.from_tag
            assert request.cseq == (number, name)
            assert request.headers.all("Route") == ["<sip:p1.example.com;lr>",
                                                    "<sip:p2.example.com;lr;transport=udp>"]
            assert request.top_via.branch.startswith("z9hG4bK") and request.top_via.port == rig.transport.port

        refer = asyncio.create_task(call.refer("sip:bob@example.com"))
        request = await peer.receive()
        in_dialog(request, "REFER", 1)
        assert NameAddr.parse(request.headers.get("Refer-To") or "").uri == "sip:bob@example.com"
        assert request.headers.get("Referred-By") and request.headers.get("Contact")
        peer.send(reply(request, 202, "Accepted"), rig.address)
        assert await refer == 202

        info = asyncio.create_task(call.info_digit("7"))
        request = await peer.receive()
        in_dialog(request, "INFO", 2)
        assert request.headers.get("Content-Type") == "application/dtmf-relay"
        assert request.body.startswith(b"Signal=7\r\n")
        peer.send(reply(request, 200), rig.address)
        assert await info == 200

        hangup = asyncio.create_task(call.hangup())
        request = await peer.receive()
        in_dialog(request, "BYE", 3)
        assert await call.handler.next() == ("ended", "hangup")
        peer.send(reply(request, 200), rig.address)
        await asyncio.wait_for(hangup, 2)
        assert call.state == "ended"
        await call.hangup()  # once is enough
        await peer.silent(0.2)


# ---------------------------------------------------------------- an outbound call through a trunk


def credentials(value: str) -> dict[str, str]:
    return {name.lower(): quoted or bare for name, quoted, bare in re.findall(r'(\w+)=(?:"([^"]*)"|([^\s,]+))', value)}


def md5(text: str) -> str:
    return hashlib.md5(text.encode()).hexdigest()


async def trunk_answers(peer: Peer, rig: Rig, invite: Request, *, tag: str, contact: str, routes: str = "") -> None:
    peer.send(reply(invite, 180, "Ringing", tag=tag, extra=f"Contact: <{contact}>\r\n"), rig.address)
    peer.send(reply(invite, 200, tag=tag, extra=f"Contact: <{contact}>\r\n{routes}", body=ANSWER), rig.address)


@run
async def test_outbound_call_with_proxy_digest_challenge():
    async with started() as (rig, peer):
        target = f"sip:+15550100@{LOOPBACK}:{peer.port}"
        rang = asyncio.Event()
        placing = asyncio.create_task(rig.endpoint.invite(
            target, OFFER, Flow("UDP", (LOOPBACK, peer.port)), from_uri="sip:kame@trunk.example.com",
            display="KAME", credentials=("alice", "wonderland"), ringing=rang.set))

        first = await peer.expect(method("INVITE"))
        assert isinstance(first, Request) and first.uri == target and first.body == OFFER
        assert first.cseq == (1, "INVITE") and to_tag(first) is None and "Proxy-Authorization" not in first.headers
        sender = NameAddr.parse(first.headers.get("From") or "")
        assert (sender.display, sender.uri) == ("KAME", "sip:kame@trunk.example.com") and sender.tag
        realm, nonce, opaque = "trunk.example.com", "dcd98b7102dd2f0e8b11d0f600bfb0c093", "5ccc069c403ebaf9"
        challenge = f'Proxy-Authenticate: Digest realm="{realm}", nonce="{nonce}", opaque="{opaque}", ' \
                    'qop="auth", algorithm=MD5\r\n'
        peer.send(reply(first, 407, "Proxy Authentication Required", tag="trunk407", extra=challenge), rig.address)
        ack = await peer.expect(method("ACK"))
        assert isinstance(ack, Request)
        assert ack.top_via.branch == first.top_via.branch and ack.cseq == (1, "ACK") and ack.uri == target
        assert to_tag(ack) == "trunk407" and ack.call_id == first.call_id

        second = await peer.expect(lambda message: method("INVITE")(message) and message.cseq[0] == 2)
        assert isinstance(second, Request)
        assert second.call_id == first.call_id and second.top_via.branch != first.top_via.branch
        assert NameAddr.parse(second.headers.get("From") or "").tag == sender.tag
        params = credentials(second.headers.get("Proxy-Authorization") or "")
        assert (params["username"], params["realm"], params["nonce"], params["uri"]) == ("alice", realm, nonce,
                                                                                         target)
        assert (params["qop"], params["nc"], params["opaque"], params["algorithm"]) == ("auth", "00000001", opaque,
                                                                                        "MD5")
        ha1, ha2 = md5(f"alice:{realm}:wonderland"), md5(f"INVITE:{target}")  # RFC 2617 §3.2.2.1
        assert params["response"] == md5(f"{ha1}:{nonce}:{params['nc']}:{params['cnonce']}:auth:{ha2}")

        contact = f"sip:gw@{LOOPBACK}:{peer.port}"
        routes = "Record-Route: <sip:edge2.trunk.example.com;lr>, <sip:edge1.trunk.example.com;lr>\r\n"
        await trunk_answers(peer, rig, second, tag="trunk200", contact=contact, routes=routes)
        ack = await peer.expect(method("ACK"))
        assert isinstance(ack, Request) and ack.cseq == (2, "ACK") and ack.uri == contact
        assert ack.top_via.branch != second.top_via.branch and ack.top_via.branch.startswith("z9hG4bK")
        assert to_tag(ack) == "trunk200" and ack.call_id == first.call_id
        assert ack.headers.all("Route") == ["<sip:edge1.trunk.example.com;lr>", "<sip:edge2.trunk.example.com;lr>"]

        call = await asyncio.wait_for(placing, 2)
        assert rang.is_set()
        assert call.state == "confirmed" and call.direction == "outbound" and call.answer == ANSWER
        assert call.remote.tag == "trunk200" and call.remote_target == contact

        peer.send(reply(second, 200, tag="trunk200", extra=f"Contact: <{contact}>\r\n", body=ANSWER), rig.address)
        again = await peer.expect(method("ACK"))  # a retransmitted 200: our ACK again
        assert bytes(again) == bytes(ack)

        hangup = asyncio.create_task(call.hangup())
        bye = await peer.expect(method("BYE"))
        assert isinstance(bye, Request) and bye.cseq == (3, "BYE") and to_tag(bye) == "trunk200"
        peer.send(reply(bye, 200), rig.address)
        await asyncio.wait_for(hangup, 2)


@run
async def test_outbound_call_refused_486_acked_in_the_invites_branch():
    async with started() as (rig, peer):
        placing = asyncio.create_task(rig.endpoint.invite(
            f"sip:busy@{LOOPBACK}:{peer.port}", OFFER, Flow("UDP", (LOOPBACK, peer.port)),
            from_uri="sip:kame@example.com"))
        invite = await peer.expect(method("INVITE"))
        peer.send(reply(invite, 486, "Busy Here", tag="busy1"), rig.address)
        ack = await peer.expect(method("ACK"))
        assert isinstance(ack, Request) and isinstance(invite, Request)
        assert ack.top_via.branch == invite.top_via.branch and ack.cseq == (1, "ACK") and to_tag(ack) == "busy1"
        with pytest.raises(CallFailed) as failed:
            await asyncio.wait_for(placing, 2)
        assert (failed.value.status, failed.value.reason) == (486, "Busy Here")

        placing = asyncio.create_task(rig.endpoint.invite(  # a challenge we cannot answer: CallFailed, not more
            f"sip:basic@{LOOPBACK}:{peer.port}", OFFER, Flow("UDP", (LOOPBACK, peer.port)),
            from_uri="sip:kame@example.com", credentials=("alice", "x")))
        invite = await peer.expect(method("INVITE"))
        peer.send(reply(invite, 407, "Proxy Authentication Required", tag="basic1",
                        extra='Proxy-Authenticate: Basic realm="trunk"\r\n'), rig.address)
        with pytest.raises(CallFailed) as failed:
            await asyncio.wait_for(placing, 2)
        assert failed.value.status == 407


@run
async def test_outbound_hangup_while_ringing_sends_cancel(monkeypatch):
    made: list[SipCall] = []

    class Recorded(SipCall):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(ua, "SipCall", Recorded)
    async with started() as (rig, peer):
        placing = asyncio.create_task(rig.endpoint.invite(
            f"sip:slow@{LOOPBACK}:{peer.port}", OFFER, Flow("UDP", (LOOPBACK, peer.port)),
            from_uri="sip:kame@example.com"))
        invite = await peer.expect(method("INVITE"))
        assert isinstance(invite, Request)
        peer.send(reply(invite, 180, "Ringing", tag="slow1"), rig.address)
        await asyncio.sleep(0.05)
        (call,) = made
        hangup = asyncio.create_task(call.hangup("changed my mind"))
        cancel = await peer.expect(method("CANCEL"))
        assert isinstance(cancel, Request)
        assert cancel.top_via.branch == invite.top_via.branch and cancel.uri == invite.uri
        assert cancel.cseq == (1, "CANCEL") and cancel.call_id == invite.call_id
        assert cancel.headers.get("To") == invite.headers.get("To") and cancel.headers.get("From") == \
            invite.headers.get("From")
        peer.send(reply(cancel, 200), rig.address)
        peer.send(reply(invite, 487, "Request Terminated", tag="slow1"), rig.address)
        ack = await peer.expect(method("ACK"))
        assert ack.top_via.branch == invite.top_via.branch and ack.cseq == (1, "ACK")
        await asyncio.wait_for(hangup, 2)
        assert call.state == "ended" and call.end_reason == "changed my mind"
        with pytest.raises(CallFailed) as failed:
            await asyncio.wait_for(placing, 2)
        assert failed.value.status == 487


@run
async def test_an_outbound_call_given_up_while_ringing_is_cancelled():
    """The server's dial timeout cancels the task placing the call: once the callee rings, a CANCEL in the
    INVITE's branch tells it to stop (RFC 3261 §9.1)."""
    async with started() as (rig, peer):
        async def dial() -> None:
            async with asyncio.timeout(0.5):
                await rig.endpoint.invite(f"sip:never@{LOOPBACK}:{peer.port}", OFFER,
                                          Flow("UDP", (LOOPBACK, peer.port)), from_uri="sip:kame@example.com")
        placing = asyncio.create_task(dial())
        invite = await peer.expect(method("INVITE"))
        peer.send(reply(invite, 180, "Ringing", tag="never1"), rig.address)
        cancel = await peer.expect(method("CANCEL"))
        assert isinstance(cancel, Request) and cancel.top_via.branch == invite.top_via.branch
        assert cancel.cseq == (1, "CANCEL") and cancel.call_id == invite.call_id
        peer.send(reply(cancel, 200), rig.address)
        with pytest.raises(TimeoutError):
            await placing
        # the callee answered as the CANCEL crossed it (RFC 3261 §15): its 200 is ACKed, then the call is ended
        peer.send(reply(invite, 200, "OK", tag="never1"), rig.address)
        ack = await peer.expect(method("ACK"))
        assert ack.call_id == invite.call_id and ack.cseq == (1, "ACK")
        bye = await peer.expect(method("BYE"))
        assert bye.call_id == invite.call_id and bye.cseq[1] == "BYE"
        peer.send(reply(bye, 200), rig.address)


@run
async def test_outbound_call_may_ring_longer_than_the_transaction_time(monkeypatch):
    """Timer B stops at a provisional (§17.1.1.2): a phone ringing past TRANSACTION_S is still answered."""
    monkeypatch.setattr(ua, "TRANSACTION_S", 0.4)
    async with started() as (rig, peer):
        placing = asyncio.create_task(rig.endpoint.invite(
            f"sip:patient@{LOOPBACK}:{peer.port}", OFFER, Flow("UDP", (LOOPBACK, peer.port)),
            from_uri="sip:kame@example.com"))
        invite = await peer.expect(method("INVITE"))
        peer.send(reply(invite, 180, "Ringing", tag="late1"), rig.address)
        await asyncio.sleep(0.8)
        assert not placing.done()
        peer.send(reply(invite, 200, tag="late1", extra=f"Contact: <sip:late@{LOOPBACK}:{peer.port}>\r\n",
                        body=ANSWER), rig.address)
        call = await asyncio.wait_for(placing, 2)
        assert call.state == "confirmed" and call.answer == ANSWER

        silent = asyncio.create_task(rig.endpoint.invite(  # no answer at all: 408 after TRANSACTION_S
            f"sip:nobody@{LOOPBACK}:{peer.port}", OFFER, Flow("UDP", (LOOPBACK, peer.port)),
            from_uri="sip:kame@example.com"))
        with pytest.raises(CallFailed) as failed:
            await asyncio.wait_for(silent, 2)
        assert failed.value.status == 408


# ---------------------------------------------------------------- TCP


@run
async def test_invite_over_tcp_answered_on_the_same_connection():
    async with started() as (rig, peer):
        reader, writer = await asyncio.open_connection(LOOPBACK, rig.transport.port)
        try:
            local_port = writer.get_extra_info("sockname")[1]
            dialog = Dialog(peer, rig.transport.port, transport="TCP", peer_port=local_port)
            data, _ = dialog.request("INVITE", body=OFFER)
            writer.write(data[:40])  # in pieces: framed by Content-Length
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(data[40:])
            await writer.drain()
            framer = StreamFramer()
            received: asyncio.Queue[Message] = asyncio.Queue()

            async def read() -> None:
                while chunk := await reader.read(4096):
                    for message in framer.feed(chunk):
                        received.put_nowait(message)

            reading = asyncio.create_task(read())
            assert (await asyncio.wait_for(received.get(), 2)).status == 100
            call = await rig.next_call()
            assert call.flow.transport == "TCP"
            call.accept(ANSWER)
            ok = await asyncio.wait_for(received.get(), 2)
            assert isinstance(ok, Response) and ok.status == 200 and ok.body == ANSWER
            assert ok.headers.get("Contact") == f"<sip:kame@{LOOPBACK}:{rig.transport.port};transport=tcp>"
            assert SipUri.parse(NameAddr.parse(ok.headers.get("Contact") or "").uri).params == {"transport": "tcp"}
            dialog.tag = to_tag(ok)
            writer.write(dialog.ack(f"z9hG4bK{secrets.token_hex(6)}"))
            await writer.drain()
            assert await call.handler.next() == ("confirmed",)
            await asyncio.sleep(0.3)
            assert received.empty()  # a reliable transport: no retransmissions
            assert peer.queue.empty()  # nothing came over UDP
            reading.cancel()
        finally:
            writer.close()


@run
async def test_port_0_finds_a_port_free_for_udp_and_tcp_alike(monkeypatch):
    """The system picks a free UDP port; where TCP's same port is taken by another program, another is tried
    (a race CI's parallel tests met: EADDRINUSE); an explicit port taken is an error at once."""
    import errno

    real, refused = asyncio.start_server, []

    async def start_server(*args, **kwargs):
        if not refused:  # the first port's TCP twin is someone else's
            refused.append(args[2])
            raise OSError(errno.EADDRINUSE, "address already in use")
        return await real(*args, **kwargs)

    monkeypatch.setattr(asyncio, "start_server", start_server)
    transport = SipTransport(lambda message, flow: None)
    await transport.start(LOOPBACK, 0)
    try:
        assert refused and transport.port != 0
        reader, writer = await asyncio.open_connection(LOOPBACK, transport.port)  # TCP listens on the port chosen
        writer.close()
    finally:
        await transport.close()
    refused.clear()
    other = SipTransport(lambda message, flow: None)
    with pytest.raises(OSError):
        await other.start(LOOPBACK, transport.port or 5060)
    await other.close()


@run
async def test_a_named_tls_port_taken_fails_at_once_even_with_port_0(monkeypatch):
    """Port 0 tries other ports for UDP and TCP, never for a TLS port the caller named: that one taken is one
    clear error, on the first try."""
    import socket
    import ssl

    held = socket.socket()
    held.bind((LOOPBACK, 0))
    held.listen()
    tls_port = held.getsockname()[1]
    tries = []
    transport = SipTransport(lambda message, flow: None)
    listen = transport._listen

    async def counted(*args):
        tries.append(args)
        return await listen(*args)

    monkeypatch.setattr(transport, "_listen", counted)
    try:
        with pytest.raises(OSError, match=f"SIP over TLS on port {tls_port}"):
            await transport.start(LOOPBACK, 0, tls=ssl.create_default_context(ssl.Purpose.CLIENT_AUTH),
                                  tls_port=tls_port)
        assert len(tries) == 1
    finally:
        held.close()
        await transport.close()
