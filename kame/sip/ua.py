"""A SIP user agent (RFC 3261 §8, §12-17): server transactions that answer retransmissions, client
transactions that retransmit and time out, dialogs, and calls both ways. What a call means (a session, a
webhook) is the application's: it gets each new INVITE as a `SipCall` and drives it with ringing, accept,
reject, hangup and refer; the call tells its `CallHandler` what the peer does (ACK, BYE, CANCEL, re-INVITE,
keypad digits over INFO, a transfer's progress)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from kame.sip import digest
from kame.sip.message import (
    Headers,
    Message,
    NameAddr,
    Request,
    Response,
    SipError,
    SipUri,
    Via,
    new_branch,
    new_call_id,
    new_tag,
    response_to,
)
from kame.sip.transport import Flow, SipTransport

logger = logging.getLogger(__name__)

T1, T2 = 0.5, 4.0  # RFC 3261 §17.1.1.1: round-trip estimate, the longest retransmit interval
TRANSACTION_S = 64 * T1  # Timers B, F, H, J: how long a transaction lives
RINGING_S = 180.0  # an INVITE of ours answered 1xx: how long it may ring (Timer C's 3 minutes, §16.6) instead of B
ALLOW = "INVITE, ACK, CANCEL, BYE, OPTIONS, INFO, NOTIFY, REFER"
KNOWN = {"REGISTER", "SUBSCRIBE", "PUBLISH", "MESSAGE", "PRACK", "UPDATE"}  # recognised, not offered: 405
DIGITS = set("0123456789*#ABCD")


class CallFailed(Exception):
    """An outbound call's INVITE got a final failure (or none): `status`, `reason`."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{status} {reason}")
        self.status, self.reason = status, reason


class CallHandler(Protocol):
    """What the application hears of a call from the peer."""

    def confirmed(self, call: SipCall) -> None:
        """The ACK of our 200 (an inbound call), or our ACK sent (an outbound one): media may flow both ways."""

    def ended(self, call: SipCall, reason: str) -> None:
        """The call is over (BYE, CANCEL, no ACK, a hangup of ours, the transport gone)."""

    def reoffer(self, call: SipCall, offer: bytes) -> bytes:
        """A re-INVITE's SDP (hold, a codec change): our answer; SipError(488) to refuse it."""

    def digit(self, call: SipCall, digit: str) -> None:
        """A keypad digit sent as SIP INFO."""

    def transfer(self, call: SipCall, status_line: str) -> None:
        """A NOTIFY about the REFER we sent: the transferred call's progress ("SIP/2.0 200 OK")."""


@dataclass
class _ServerTransaction:
    request: Request
    flow: Flow
    response: Response | None = None
    acked: bool = False
    timer: asyncio.TimerHandle | None = None


@dataclass
class _ClientTransaction:
    request: Request
    flow: Flow
    done: asyncio.Future
    provisional: Callable[[Response], None] | None = None
    timer: asyncio.TimerHandle | None = None
    timeout: asyncio.TimerHandle | None = None
    interval: float = T1
    started: float = field(default_factory=time.monotonic)


class TokenBucket:
    """Requests per source address: `rate` a second, `burst` at once; beyond, dropped unread."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self._levels: dict[str, tuple[float, float]] = {}

    def allow(self, source: str) -> bool:
        now = self.clock()
        level, at = self._levels.get(source, (self.burst, now))
        level = min(self.burst, level + (now - at) * self.rate)
        if len(self._levels) > 10000:  # a scan from many addresses: forget the full ones (refilled since)
            self._levels = {key: (old, when) for key, (old, when) in self._levels.items()
                            if old + (now - when) * self.rate < self.burst}
        if level < 1:
            self._levels[source] = (level, now)
            return False
        self._levels[source] = (level - 1, now)
        return True


class SipEndpoint:
    """One user agent on one transport. `on_invite(call)`: a new inbound call, ringing nowhere yet (the
    application answers it at once: ringing, reject, accept)."""

    def __init__(self, transport: SipTransport, on_invite: Callable[[SipCall], None], *, user_agent: str = "KAME",
                 public_host: str | None = None, rate: float = 20.0, burst: float = 60.0) -> None:
        self.transport, self.on_invite, self.user_agent = transport, on_invite, user_agent
        self.public_host = public_host
        transport.handler = self._on_message
        self.limiter = TokenBucket(rate, burst)
        transport.answers_allowed = self.limiter.allow  # a 400 to garbage counts against its source too
        self.dropped = 0  # requests over a source's rate
        self.admits: Callable[[str], bool] = lambda source: True  # who may send a new INVITE (the application's)
        self.refused = 0  # INVITEs from sources not admitted
        self._server: dict[tuple, _ServerTransaction] = {}
        self._client: dict[tuple[str, str], _ClientTransaction] = {}
        self._invites: dict[tuple, SipCall] = {}  # an inbound INVITE's transaction key -> its call (CANCEL)
        self._dialogs: dict[tuple[str, str, str], SipCall] = {}
        self._given_up: dict[str, SipCall] = {}  # outbound calls cancelled while ringing, by Call-ID (their 2xx: BYE)

    # ---------------------------------------------------------------- addresses

    def contact(self, flow: Flow) -> str:
        host, port = self.local_address(flow)
        transport = "" if flow.transport == "UDP" else f";transport={flow.transport.lower()}"
        host = f"[{host}]" if ":" in host else host  # an IPv6 reference (RFC 3261 §25.1)
        return f"<sip:kame@{host}:{port}{transport}>"

    def local_address(self, flow: Flow) -> tuple[str, int]:
        host, port = self.transport.local(flow.transport)
        if self.public_host:
            return self.public_host, port
        if flow.writer is not None:
            return flow.writer.get_extra_info("sockname")[0], port
        if host in ("0.0.0.0", "::", ""):
            return local_ip_toward(flow.address[0]), port
        return host, port

    # ---------------------------------------------------------------- in

    def _on_message(self, message: Message, flow: Flow) -> None:
        if isinstance(message, Response):
            self._on_response(message, flow)
            return
        if not self.limiter.allow(flow.address[0]):
            self.dropped += 1
            if self.dropped in (1, 100, 10000):
                logger.warning("SIP: requests from %s beyond %.0f a second are dropped (%d so far)",
                               flow.address[0], self.limiter.rate, self.dropped)
            return
        self._on_request(message, flow)

    def _on_request(self, request: Request, flow: Flow) -> None:
        via = request.top_via
        if request.method == "ACK":
            self._on_ack(request, via)
            return
        if request.method == "INVITE" and not self.admits(flow.address[0]) \
                and NameAddr.parse(request.headers.get("To") or "").tag is None:
            # a caller not allowed costs one answer and no state (no transaction kept, no retransmission)
            self.transport.send(response_to(request, 403, "not allowed to call this server", to_tag=new_tag()), flow)
            self.refused += 1
            if self.refused in (1, 10, 100, 1000, 10000):
                logger.info("SIP: an INVITE from %s refused (403): not an address allowed to call (%d so far)",
                            flow.address[0], self.refused)
            return
        key = (via.branch, via.host, via.port, request.method)
        known = self._server.get(key)
        if known is not None:  # a retransmission: the last answer again
            if known.response is not None:
                self.transport.send(known.response, flow)
            return
        transaction = _ServerTransaction(request, flow)
        self._server[key] = transaction
        asyncio.get_running_loop().call_later(TRANSACTION_S + 1, self._server.pop, key, None)
        try:
            self._dispatch(request, transaction, key)
        except SipError as exc:
            self.respond(transaction, exc.status, str(exc)[:80])

    def _dispatch(self, request: Request, transaction: _ServerTransaction, key: tuple) -> None:
        forwards = request.headers.get("Max-Forwards")
        if forwards is not None and forwards.strip() == "0":
            raise SipError("Too Many Hops", 483)
        if request.method == "CANCEL":
            self._on_cancel(request, transaction)
            return
        required = request.headers.all("Require")
        if required:  # §8.2.2.3: any request (but ACK, CANCEL) that requires an extension; we support none
            self.respond(transaction, 420, headers=[("Unsupported", ", ".join(required))])
            return
        to_tag = NameAddr.parse(request.headers.get("To") or "").tag
        if to_tag is not None:
            call = self._dialogs.get((request.call_id, to_tag, _from_tag(request)))
            if call is None:
                raise SipError("no such call", 481)
            call._in_dialog(request, transaction)
            return
        if request.method == "INVITE":
            self._new_call(request, transaction, key)
        elif request.method == "OPTIONS":
            self.respond(transaction, 200, headers=[("Allow", ALLOW), ("Accept", "application/sdp")])
        elif request.method in ("BYE", "INFO", "NOTIFY", "REFER"):
            raise SipError("no such call", 481)
        elif request.method in KNOWN:
            self.respond(transaction, 405, headers=[("Allow", ALLOW)])
        else:
            self.respond(transaction, 501, headers=[("Allow", ALLOW)])

    def _new_call(self, request: Request, transaction: _ServerTransaction, key: tuple) -> None:
        call = SipCall(self, request, transaction.flow, "inbound", transaction=transaction)
        self._invites[key[:3]] = call
        self.respond(transaction, 100)
        self.on_invite(call)

    def _on_ack(self, request: Request, via: Via) -> None:
        transaction = self._server.get((via.branch, via.host, via.port, "INVITE"))
        if transaction is not None and transaction.response is not None and transaction.response.status >= 300:
            transaction.acked = True  # the ACK of a failure: its retransmissions stop
            if transaction.timer is not None:
                transaction.timer.cancel()
            return
        to_tag = NameAddr.parse(request.headers.get("To") or "").tag
        call = self._dialogs.get((request.call_id, to_tag or "", _from_tag(request)))
        if call is not None:
            call._acked(request)

    def _on_cancel(self, request: Request, transaction: _ServerTransaction) -> None:
        via = request.top_via
        call = self._invites.get((via.branch, via.host, via.port))
        if call is None:
            self.respond(transaction, 481)
            return
        self.respond(transaction, 200)
        call._cancelled()

    def _on_response(self, response: Response, flow: Flow) -> None:
        number, method = response.cseq
        transaction = self._client.get((response.top_via.branch, method))
        if transaction is None:
            if method == "INVITE" and 200 <= response.status < 300:  # a 2xx retransmitted: our ACK again
                call = self._dialogs.get((response.call_id, _from_tag(response),
                                          NameAddr.parse(response.headers.get("To") or "").tag or ""))
                if call is not None and call._ack is not None:
                    self.transport.send(call._ack, call.flow)
                elif call is None and (given_up := self._given_up.pop(response.call_id, None)) is not None:
                    given_up._established(response)  # answered as we cancelled (§15): ACK it, then BYE
                    given_up.state = "ended"
                    given_up._spawn(given_up._bye("given up before the answer"))
            return
        if response.status < 200:
            if transaction.timer is not None and method == "INVITE":  # Timer A stops at a provisional
                transaction.timer.cancel()
                transaction.timer = None
            if transaction.timeout is not None and method == "INVITE":  # so does B (§17.1.1.2): it rings on
                transaction.timeout.cancel()
                transaction.timeout = asyncio.get_running_loop().call_later(RINGING_S, self._timed_out, transaction)
            if transaction.provisional is not None:
                transaction.provisional(response)
            return
        if method == "INVITE" and response.status >= 300:
            self.transport.send(_ack_failure(transaction.request, response), transaction.flow)
        self._finish(transaction, response)

    # ---------------------------------------------------------------- out

    def respond(self, transaction: _ServerTransaction, status: int, reason: str = "", *,
                headers: Iterable[tuple[str, str]] = (), body: bytes = b"", to_tag: str | None = None) -> Response:
        request = transaction.request
        response = response_to(request, status, reason, to_tag=to_tag or new_tag(), headers=headers, body=body)
        response.headers.add("Server", self.user_agent)
        transaction.response = response
        self.transport.send(response, transaction.flow)
        if request.method == "INVITE" and status >= 300 and transaction.flow.transport == "UDP":
            deadline = asyncio.get_running_loop().time() + TRANSACTION_S  # Timer H: no ACK this long, given up
            self._retransmit_failure(transaction, T1, deadline)  # Timer G, until its ACK
        return response

    def _retransmit_failure(self, transaction: _ServerTransaction, interval: float, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        if transaction.acked or loop.time() + interval > deadline:
            return

        def again() -> None:
            if not transaction.acked and transaction.response is not None:
                self.transport.send(transaction.response, transaction.flow)
                self._retransmit_failure(transaction, min(interval * 2, T2), deadline)
        transaction.timer = loop.call_later(interval, again)

    async def request(self, request: Request, flow: Flow,
                      provisional: Callable[[Response], None] | None = None) -> Response:
        """Send `request` in a client transaction: its final response (a 408 made here when none came)."""
        loop = asyncio.get_running_loop()
        branch = request.top_via.branch
        transaction = _ClientTransaction(request, flow, loop.create_future(), provisional)
        self._client[(branch, request.method)] = transaction
        if not self.transport.send(request, flow):
            self._finish(transaction, Response(503, "the connection is closed"))
        elif flow.transport == "UDP":
            self._retransmit_request(transaction)
        transaction.timeout = loop.call_later(TRANSACTION_S, self._timed_out, transaction)
        try:
            return await transaction.done
        finally:
            transaction.timeout.cancel()
            if transaction.timer is not None:
                transaction.timer.cancel()
            self._client.pop((branch, request.method), None)

    def _retransmit_request(self, transaction: _ClientTransaction) -> None:
        def again() -> None:
            if not transaction.done.done():
                self.transport.send(transaction.request, transaction.flow)
                cap = TRANSACTION_S if transaction.request.method == "INVITE" else T2  # Timer A doubles, E caps
                transaction.interval = min(transaction.interval * 2, cap)
                self._retransmit_request(transaction)
        transaction.timer = asyncio.get_running_loop().call_later(transaction.interval, again)

    def _timed_out(self, transaction: _ClientTransaction) -> None:
        self._finish(transaction, Response(408, "no response"))

    @staticmethod
    def _finish(transaction: _ClientTransaction, response: Response) -> None:
        if not transaction.done.done():
            transaction.done.set_result(response)

    def new_request(self, method: str, uri: str, flow: Flow, headers: Iterable[tuple[str, str]],
                    body: bytes = b"", content_type: str = "application/sdp") -> Request:
        host, port = self.local_address(flow)
        out = Headers()
        out.add("Via", str(Via(flow.transport, host, port, {"branch": new_branch(), "rport": ""})))
        out.add("Max-Forwards", "70")
        for name, value in headers:
            out.add(name, value)
        out.add("User-Agent", self.user_agent)
        if body:
            out.add("Content-Type", content_type)
        return Request(method, uri, out, body)

    # ---------------------------------------------------------------- outbound calls

    async def invite(self, target: str, sdp: bytes, flow: Flow, *, from_uri: str, display: str = "",
                     credentials: tuple[str, str] | None = None, headers: Iterable[tuple[str, str]] = (),
                     ringing: Callable[[], None] | None = None) -> SipCall:
        """Call `target` through `flow` (a trunk or a PBX): the answered call, or CallFailed."""
        SipUri.parse(target)
        local = NameAddr(from_uri, display, {"tag": new_tag()})
        call_id, cseq, extra = new_call_id(self.local_address(flow)[0]), 1, list(headers)
        authorized: list[tuple[str, str]] = []
        for _ in range(3):  # the INVITE, then once per challenge (a proxy's and the domain's)
            request = self.new_request("INVITE", target, flow, [
                ("From", str(local)), ("To", f"<{target}>"), ("Call-ID", call_id), ("CSeq", f"{cseq} INVITE"),
                ("Contact", self.contact(flow)), ("Allow", ALLOW), *authorized, *extra], sdp)
            call = SipCall(self, request, flow, "outbound")
            response = await call._send_invite(ringing)
            if response.status in (401, 407) and credentials is not None:
                field_name = "WWW-Authenticate" if response.status == 401 else "Proxy-Authenticate"
                try:
                    challenge = digest.best_challenge(response.headers.all(field_name))
                    answer = digest.authorization(challenge, method="INVITE", uri=target, username=credentials[0],
                                                  password=credentials[1])
                except digest.DigestError as error:  # a challenge we cannot answer (Basic, an unknown algorithm)
                    raise CallFailed(response.status, str(error)) from None
                authorized.append(("Authorization" if response.status == 401 else "Proxy-Authorization", answer))
                cseq += 1
                continue
            if 200 <= response.status < 300:
                hung_up = call.state == "ended"  # hangup() sent a CANCEL, and the answer crossed it (§15)
                call._established(response)
                if hung_up:
                    call.state = "ended"
                    call._spawn(call._bye("hung up before the answer"))
                    raise CallFailed(487, "hung up before the answer")
                return call
            raise CallFailed(response.status, response.reason)
        raise CallFailed(response.status, "the trunk refused the credentials")


def _from_tag(message: Message) -> str:
    return NameAddr.parse(message.headers.get("From") or "").tag or ""


def _ack_failure(invite: Request, response: Response) -> Request:
    """The ACK of a failure: in the INVITE's transaction (its branch), To with the response's tag (§17.1.1.3)."""
    headers = Headers()
    headers.add("Via", invite.headers.get("Via") or "")
    headers.add("Max-Forwards", "70")
    for name in ("From", "Call-ID", "Route"):
        for value in invite.headers.all(name):
            headers.add(name, value)
    headers.add("To", response.headers.get("To") or "")
    headers.add("CSeq", f"{invite.cseq[0]} ACK")
    return Request("ACK", invite.uri, headers)


def local_ip_toward(address: str) -> str:
    """The local address the system would use to reach `address` (for a server bound to 0.0.0.0)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, 9))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def dtmf_from_info(content_type: str, body: bytes) -> str | None:
    """A keypad digit in an INFO body: application/dtmf-relay ("Signal=5") or application/dtmf ("5")."""
    text = body.decode("utf-8", "replace").strip()
    kind = content_type.split(";")[0].strip().lower()
    if kind == "application/dtmf-relay":
        for line in text.splitlines():
            name, _, value = line.partition("=")
            if name.strip().lower() == "signal":
                text = value.strip()
                break
        else:
            return None
    elif kind != "application/dtmf":
        return None
    digit = {"10": "*", "11": "#"}.get(text, text.upper())
    return digit if digit in DIGITS else None


class SipCall:
    """One call's dialog. Inbound: ringing(), accept(sdp), reject(status); both ways: hangup(), refer(uri)."""

    def __init__(self, endpoint: SipEndpoint, invite: Request, flow: Flow, direction: str, *,
                 transaction: _ServerTransaction | None = None) -> None:
        self.endpoint, self.invite, self.flow, self.direction = endpoint, invite, flow, direction
        self.call_id = invite.call_id
        self.handler: CallHandler | None = None
        self.state = "ringing"  # -> "confirmed" -> "ended"
        self.end_reason = ""
        self.ended = asyncio.Event()
        self.answer: bytes = b""  # the peer's SDP answer (an outbound call)
        self._transaction = transaction
        self._ack: Request | None = None  # an outbound call's ACK (sent again for a retransmitted 200)
        self._ok: Response | None = None  # an inbound call's 200, sent until its ACK
        self._ok_timer: asyncio.TimerHandle | None = None
        self._cseq = 1 if direction == "outbound" else 0
        self._reinvite: _ServerTransaction | None = None
        self._pending: tuple[str, str] | None = None  # an outbound INVITE in flight: (branch, uri) for a CANCEL
        sender = NameAddr.parse(invite.headers.get("From") or "")
        receiver = NameAddr.parse(invite.headers.get("To") or "")
        if direction == "inbound":
            self.local, self.remote = receiver.with_tag(new_tag()), sender
            contact = invite.headers.get("Contact")
            self.remote_target = NameAddr.parse(contact).uri if contact else sender.uri
            self.route = invite.headers.all("Record-Route")
            self.remote_cseq = invite.cseq[0]
        else:
            self.local, self.remote, self.remote_target, self.route = sender, receiver, invite.uri, []
            self.remote_cseq = 0

    @property
    def offer(self) -> bytes:
        return self.invite.body

    def sip_headers(self) -> list[tuple[str, str]]:
        """The INVITE's header fields (what OpenAI's webhook passes on), but Via and the message's framing."""
        left_out = {"via", "content-length", "max-forwards", "route", "record-route", "authorization",
                    "proxy-authorization"}
        return [(name, value) for name, value in self.invite.headers.items if name.lower() not in left_out]

    @property
    def key(self) -> tuple[str, str, str]:
        return self.call_id, self.local.tag or "", self.remote.tag or ""

    # ---------------------------------------------------------------- inbound: the answer

    def ringing(self) -> None:
        if self.state == "ringing" and self._transaction is not None:
            self._respond(180)

    def accept(self, sdp: bytes) -> None:
        """200 OK with our SDP answer, sent again (T1, doubling to T2) until its ACK; none in 32 s: a BYE."""
        if self.state != "ringing" or self._transaction is None:
            raise SipError("the call is not ringing", 481)
        self._ok = self._respond(200, body=sdp)
        self.endpoint._dialogs[self.key] = self
        self.state = "answered"
        if self.flow.transport == "UDP":
            self._resend_ok(T1)
        self._ok_timer = asyncio.get_running_loop().call_later(TRANSACTION_S, self._no_ack)

    def reject(self, status: int, reason: str = "", headers: Iterable[tuple[str, str]] = ()) -> None:
        if self.state == "ringing" and self._transaction is not None:
            self._respond(status, reason, headers=headers)
            self._end(f"rejected {status}")

    def _respond(self, status: int, reason: str = "", *, body: bytes = b"",
                 headers: Iterable[tuple[str, str]] = ()) -> Response:
        extra = [("Contact", self.endpoint.contact(self.flow))] if 100 < status < 300 else []
        if 100 < status < 300:
            extra += [("Record-Route", value) for value in self.route]
        if status == 200:
            extra += [("Allow", ALLOW)]
        assert self._transaction is not None
        return self.endpoint.respond(self._transaction, status, reason, headers=[*extra, *headers], body=body,
                                     to_tag=self.local.tag)

    def _resend_ok(self, interval: float) -> None:
        def again() -> None:
            if self.state == "answered" and self._ok is not None:
                self.endpoint.transport.send(self._ok, self.flow)
                self._resend_ok(min(interval * 2, T2))
        asyncio.get_running_loop().call_later(interval, again)

    def _acked(self, request: Request) -> None:
        if self._reinvite is not None and request.cseq[0] == self._reinvite.request.cseq[0]:
            self._reinvite = None
            return
        if self.state == "answered":
            self.state = "confirmed"
            if self._ok_timer is not None:
                self._ok_timer.cancel()
            if self.handler is not None:
                self.handler.confirmed(self)

    def _no_ack(self) -> None:
        if self.state == "answered":
            logger.info("SIP call %s: no ACK of our 200 in %.0f s: ended", self.call_id, TRANSACTION_S)
            self._spawn(self.hangup("no ACK"))

    def _cancelled(self) -> None:
        if self.state == "ringing" and self._transaction is not None:
            self._respond(487)
            self._end("cancelled")

    # ---------------------------------------------------------------- outbound: the INVITE

    async def _send_invite(self, ringing: Callable[[], None] | None) -> Response:
        self._pending = (self.invite.top_via.branch, self.invite.uri)

        heard = False

        def provisional(response: Response) -> None:
            nonlocal heard
            heard = True
            if response.status in (180, 183) and ringing is not None:
                ringing()
        try:
            return await self.endpoint.request(self.invite, self.flow, provisional)
        except asyncio.CancelledError:  # given up (a dial timeout, the caller gone): the callee stops ringing
            if heard:  # RFC 3261 §9.1: a CANCEL only once a provisional response came
                self._spawn(self._cancel())
            self.endpoint._given_up[self.call_id] = self
            asyncio.get_running_loop().call_later(TRANSACTION_S, self.endpoint._given_up.pop, self.call_id, None)
            raise
        finally:
            self._pending = None

    def _established(self, response: Response) -> None:
        self.remote = NameAddr.parse(response.headers.get("To") or "")
        contact = response.headers.get("Contact")
        if contact:
            self.remote_target = NameAddr.parse(contact).uri
        self.route = list(reversed(response.headers.all("Record-Route")))
        self.answer = response.body
        self._cseq = self.invite.cseq[0]
        self._ack = self._in_dialog_request("ACK", cseq=self._cseq)
        self.endpoint.transport.send(self._ack, self.flow)
        self.endpoint._dialogs[self.key] = self
        self.state = "confirmed"

    # ---------------------------------------------------------------- in the dialog

    def _in_dialog(self, request: Request, transaction: _ServerTransaction) -> None:
        endpoint = self.endpoint
        if request.cseq[0] < self.remote_cseq and request.method != "ACK":
            raise SipError("CSeq out of order", 500)
        self.remote_cseq = request.cseq[0]
        match request.method:
            case "BYE":
                endpoint.respond(transaction, 200, to_tag=self.local.tag)
                self._end("bye")
            case "INVITE":
                self._reoffered(request, transaction)
            case "INFO":
                endpoint.respond(transaction, 200, to_tag=self.local.tag)
                digit = dtmf_from_info(request.headers.get("Content-Type") or "", request.body)
                if digit is not None and self.handler is not None:
                    self.handler.digit(self, digit)
            case "NOTIFY":
                endpoint.respond(transaction, 200, to_tag=self.local.tag)
                if (request.headers.get("Event") or "").split(";")[0].strip().lower() == "refer" and self.handler:
                    self.handler.transfer(self, request.body.decode("utf-8", "replace").split("\r\n")[0].strip())
            case "OPTIONS":
                endpoint.respond(transaction, 200, headers=[("Allow", ALLOW)], to_tag=self.local.tag)
            case "REFER":
                endpoint.respond(transaction, 403, "transfers are made by the server", to_tag=self.local.tag)
            case _:
                endpoint.respond(transaction, 405 if request.method in KNOWN else 501, headers=[("Allow", ALLOW)],
                                 to_tag=self.local.tag)

    def _reoffered(self, request: Request, transaction: _ServerTransaction) -> None:
        if self._reinvite is not None and self._reinvite.response is None:
            self.endpoint.respond(transaction, 491, to_tag=self.local.tag)
            return
        if self.handler is None or not request.body:
            raise SipError("a re-INVITE without an offer is not supported", 488)
        answer = self.handler.reoffer(self, request.body)  # SipError(488) refuses it
        contact = request.headers.get("Contact")
        if contact:
            self.remote_target = NameAddr.parse(contact).uri
        self._reinvite = transaction
        self.endpoint.respond(transaction, 200, headers=[("Contact", self.endpoint.contact(self.flow))],
                              body=answer, to_tag=self.local.tag)

    def _in_dialog_request(self, method: str, *, cseq: int | None = None, headers: Iterable[tuple[str, str]] = (),
                           body: bytes = b"", content_type: str = "application/sdp") -> Request:
        if cseq is None:
            self._cseq += 1
            cseq = self._cseq
        fields = [("From", str(self.local)), ("To", str(self.remote)), ("Call-ID", self.call_id),
                  ("CSeq", f"{cseq} {method}"), *[("Route", value) for value in self.route], *headers]
        return self.endpoint.new_request(method, self.remote_target, self.flow, fields, body, content_type)

    async def hangup(self, reason: str = "hangup") -> None:
        """End the call from our side: a BYE once answered, a CANCEL while our INVITE rings, 603 while theirs
        does."""
        if self.state == "ended":
            return
        if self.state == "ringing":
            if self.direction == "inbound":
                self.reject(603)
            elif self._pending is not None:
                await self._cancel()
            self._end(reason)
            return
        self._end(reason)  # the slot goes back now; the BYE's answer only tells us the peer heard
        if self._ok_timer is not None:
            self._ok_timer.cancel()
        await self._bye(reason)

    async def _bye(self, reason: str) -> None:
        response = await self.endpoint.request(self._in_dialog_request("BYE"), self.flow)
        if response.status >= 300:
            logger.info("SIP call %s (%s): the BYE got %d %s", self.call_id, reason, response.status,
                        response.reason)

    async def _cancel(self) -> None:
        branch, uri = self.invite.top_via.branch, self.invite.uri
        headers = Headers()
        via = self.invite.top_via
        headers.add("Via", str(Via(via.transport, via.host, via.port, {"branch": branch, **{
            k: v for k, v in via.params.items() if k != "branch"}})))
        headers.add("Max-Forwards", "70")
        for name in ("From", "To", "Call-ID", "Route"):
            for value in self.invite.headers.all(name):
                headers.add(name, value)
        headers.add("CSeq", f"{self.invite.cseq[0]} CANCEL")
        await self.endpoint.request(Request("CANCEL", uri, headers), self.flow)

    async def refer(self, target: str) -> int:
        """Ask the peer to call `target` (REFER, RFC 3515): the REFER's status (202: it will try)."""
        SipUri.parse(target)
        if self.state not in ("confirmed", "answered"):
            raise SipError("the call is not answered", 481)
        referred_by = self.local.uri
        request = self._in_dialog_request("REFER", headers=[("Refer-To", f"<{target}>"),
                                                             ("Referred-By", f"<{referred_by}>"),
                                                             ("Contact", self.endpoint.contact(self.flow))])
        response = await self.endpoint.request(request, self.flow)
        return response.status

    async def info_digit(self, digit: str, duration_ms: int = 160) -> int:
        """Send a keypad digit as SIP INFO (application/dtmf-relay), where RTP events were not negotiated."""
        body = f"Signal={digit}\r\nDuration={duration_ms}\r\n".encode()
        response = await self.endpoint.request(
            self._in_dialog_request("INFO", body=body, content_type="application/dtmf-relay"), self.flow)
        return response.status

    def _end(self, reason: str) -> None:
        if self.state == "ended":
            return
        self.state, self.end_reason = "ended", reason
        self.ended.set()
        loop = asyncio.get_running_loop()
        loop.call_later(TRANSACTION_S, self.endpoint._dialogs.pop, self.key, None)  # late requests still match
        if self.direction == "inbound":  # a late CANCEL still finds it; then the INVITE is forgotten
            via = self.invite.top_via
            loop.call_later(TRANSACTION_S, self.endpoint._invites.pop, (via.branch, via.host, via.port), None)
        if self.handler is not None:
            with contextlib.suppress(Exception):
                self.handler.ended(self, reason)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=f"sip-call-{self.call_id[:12]}")
        _background.add(task)
        task.add_done_callback(_background.discard)


_background: set[asyncio.Task] = set()
