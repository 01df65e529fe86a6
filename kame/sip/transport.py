"""SIP over UDP, TCP and TLS (RFC 3261 §18): one listening address per transport, messages in and out, the
flow a request came on kept for its answers and its dialog. A message that cannot be read is counted and
answered 400 where it is a request with a readable Via; it never reaches the user agent."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field

from kame.sip.message import MAX_MESSAGE_BYTES, Headers, Message, Request, Response, SipError, StreamFramer, parse

logger = logging.getLogger(__name__)

CONNECT_LIMIT_S = 5.0
# a TCP/TLS connection that carries nothing this long is closed: longer than a session may last (an hour by
# default), so a quiet call keeps the connection its BYE will need
IDLE_STREAM_S = 4 * 3600.0
LOGGED_UNREADABLE = 100  # unreadable messages logged one by one (the rest counted in stats)
START_ATTEMPTS = 20  # port 0: ports tried before one is free for UDP and TCP (and TLS) at once


class _ChosenPortError(OSError):
    """A port the caller named could not be had: no other port is tried for it."""


@dataclass(eq=False)
class Flow:
    """Where a message came from and where its answers go: a UDP source address, or a stream connection."""

    transport: str  # "UDP", "TCP", "TLS"
    address: tuple[str, int]
    writer: asyncio.StreamWriter | None = field(default=None, repr=False)

    @property
    def closed(self) -> bool:
        return self.writer is not None and self.writer.is_closing()


Handler = Callable[[Message, Flow], None]


@dataclass
class TransportStats:
    received: int = 0
    sent: int = 0
    unreadable: int = 0


class _Datagrams(asyncio.DatagramProtocol):
    def __init__(self, transport: SipTransport) -> None:
        self.owner = transport

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        self.owner._received(data, Flow("UDP", (addr[0], addr[1])))

    def error_received(self, exc: Exception) -> None:  # an ICMP port unreachable for something we sent
        logger.debug("SIP over UDP: %s", exc)


class SipTransport:
    """Listens on `host:port` over UDP and TCP (and TLS on `tls_port` with a certificate)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.answers_allowed: Callable[[str], bool] = lambda source: True  # the user agent's rate limit
        self.stats = TransportStats()
        self._udp: asyncio.DatagramTransport | None = None
        self._servers: list[asyncio.base_events.Server] = []
        self._flows: set[Flow] = set()
        self._tasks: set[asyncio.Task] = set()
        self.host, self.port, self.tls_port = "", 0, None
        self._tls_client: ssl.SSLContext | None = None

    async def start(self, host: str, port: int, *, tcp: bool = True, tls: ssl.SSLContext | None = None,
                    tls_port: int | None = None) -> None:
        """Listen on UDP and TCP at `port` (TLS at `tls_port`, else the next one). Port 0: a port the system
        picks for UDP, then taken for TCP (and TLS) too; where another program holds it there, another one."""
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                await self._listen(host, port, tcp, tls, tls_port)
                return
            except OSError as exc:
                await self._unlisten()
                chosen = isinstance(exc, _ChosenPortError)  # a port the caller named: never another
                if port != 0 or chosen or exc.errno != errno.EADDRINUSE or attempt == START_ATTEMPTS:
                    raise

    async def _listen(self, host: str, port: int, tcp: bool, tls: ssl.SSLContext | None,
                      tls_port: int | None) -> None:
        loop = asyncio.get_running_loop()
        self._udp, _ = await loop.create_datagram_endpoint(lambda: _Datagrams(self), local_addr=(host, port))
        self.host, self.port = host, self._udp.get_extra_info("sockname")[1]
        if tcp:
            self._servers.append(await asyncio.start_server(self._stream(self._tcp_flow), host, self.port))
        if tls is not None:
            if tls_port is None and self.port == 65535:  # no next port: port 0 tries another, a named one fails
                raise OSError(errno.EADDRINUSE, "no port after 65535 for SIP over TLS: name tls_port")
            try:
                server = await asyncio.start_server(self._stream(self._tls_flow), host,
                                                    tls_port if tls_port is not None else self.port + 1, ssl=tls)
            except OSError as exc:
                if tls_port is None:
                    raise
                raise _ChosenPortError(exc.errno, f"SIP over TLS on port {tls_port}: {exc.strerror}") from exc
            self._servers.append(server)
            self.tls_port = server.sockets[0].getsockname()[1]

    async def _unlisten(self) -> None:
        for server in self._servers:
            server.close()
            await server.wait_closed()
        self._servers.clear()
        if self._udp is not None:
            self._udp.close()
            self._udp = None

    def use_tls_client(self, context: ssl.SSLContext) -> None:
        self._tls_client = context

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for flow in list(self._flows):
            if flow.writer is not None:
                flow.writer.close()
        if self._udp is not None:
            self._udp.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ---------------------------------------------------------------- out

    def send(self, message: Message, flow: Flow) -> bool:
        """Send on `flow` (False when its connection has closed: the caller may open another)."""
        data = bytes(message)
        if flow.transport == "UDP":
            if self._udp is None or self._udp.is_closing():
                return False
            self._udp.sendto(data, flow.address)
        else:
            if flow.writer is None or flow.writer.is_closing():
                return False
            flow.writer.write(data)
        self.stats.sent += 1
        logger.debug("SIP out %s %s: %s", flow.transport, flow.address, data.split(b"\r\n", 1)[0])
        return True

    async def connect(self, transport: str, address: tuple[str, int]) -> Flow:
        """A flow toward `address`: UDP at once; a new TCP/TLS connection otherwise (OSError on failure)."""
        if transport == "UDP":  # resolved here, once, off the loop: sendto would resolve a name every packet
            family = self._udp.get_extra_info("socket").family if self._udp is not None else socket.AF_UNSPEC
            infos = await asyncio.get_running_loop().getaddrinfo(*address, family=family, type=socket.SOCK_DGRAM)
            return Flow("UDP", infos[0][4][:2])
        tls = self._tls_client if transport == "TLS" else None
        if transport == "TLS" and tls is None:
            tls = ssl.create_default_context()
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*address, ssl=tls), CONNECT_LIMIT_S)
        flow = Flow(transport, address, writer)
        self._track(self._read(reader, flow))
        return flow

    def local(self, transport: str) -> tuple[str, int]:
        """Our address as a Via's sent-by or a Contact names it, for `transport`."""
        return self.host, (self.tls_port or self.port) if transport == "TLS" else self.port

    # ---------------------------------------------------------------- in

    def _received(self, data: bytes, flow: Flow) -> None:
        if data.strip(b"\r\n") == b"":  # a keep-alive (RFC 5626's CRLF)
            return
        self.stats.received += 1
        try:
            message = parse(data[:MAX_MESSAGE_BYTES + 1])
        except SipError as exc:
            self._unreadable(data, flow, exc)
            return
        self._deliver(message, flow)

    def _deliver(self, message: Message, flow: Flow) -> None:
        try:
            self.handler(message, flow)
        except Exception:  # the user agent's fault, not the peer's: logged, the transport goes on
            logger.exception("SIP: handling a message from %s failed", flow.address)

    def _unreadable(self, data: bytes, flow: Flow, exc: SipError) -> None:
        self.stats.unreadable += 1
        if not self.answers_allowed(flow.address[0]):  # a flood of garbage gets no answers: nothing to reflect
            return
        if self.stats.unreadable <= LOGGED_UNREADABLE:
            logger.info("SIP: an unreadable message from %s %s: %s%s", flow.transport, flow.address, exc,
                        "; more are counted, not logged" if self.stats.unreadable == LOGGED_UNREADABLE else "")
        answer = _error_answer(data, exc)
        if answer is not None:
            self.send(answer, flow)

    def _stream(self, make_flow: Callable[[asyncio.StreamWriter], Flow]):
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._read(reader, make_flow(writer))
        return serve

    def _tcp_flow(self, writer: asyncio.StreamWriter) -> Flow:
        host, port = writer.get_extra_info("peername")[:2]
        return Flow("TCP", (host, port), writer)

    def _tls_flow(self, writer: asyncio.StreamWriter) -> Flow:
        host, port = writer.get_extra_info("peername")[:2]
        return Flow("TLS", (host, port), writer)

    async def _read(self, reader: asyncio.StreamReader, flow: Flow) -> None:
        self._flows.add(flow)
        framer = StreamFramer()
        try:
            while True:
                data = await asyncio.wait_for(reader.read(16384), IDLE_STREAM_S)
                if not data:
                    return
                try:
                    for message in framer.feed(data):
                        self.stats.received += 1
                        self._deliver(message, flow)
                except SipError as exc:  # a stream out of step cannot be resynchronised: closed
                    self._unreadable(data, flow, exc)
                    return
        except (TimeoutError, ConnectionError, ssl.SSLError, OSError):
            return
        finally:
            self._flows.discard(flow)
            if flow.writer is not None:
                flow.writer.close()

    def _track(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro, name="sip-stream")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _error_answer(data: bytes, exc: SipError) -> Message | None:
    """A 4xx for a request whose Via, From, To, Call-ID and CSeq can still be read (§8.2: a response must
    carry them), else nothing: a response to garbage would go nowhere useful."""
    head = data.split(b"\r\n\r\n", 1)[0]
    if head.startswith(b"SIP/") or b"\r\n" not in head:
        return None
    headers = Headers()
    wanted = {"via", "v", "from", "f", "to", "t", "call-id", "i", "cseq"}
    for line in head.split(b"\r\n")[1:]:
        name, colon, value = line.partition(b":")
        if colon and name.strip().lower().decode("latin-1") in wanted:
            headers.add(name.decode("latin-1"), value.strip().decode("latin-1"))
    if any(headers.get(name) is None for name in ("Via", "From", "To", "Call-ID", "CSeq")):
        return None
    if head.split(b" ", 1)[0] == b"ACK":  # an ACK is never answered
        return None
    return Response(exc.status, str(exc)[:80].replace("\r", " ").replace("\n", " "), headers)


def is_request(message: Message) -> bool:
    return isinstance(message, Request)
