"""KAME's SIP door: INVITEs in (from the addresses allowed), the call rung and announced by OpenAI's webhooks,
then answered by the REST call control (or at once, with no webhook configured); an answered call runs the
phone path (server/phone/carrier.py) over RTP. A call costs nothing before it is accepted but its webhook
posts: no slot, no model, no RTP port."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import ssl
from dataclasses import dataclass, field

from kame.errors import EngineError, SessionError
from kame.sip import sdp
from kame.sip.message import SipError, SipUri
from kame.sip.rtp import RtpFormat, RtpSession
from kame.sip.transport import Flow, SipTransport
from kame.sip.ua import CallFailed, SipCall, SipEndpoint
from server.phone import audio as phone_audio
from server.phone.carrier import PhoneCarrier
from server.runner import SessionRunner
from server.settings import ServerSettings
from server.sip.link import RtpLink, SipStream
from server.sip.webhooks import WebhookPoster, live_transport_incoming, realtime_call_incoming

logger = logging.getLogger(__name__)

SILENCE = {"PCMU": b"\xff", "PCMA": b"\xd5"}  # G.722's: encoded once, where PyAV has the codec
ENCODING = {"PCMU": ("audio/pcmu", 8000), "PCMA": ("audio/pcma", 8000), "G722": ("audio/g722", 16000)}
RINGING_PER_SLOT = 4  # calls ringing (announced, not yet accepted) at most per free slot
REALTIME_MODELS = ("gpt-realtime", "gpt-4o-realtime", "gpt-4o-mini-realtime", "gpt-live")  # OpenAI's, not a profile


class ControlError(Exception):
    """A call-control request that cannot be done: `status` (HTTP), `code`, the message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class Call:
    """A SIP call from its INVITE to its end: its ids (OpenAI's Realtime call id, GPT-Live's session id)."""

    sip: SipCall
    offer: sdp.SessionDescription
    realtime_id: str = field(default_factory=lambda: "rtc_" + secrets.token_hex(16))
    live_id: str = field(default_factory=lambda: "live_" + secrets.token_hex(16))
    accepted_by: str | None = None  # "realtime" | "live" | "default"
    runner: SessionRunner | None = None
    link: RtpLink | None = None
    rtp: RtpSession | None = None
    ring_timer: asyncio.TimerHandle | None = None
    tasks: set[asyncio.Task] = field(default_factory=set)
    codec: str | None = None  # the codec the call's audio path was built for: a re-INVITE keeps it
    sdp_id: int = field(default_factory=lambda: secrets.randbelow(2**31))  # our SDP's o= id ...
    sdp_version: int = 1  # ... and version, one more each answer (RFC 3264 §8)


class SipDoor:
    """The SIP endpoint of one server: `start()` at the app's start-up, `close()` at its end."""

    def __init__(self, settings: ServerSettings, state) -> None:
        self.settings, self.sip, self.state = settings, settings.sip, state  # state: the app's (services, sessions)
        self.allowed = [ipaddress.ip_network(net, strict=False) for net in self.sip.allow_from]
        self.calls: dict[str, Call] = {}  # by either id
        self.transport = SipTransport(lambda message, flow: None)
        self.endpoint = SipEndpoint(self.transport, self._on_invite, public_host=self.sip.public_host,
                                    rate=self.sip.requests_per_s, burst=self.sip.requests_per_s * 3)
        self.endpoint.admits = self._allowed  # refused before the stack keeps anything of the call
        self.poster: WebhookPoster | None = None
        self.refused = 0
        self.codecs = tuple(self.sip.codecs)
        self.silence = dict(SILENCE)
        if "G722" in self.codecs:
            if phone_audio.g722_available():
                self.silence["G722"] = phone_audio.g722_silence()
            else:
                logger.warning("SIP: G.722 needs PyAV (pip install av); calls are answered in %s only",
                               "/".join(c for c in self.codecs if c != "G722"))
                self.codecs = tuple(c for c in self.codecs if c != "G722")

    async def start(self) -> None:
        host, port = parse_listen(self.sip.listen or "")
        tls = None
        if self.sip.tls_certificate:
            tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls.load_cert_chain(self.sip.tls_certificate, self.sip.tls_key)
        await self.transport.start(host, port, tls=tls, tls_port=self.sip.tls_port)
        if self.sip.webhook_url:
            secret = self.sip.webhook_secret.get_secret_value() if self.sip.webhook_secret else None
            self.poster = WebhookPoster(self.sip.webhook_url, secret)
        logger.info("SIP: listening on %s:%d (UDP, TCP%s); calls from %s %s", host, self.transport.port,
                    f", TLS on {self.transport.tls_port}" if tls else "", ", ".join(self.sip.allow_from),
                    f"announced to {self.sip.webhook_url}" if self.poster else "answered with the default session")

    async def close(self) -> None:
        for call in list({id(c): c for c in self.calls.values()}.values()):
            if call.runner is None:
                call.sip.reject(503, "the server is shutting down")
        await self.transport.close()
        if self.poster is not None:
            await self.poster.aclose()

    # ---------------------------------------------------------------- a new call

    def _on_invite(self, sip_call: SipCall) -> None:
        source = sip_call.flow.address[0]
        if not self._allowed(source):
            self.refused += 1
            logger.info("SIP: an INVITE from %s refused: not in [sip] allow_from", source)
            sip_call.reject(403, "not allowed to call this server")
            return
        services = self.state.services
        if services is None or self.state.draining:
            sip_call.reject(503, "the server is not taking calls now")
            return
        free = services.runtime.runner.free_slots
        if free <= 0:
            logger.info("SIP call from %s refused: every session slot is in use", source)
            sip_call.reject(486, "every session slot is in use")
            return
        if self._ringing() >= RINGING_PER_SLOT * free:  # ringing costs no slot, but a flood of it webhooks
            logger.info("SIP call from %s refused: %d calls ring already", source, self._ringing())
            sip_call.reject(486, "too many calls are ringing")
            return
        try:
            offer = sdp.parse(sip_call.offer.decode("utf-8", "replace"))
            sdp.answer(offer, address="0.0.0.0", port=9, session_id=1, session_version=1,
                       supported=self.codecs)  # only to check a codec fits, before ringing
        except sdp.NoCommonCodec as exc:
            sip_call.reject(488, str(exc)[:80])
            return
        except sdp.SdpError as exc:
            sip_call.reject(400 if sip_call.offer else 488, f"the offer: {exc}"[:80])
            return
        call = Call(sip_call, offer)
        sip_call.handler = _Handler(self, call)
        self.calls[call.realtime_id] = self.calls[call.live_id] = call
        if self.poster is None:
            self._spawn(call, self._accept(call, "default", {}), "answer")
            return
        sip_call.ringing()
        call.ring_timer = asyncio.get_running_loop().call_later(self.sip.ring_timeout_s, self._unanswered, call)
        for event in self.sip.webhook_events:
            self._spawn(call, self._announce(call, event), "webhook")

    def _ringing(self) -> int:
        calls = {id(call): call for call in self.calls.values()}.values()
        return sum(1 for call in calls if call.accepted_by is None and call.sip.state == "ringing")

    def _allowed(self, source: str) -> bool:
        try:
            address = ipaddress.ip_address(source)
        except ValueError:
            return False
        return any(address in network for network in self.allowed)

    async def _announce(self, call: Call, event: str) -> None:
        headers = call.sip.sip_headers()
        body = (realtime_call_incoming(call.realtime_id, headers) if event == "realtime.call.incoming"
                else live_transport_incoming(call.live_id, headers))
        assert self.poster is not None
        delivery = await self.poster.post(body, still_wanted=lambda: call.accepted_by is None
                                          and call.sip.state == "ringing")
        if not delivery.delivered and call.sip.state == "ringing":
            logger.warning("SIP call %s: the %s webhook was not delivered (%s)", call.realtime_id, event,
                           delivery.error or delivery.status)

    def _unanswered(self, call: Call) -> None:
        if call.accepted_by is None and call.sip.state == "ringing":
            logger.info("SIP call %s: not accepted within %.0f s: declined", call.realtime_id, self.sip.ring_timeout_s)
            call.sip.reject(480, "nobody accepted the call")

    # ---------------------------------------------------------------- call control (REST)

    def find(self, call_id: str) -> Call:
        call = self.calls.get(call_id)
        if call is None:
            raise ControlError(404, "call_not_found", f"no call {call_id!r}")
        return call

    async def accept(self, call_id: str, kind: str, params: dict[str, str], realtime: dict | None = None) -> None:
        """Answer the ringing call: GPT-Live's session with `params`, or (`realtime`: the accept's body) the
        Realtime API's session so configured."""
        call = self.find(call_id)
        if call.accepted_by is not None:
            raise ControlError(409, "call_already_accepted",
                               f"the call was accepted already (by the {call.accepted_by} call control)")
        if call.sip.state != "ringing":
            raise ControlError(409, "call_ended", f"the call is over ({call.sip.end_reason})")
        if self.state.draining:
            raise ControlError(503, "server_busy", "the server is shutting down")
        await self._accept(call, kind, params, realtime)

    def reject(self, call_id: str, status: int) -> None:
        call = self.find(call_id)
        if call.accepted_by is not None or call.sip.state != "ringing":
            raise ControlError(409, "call_not_ringing", "only a ringing call can be rejected (hang up an answered one)")
        if not 300 <= status <= 699:
            raise ControlError(400, "invalid_value", f"status_code {status}: a SIP final status (300-699)")
        call.sip.reject(status)

    async def refer(self, call_id: str, target: str) -> None:
        _header_safe(target, "target_uri")
        call = self.find(call_id)
        try:
            status = await call.sip.refer(target)
        except SipError as exc:
            raise ControlError(409 if exc.status == 481 else 400, "refer_failed", str(exc)) from None
        if status >= 300:
            raise ControlError(502, "refer_refused", f"the caller's side answered the REFER {status}")

    async def hangup(self, call_id: str) -> None:
        call = self.find(call_id)
        if call.sip.state == "ended":
            raise ControlError(409, "call_ended", f"the call is over ({call.sip.end_reason})")
        await call.sip.hangup("hung up by the call control")

    # ---------------------------------------------------------------- answering

    async def _accept(self, call: Call, kind: str, params: dict[str, str], realtime: dict | None = None) -> None:
        call.accepted_by = kind
        if call.ring_timer is not None:
            call.ring_timer.cancel()
        try:
            rtp, link, runner, tandem = await self._open(call.sip, call.live_id)
        except (EngineError, SessionError) as exc:
            call.sip.reject(486 if isinstance(exc, EngineError) else 500, str(exc)[:80])
            raise ControlError(503, "server_busy", str(exc)) from None
        except BaseException:
            call.sip.reject(500)
            raise
        try:
            answer, codec, dtmf = sdp.answer(call.offer, address=self._media_address(call.sip.flow), port=rtp.port,
                                             session_id=call.sdp_id, session_version=call.sdp_version,
                                             supported=self.codecs)
        except (sdp.SdpError, ValueError) as exc:
            await _discard(rtp, runner, tandem)
            call.sip.reject(488, str(exc)[:80])
            raise ControlError(400, "invalid_offer", str(exc)) from None
        if self.state.draining:  # the server began to stop while the slot was being taken
            await _discard(rtp, runner, tandem)
            call.sip.reject(503, "the server is shutting down")
            raise ControlError(503, "server_busy", "the server is shutting down")
        try:
            call.sip.accept(answer.encode())
        except SipError:  # the caller hung up (CANCEL) while the slot was being taken
            await _discard(rtp, runner, tandem)
            raise ControlError(409, "call_ended", f"the call is over ({call.sip.end_reason})") from None
        audio = call.offer.audio()
        assert audio is not None
        try:
            self._run_call(call, rtp, link, runner, tandem, (audio.address, audio.port), codec, dtmf, params, realtime)
        except BaseException:
            await _discard(rtp, runner, tandem)
            self._spawn(call, call.sip.hangup("the call could not start"), "hangup")
            raise
        logger.info("SIP call %s from %s answered (%s, %s): session %s", call.realtime_id, call.sip.flow.address[0],
                    kind, codec.name, runner.id)

    async def _open(self, sip_call: SipCall | None, session_id: str):
        """The call's RTP port and session slot: (rtp, link, runner, tandem); all given back on a failure."""
        services = self.state.services
        rtp = runner = tandem = None
        try:
            rtp = await RtpSession.open(self._rtp_host(), ports=self._rtp_ports(), jitter_ms=self.sip.jitter_ms,
                                        timeout_s=self.sip.rtp_timeout_s)
            link = RtpLink(sip_call, rtp)
            runner = SessionRunner(services, link, "sip")
            runner.id = session_id  # GPT-Live's sideband attaches by it
            tandem = await runner.open(services.settings.session_config(stats_interval_s=None))
        except BaseException:
            await _discard(rtp, runner, tandem)
            raise
        return rtp, link, runner, tandem

    def _run_call(self, call: Call, rtp: RtpSession, link: RtpLink, runner: SessionRunner, tandem,
                  remote: tuple[str, int], codec: sdp.Codec, dtmf: sdp.Codec | None, params: dict[str, str],
                  realtime: dict | None = None) -> None:
        """Media both ways and the phone path's session on the call (GPT-Live's, or `realtime`'s), as a task
        among the server's sessions."""
        phone = self.settings.phone
        carrier = PhoneCarrier(runner, tandem, SipStream(), lead_frames=phone.lead_frames,
                               keypad_to_llm=phone.keypad_to_llm, realtime=realtime)
        call.runner, call.link, call.rtp, call.codec = runner, link, rtp, codec.name
        # only the SDP's address or the signalling peer's may become the RTP peer (not a stranger's spray)
        sources = {remote[0], call.sip.flow.address[0]}
        rtp.latch_from = lambda source: source in sources or self._allowed(source)
        rtp.start(remote, self._format(codec, dtmf), on_audio=link.audio, on_digit=link.digit,
                  on_timeout=lambda: link.stopped(f"no RTP for {self.sip.rtp_timeout_s:.0f} s"))
        audio = call.offer.audio()
        if audio is not None and on_hold(audio):  # a call that starts on hold (inactive, 0.0.0.0)
            rtp.update(None, hold=True)
            link.held = True
        link.started(call.realtime_id, *ENCODING[codec.name], params)
        self.state.sessions.add(runner)
        self._spawn(call, self._run(call, runner, tandem, carrier), "session")

    # ---------------------------------------------------------------- outbound calls

    async def dial(self, params: dict[str, str], transport: dict) -> Call:
        """GPT-Live's SIP transport: call `destination` through the trunk; the answered call (ControlError)."""
        target, flow_to, from_uri, credentials = self._outbound(transport)
        services = self.state.services
        if services is None or self.state.draining:
            raise ControlError(503, "server_busy", "the server is not taking calls now")
        live_id, sdp_id = "live_" + secrets.token_hex(16), secrets.randbelow(2**31)
        try:
            rtp, link, runner, tandem = await self._open(None, live_id)
        except (EngineError, SessionError) as exc:
            raise ControlError(503, "server_busy", str(exc)) from None
        sip_call = None
        try:
            flow = await self.transport.connect(*flow_to)
            codecs = sdp.codecs_for(self.codecs)
            offer = sdp.offer(address=self._media_address(flow), port=rtp.port, session_id=sdp_id,
                              session_version=1, codecs=codecs)
            async with asyncio.timeout(self.sip.dial_timeout_s):  # then a CANCEL: the callee stops ringing
                sip_call = await self.endpoint.invite(target, offer.encode(), flow, from_uri=from_uri,
                                                      credentials=credentials)
            answer = sdp.parse(sip_call.answer.decode("utf-8", "replace"))
            codec, dtmf = sdp.negotiated(answer, codecs)
            audio = answer.audio()
            if audio is None:
                raise sdp.SdpError("the answer has no audio stream")
        except (CallFailed, OSError, TimeoutError, sdp.SdpError, SipError) as exc:
            await _discard(rtp, runner, tandem)
            if sip_call is not None:
                await sip_call.hangup("the answer's SDP cannot be used")
            status = exc.status if isinstance(exc, CallFailed) else None
            reason = f"no answer within {self.sip.dial_timeout_s:.0f} s" if isinstance(exc, TimeoutError) else exc
            raise ControlError(502, "call_failed", f"the call to {target} failed: {reason}"
                               + (f" (SIP {status})" if status else "")) from None
        except BaseException:
            await _discard(rtp, runner, tandem)
            raise
        call = Call(sip_call, answer, live_id=live_id, accepted_by="outbound", sdp_id=sdp_id)  # our offer's o= id
        sip_call.handler = _Handler(self, call)
        link.call = sip_call
        self.calls[call.realtime_id] = self.calls[call.live_id] = call
        self._run_call(call, rtp, link, runner, tandem, (audio.address, audio.port), codec, dtmf, params)
        logger.info("SIP call %s to %s answered (%s): session %s", call.realtime_id, target, codec.name, live_id)
        return call

    def _outbound(self, transport: dict) -> tuple[str, tuple[str, tuple[str, int]], str, tuple[str, str] | None]:
        """(the Request-URI, (transport, the trunk's address), our From, digest credentials) of a SIP transport
        `{type: "sip", destination, trunk: {provider_url, auth: {type: "digest", username, password},
        caller_number}}`; plain SIP only toward a trusted trunk."""
        destination, trunk = transport.get("destination"), transport.get("trunk")
        if not isinstance(destination, str) or not destination:
            raise ControlError(400, "missing_required_parameter", "transport.destination (+E.164 or a sip: URI)")
        _header_safe(destination, "transport.destination")
        if not isinstance(trunk, dict) or not isinstance(trunk.get("provider_url"), str):
            raise ControlError(400, "missing_required_parameter",
                               "transport.trunk.provider_url (sips:host or sip:host)")
        try:
            provider = SipUri.parse(trunk["provider_url"])
        except SipError as exc:
            raise ControlError(400, "invalid_value", f"transport.trunk.provider_url: {exc}") from None
        kind = provider.params.get("transport", "tls" if provider.scheme == "sips" else "udp").upper()
        if kind not in ("UDP", "TCP", "TLS"):
            raise ControlError(400, "invalid_value", f"transport.trunk.provider_url: transport {kind.lower()}")
        port = provider.port or (5061 if kind == "TLS" else 5060)
        if kind != "TLS" and not self._trusted_trunk(provider.host, port):
            raise ControlError(403, "trunk_not_trusted", f"plain SIP (no TLS) only toward [sip] trusted_trunks; "
                               f"{provider.host}:{port} is not one")
        target = destination if destination.startswith(("sip:", "sips:")) else \
            str(SipUri("sip", destination, provider.host, provider.port))
        caller = trunk.get("caller_number")
        if isinstance(caller, str):
            _header_safe(caller, "transport.trunk.caller_number")
        from_uri = str(SipUri("sip", caller if isinstance(caller, str) and caller else "kame", provider.host))
        auth = trunk.get("auth")
        credentials = None
        if isinstance(auth, dict) and auth.get("type") == "digest":
            credentials = (str(auth.get("username", "")), str(auth.get("password", "")))
        return target, (kind, (provider.host, port)), from_uri, credentials

    def _trusted_trunk(self, host: str, port: int) -> bool:
        return any(entry in (host, f"{host}:{port}") for entry in self.sip.trusted_trunks)

    async def _run(self, call: Call, runner: SessionRunner, tandem, carrier: PhoneCarrier) -> None:
        try:
            await runner.run(tandem, carrier)
        finally:
            self.state.sessions.discard(runner)
            if call.rtp is not None:
                await call.rtp.close()
            if call.sip.state != "ended":
                await call.sip.hangup("the session ended")
            if call.accepted_by == "outbound" and call.sip.flow.writer is not None:
                call.sip.flow.writer.close()  # the TCP/TLS connection this call opened to its trunk

    def _format(self, codec: sdp.Codec, dtmf: sdp.Codec | None) -> RtpFormat:
        return RtpFormat(codec.payload_type, silence=self.silence[codec.name],
                         dtmf_payload_type=dtmf.payload_type if dtmf else None)

    def _rtp_host(self) -> str:
        return self.sip.rtp_host or parse_listen(self.sip.listen or "")[0]

    def _rtp_ports(self) -> tuple[int, int] | None:
        return (self.sip.rtp_port_min, self.sip.rtp_port_max) if self.sip.rtp_port_min else None

    def _media_address(self, flow: Flow) -> str:
        """The address our SDP names: the public host, else RTP's own when bound to one, else the one the peer
        reaches us on."""
        if self.sip.public_host:
            return self.sip.public_host
        rtp_host = self._rtp_host()
        if rtp_host not in ("0.0.0.0", "::", ""):
            return rtp_host
        return self.endpoint.local_address(flow)[0]

    def _forget(self, call: Call) -> None:
        if call.ring_timer is not None:
            call.ring_timer.cancel()
        loop = asyncio.get_running_loop()
        for key in (call.realtime_id, call.live_id):  # control requests soon after the end get "call_ended"
            loop.call_later(60.0, self.calls.pop, key, None)

    def _spawn(self, call: Call, coro, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=f"sip-{name}-{call.realtime_id}")
        call.tasks.add(task)
        task.add_done_callback(lambda done: (call.tasks.discard(done), _log_failure(done)))


class _Handler:
    """What the peer does to one call, passed on to the call's session."""

    def __init__(self, door: SipDoor, call: Call) -> None:
        self.door, self.call = door, call

    def confirmed(self, sip_call: SipCall) -> None:
        pass

    def ended(self, sip_call: SipCall, reason: str) -> None:
        if self.call.link is not None:
            self.call.link.stopped(reason)
        self.door._forget(self.call)

    def reoffer(self, sip_call: SipCall, offer_bytes: bytes) -> bytes:
        """A re-INVITE: hold (sendonly/inactive), resume, or a new address or codec."""
        try:
            offer = sdp.parse(offer_bytes.decode("utf-8", "replace"))
            rtp = self.call.rtp
            port = rtp.port if rtp is not None else 9
            # the call's audio path was built for one codec: a re-INVITE keeps it (or is refused, 488)
            keep = (self.call.codec,) if self.call.codec else self.door.codecs
            self.call.sdp_version += 1
            answer, codec, dtmf = sdp.answer(offer, address=self.door._media_address(sip_call.flow), port=port,
                                             session_id=self.call.sdp_id, session_version=self.call.sdp_version,
                                             supported=keep)
        except (sdp.SdpError, ValueError) as exc:
            raise SipError(str(exc)[:80], 488) from None
        audio = offer.audio()
        if rtp is not None and audio is not None:
            hold = on_hold(audio)
            rtp.update((audio.address, audio.port) if not hold else None, self.door._format(codec, dtmf), hold=hold)
            if self.call.link is not None:
                self.call.link.held = hold  # the caller's music on hold is not the caller's words
        self.call.offer = offer
        return answer.encode()

    def digit(self, sip_call: SipCall, digit: str) -> None:
        if self.call.link is not None:
            self.call.link.digit(digit)

    def transfer(self, sip_call: SipCall, status_line: str) -> None:
        logger.info("SIP call %s: the transfer: %s", self.call.realtime_id, status_line)


def _header_safe(value: str, param: str) -> None:
    """What goes into a SIP header from a request: no whitespace, line breaks, quotes or angle brackets."""
    if not value or any(char.isspace() or char in '<>"' for char in value) or len(value) > 256:
        raise ControlError(400, "invalid_value", f"{param}: a SIP URI or a number, with no spaces, quotes or <>")


def on_hold(audio: sdp.Media) -> bool:
    """The offer puts the call on hold: sendonly or inactive, or the old form, a 0.0.0.0 address."""
    return audio.direction in ("sendonly", "inactive") or audio.address in ("0.0.0.0", "::")


async def _discard(rtp: RtpSession | None, runner: SessionRunner | None, tandem) -> None:
    if tandem is not None:
        await tandem.aclose()
    if runner is not None:
        await runner.discard_recording()
    if rtp is not None:
        await rtp.close()


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None and not isinstance(task.exception(), ControlError):
        logger.error("SIP: %s failed", task.get_name(), exc_info=task.exception())


def parse_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"[sip] listen {listen!r}: HOST:PORT, e.g. 127.0.0.1:5060")
    return host.strip("[]"), int(port)


def _field(data: object, *path: str) -> object:
    """data[path[0]][path[1]]...; None where any step is missing or not an object."""
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def session_params(kind: str, body: dict) -> dict[str, str]:
    """What the phone path takes of an accept's session: instructions, the voice, a model KAME serves (an
    OpenAI model's name means the server's default). Realtime's body is the session itself; Live's has it
    under `session`."""
    session = body.get("session", body) if kind == "live" else body
    if not isinstance(session, dict):
        raise ControlError(400, "invalid_value", "the session must be an object")
    params: dict[str, str] = {}
    if isinstance(session.get("instructions"), str):
        params["instructions"] = session["instructions"]
    voice = _field(session, "audio", "output", "voice") or session.get("voice")
    if isinstance(voice, str):
        params["voice"] = voice
    model = session.get("model")
    if kind == "live":
        model = _field(session, "delegation", "responses", "model") or model
    if isinstance(model, str) and model and not model.startswith(REALTIME_MODELS):
        params["llm"] = model
    return params

