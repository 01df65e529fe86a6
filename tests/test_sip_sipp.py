"""SIP calls into `kame serve --sip` from SIPp (Debian's sip-tester), the SIP traffic generator: many callers
at once, each speaking over RTP (tests/sipp/call_with_rtp.xml plays a recording made here as 20 ms PCMU
packets), and a call that goes on while a raw socket throws malformed, unwanted and too many requests at the
server. The server: tiny-copy on the CPU, no ASR, no webhook (every call from loopback answered at once).

SIPp's pcap play sends from a raw socket: it needs root (or CAP_NET_RAW), as on CI."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import resource
import shutil
import socket
import struct
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from kame.audio import read_audio
from kame.pcm import ulaw_encode

from .server_harness import running_server
from .sip_peers import free_udp_tcp_port

pytestmark = [pytest.mark.realtime, pytest.mark.slow]

SIPP = shutil.which("sipp")
SCENARIOS = Path(__file__).parent / "sipp"
CALLER = SCENARIOS / "call_with_rtp.xml"
FIXTURES = Path(__file__).parent / "fixtures"
PCAP_NAME = "kame-caller.pcap"  # the name call_with_rtp.xml plays, in SIPp's working directory
PACKET_MS = 20
SPEECH_S = 6.0  # the recording's length: the question twice, quiet around it

CALLS = 32  # the load test's calls, all at once
CALL_MS = 7000  # each call's length after its ACK (sipp -d): the recording, then a moment of quiet
GOOD_CALL_MS = 28000  # the call beside the malformed requests: longer than they take (~17 s), shorter than
# the recording (6 s) and the server's RTP timeout after it (30 s)


def require_sipp() -> None:
    """Skip where SIPp is not installed (CI installs sip-tester) or cannot play RTP (its pcap play writes to a
    raw socket: root or CAP_NET_RAW), unless KAME_REQUIRE_SIP_PEERS says fail."""
    reason = None
    if SIPP is None:
        reason = "SIPp is not installed (apt-get install sip-tester)"
    elif not _raw_sockets_allowed():
        reason = "SIPp's RTP (pcap play) needs a raw socket: run as root, or setcap cap_net_raw+ep on sipp"
    if reason is not None:
        if os.environ.get("KAME_REQUIRE_SIP_PEERS"):
            pytest.fail(reason)
        pytest.skip(reason)


def _raw_sockets_allowed() -> bool:
    with contextlib.suppress(OSError):
        if "security.capability" in os.listxattr(SIPP):  # file capabilities (cap_net_raw) given to sipp
            return True
    try:
        socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP).close()
    except PermissionError:
        return False
    return True


# ---------------------------------------------------------------- the caller's recording


def _checksum(header: bytes) -> int:
    total = sum(struct.unpack(f"!{len(header) // 2}H", header))
    while total > 0xFFFF:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def write_rtp_pcap(path: Path, payloads: list[bytes], payload_type: int = 0, ptime_ms: int = PACKET_MS) -> None:
    """A libpcap file (Ethernet, IPv4, UDP) of one RTP stream, a packet every `ptime_ms`: what SIPp's
    play_pcap_audio replays (it keeps the RTP headers and the pacing, and rewrites the addresses and ports)."""
    out = bytearray(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1))
    samples = 8000 * ptime_ms // 1000
    for index, payload in enumerate(payloads):
        rtp = struct.pack("!BBHII", 0x80, (0x80 if index == 0 else 0) | payload_type, (4321 + index) & 0xFFFF,
                          (160_000 + index * samples) & 0xFFFFFFFF, 0x4B414D45) + payload
        udp = struct.pack("!HHHH", 6000, 7078, 8 + len(rtp), 0) + rtp  # ports: SIPp's own replace them
        ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), index & 0xFFFF, 0, 64, socket.IPPROTO_UDP, 0,
                         socket.inet_aton("127.0.0.1"), socket.inet_aton("127.0.0.1"))
        ip = ip[:10] + struct.pack("!H", _checksum(ip)) + ip[12:]
        frame = b"\x02\x00\x00\x00\x00\x02" + b"\x02\x00\x00\x00\x00\x01" + b"\x08\x00" + ip + udp
        at = index * ptime_ms / 1000
        out += struct.pack("<IIII", int(at), round(at % 1 * 1e6), len(frame), len(frame)) + frame
    path.write_bytes(bytes(out))


def caller_speech() -> list[bytes]:
    """The question (tests/fixtures/question.wav) twice, with quiet around it: SPEECH_S of 20 ms PCMU payloads."""
    question = read_audio(FIXTURES / "question.wav", 8000)
    quiet = np.zeros(4000, np.float32)
    pcm = np.concatenate([quiet, question, quiet, quiet, question])
    total = int(SPEECH_S * 8000)
    pcm = np.concatenate([pcm, np.zeros(max(0, total - len(pcm)), np.float32)])[:total]
    data = ulaw_encode(pcm)
    step = 8 * PACKET_MS
    return [data[i:i + step] for i in range(0, len(data), step)]


SPEECH_PACKETS = int(SPEECH_S * 1000 / PACKET_MS)


# ---------------------------------------------------------------- SIPp


@dataclass
class SippRun:
    """One SIPp process and what it wrote: its statistics (-trace_stat), per-message counts (-trace_counts),
    response times (-trace_rtt) and unexpected messages (-trace_err), all in `directory`."""

    directory: Path
    process: subprocess.Popen
    started: float = field(default_factory=time.monotonic)
    returncode: int | None = None
    wall_s: float = 0.0

    def wait(self, timeout_s: float) -> SippRun:
        try:
            self.returncode = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
            raise AssertionError(f"SIPp did not finish within {timeout_s:.0f} s\n{self.report()}") from None
        finally:
            self.wall_s = time.monotonic() - self.started
        return self

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)

    def _file(self, pattern: str) -> Path | None:
        found = sorted(self.directory.glob(pattern))
        return found[-1] if found else None

    def statistics(self) -> dict[str, str]:
        """The last row of -trace_stat's CSV (the totals at SIPp's exit)."""
        path = self.directory / "stats.csv"
        if not path.exists():
            return {}
        rows = list(csv.DictReader(path.read_text(errors="replace").splitlines(), delimiter=";"))
        return rows[-1] if rows else {}

    def counts(self) -> list[dict[str, str]]:
        """-trace_counts' last row, by message: [{'what': 'INVITE', 'sent': ..., 'recv': ..., ...}, ...]."""
        path = self._file("*_counts.csv")
        if path is None:
            return []
        rows = [row for row in csv.reader(path.read_text(errors="replace").splitlines(), delimiter=";") if row]
        header, last = rows[0], rows[-1]
        return _counts_by_message(header, last)

    def answer_times_ms(self) -> list[float]:
        """Every call's INVITE -> 200 time (the `answer` rtd, from -trace_rtt)."""
        path = self._file("*_rtt.csv")
        if path is None:
            return []
        times = []
        for row in csv.reader(path.read_text(errors="replace").splitlines(), delimiter=";"):
            if len(row) >= 3 and row[2].strip() == "answer":
                with contextlib.suppress(ValueError):
                    times.append(float(row[1]))
        return times

    def errors(self) -> str:
        path = self.directory / "errors.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def report(self) -> str:
        screen = self.directory / "screen.log"
        text = screen.read_text(errors="replace")[-4000:] if screen.exists() else ""
        output = self.directory / "sipp.out"
        tail = output.read_text(errors="replace")[-2000:] if output.exists() else ""
        return f"SIPp exit {self.returncode}\n--- screen\n{text}\n--- errors\n{self.errors()}\n--- output\n{tail}"


def _counts_by_message(header: list[str], row: list[str]) -> list[dict[str, str]]:
    """-trace_counts' columns are '<index>_<what>_<counter>' (e.g. '1_INVITE_Sent', '3_200_Recv')."""
    messages: dict[int, dict[str, str]] = {}
    for name, value in zip(header, row, strict=False):
        match = re.match(r"^(\d+)_(.+)_([A-Za-z]+)$", name.strip())
        if match:
            entry = messages.setdefault(int(match.group(1)), {"what": match.group(2)})
            entry[match.group(3).lower()] = value.strip()
    return [messages[index] for index in sorted(messages)]


def start_sipp(directory: Path, sip_port: int, *, calls: int, call_ms: int, timeout_s: int) -> SippRun:
    """`calls` calls at once (-l, and -r in one second) to KAME on loopback, each `call_ms` long after its ACK,
    with the caller's recording written to `directory` (SIPp's working directory)."""
    directory.mkdir(parents=True, exist_ok=True)
    write_rtp_pcap(directory / PCAP_NAME, caller_speech())
    scenario = shutil.copy(CALLER, directory / CALLER.name)  # SIPp writes its traces beside the scenario
    command = [SIPP, "-sf", str(scenario), "-m", str(calls), "-l", str(calls), "-r", str(calls), "-rp", "1000",
               "-i", "127.0.0.1", "-mi", "127.0.0.1", "-d", str(call_ms), "-nostdin", "-aa",
               "-timeout", f"{timeout_s}s", "-timeout_error",
               "-trace_stat", "-stf", str(directory / "stats.csv"), "-fd", "1",
               "-trace_counts", "-trace_rtt", "-rtt_freq", "1",
               "-trace_err", "-error_file", str(directory / "errors.log"),
               "-trace_screen", "-screen_file", str(directory / "screen.log"),
               f"127.0.0.1:{sip_port}"]
    with open(directory / "sipp.out", "wb") as output:  # SIPp's screen (the child keeps its own descriptor)
        process = subprocess.Popen(command, cwd=directory, stdin=subprocess.DEVNULL, stdout=output,
                                   stderr=subprocess.STDOUT)
    return SippRun(directory, process)


# ---------------------------------------------------------------- the server


def sip_server(**sip):
    port = free_udp_tcp_port()
    max_sessions = sip.pop("max_sessions")
    return port, running_server(asr="none", max_sessions=max_sessions, sip={"listen": f"127.0.0.1:{port}", **sip})


def free_slots(services) -> int:
    return services.runtime.runner.free_slots


def http(url: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url.replace("ws://", "http://") + path, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metric(text: str, name: str) -> float | None:
    match = re.search(rf"^{name} ([0-9.eE+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def wait_until(predicate, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.05)


class SlotWatch:
    """Samples the server's free slots every 20 ms in a thread: the lowest seen, and when."""

    def __init__(self, services) -> None:
        self.services, self.lowest, self.lowest_at = services, free_slots(services), 0.0
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slot-watch", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            free = free_slots(self.services)
            if free < self.lowest:
                self.lowest, self.lowest_at = free, time.monotonic() - self.started

    def __enter__(self) -> SlotWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(2)


RTP_CLOSED = re.compile(r"RTP on port (\d+) closed: received (\d+), lost (\d+), late (\d+), concealed (\d+), "
                        r"foreign (\d+), malformed (\d+), jitter [0-9.]+ ms, sent (\d+)")


def rtp_summaries(caplog) -> list[dict[str, int]]:
    """What each call's RTP session received, from the line the server logs when it closes."""
    out = []
    for record in caplog.records:
        match = RTP_CLOSED.search(record.getMessage())
        if match:
            names = ("port", "received", "lost", "late", "concealed", "foreign", "malformed", "sent")
            out.append(dict(zip(names, map(int, match.groups()), strict=True)))
    return out


def sip_errors(caplog) -> list[str]:
    """What the server's SIP and RTP code logged as an error (a task that failed, a callback that raised)."""
    return [f"{record.name}: {record.getMessage()}"[:300] for record in caplog.records
            if record.levelname in ("ERROR", "CRITICAL") and record.name.startswith(("kame.sip", "server.sip"))]


def _cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


# ---------------------------------------------------------------- 1. many calls with RTP


def test_thirty_two_sipp_calls_at_once_with_rtp(tmp_path, caplog):
    """32 callers dial at once (SIPp -l 32 -r 32), each speaks 6 s over RTP and hangs up after 7 s: every
    INVITE is answered 200, every BYE 200; the server holds 32 slots while the calls last (its /metrics says
    so too) and has them all back after; every call's RTP reached the server."""
    require_sipp()
    caplog.set_level("INFO", logger="kame.sip.rtp")
    slots = CALLS + 2
    port, server = sip_server(max_sessions=slots)
    with server as (url, services):
        wait_until(lambda: free_slots(services) == slots, "the server's slots all free", 30)
        cpu_before, wall_before = _cpu_s(resource.RUSAGE_SELF), time.monotonic()
        sipp_cpu_before = _cpu_s(resource.RUSAGE_CHILDREN)
        with SlotWatch(services) as watch:
            run = start_sipp(tmp_path / "sipp", port, calls=CALLS, call_ms=CALL_MS, timeout_s=90)
            try:
                wait_until(lambda: free_slots(services) <= slots - CALLS or run.process.poll() is not None,
                           f"{CALLS} calls holding slots", 45)
                status, body = http(url, "/metrics")  # the calls go on for seconds yet
                metric_free = metric(body, "kame_free_slots")
                run.wait(120)
            finally:
                run.stop()
        server_cpu_s, wall_s = _cpu_s(resource.RUSAGE_SELF) - cpu_before, time.monotonic() - wall_before
        sipp_cpu_s = _cpu_s(resource.RUSAGE_CHILDREN) - sipp_cpu_before
        wait_until(lambda: free_slots(services) == slots, "every slot came back after the calls", 30)
        healthz, _ = http(url, "/healthz")
    stats, counts, answers = run.statistics(), run.counts(), run.answer_times_ms()
    rtp = rtp_summaries(caplog)
    figures = {
        "sipp_exit": run.returncode, "sipp_wall_s": round(run.wall_s, 1),
        "successful": stats.get("SuccessfulCall(C)"), "failed": stats.get("FailedCall(C)"),
        "retransmissions": stats.get("Retransmissions(C)"),
        "answer_ms": {"n": len(answers), "p50": round(percentile(answers, 50), 1),
                      "p95": round(percentile(answers, 95), 1), "max": round(max(answers, default=float("nan")), 1)},
        "lowest_free_slots": watch.lowest, "lowest_at_s": round(watch.lowest_at, 1), "metrics_free_slots": metric_free,
        # the server's process (this one: the server runs in a thread) and SIPp's, in CPU seconds over the run
        "server_cpu_s": round(server_cpu_s, 1), "server_cpu_share": round(server_cpu_s / wall_s, 2),
        "sipp_cpu_s": round(sipp_cpu_s, 1), "wall_s": round(wall_s, 1),
        "rtp_received": sorted(s["received"] for s in rtp), "rtp_sent": sorted(s["sent"] for s in rtp),
        "rtp_lost": sum(s["lost"] for s in rtp), "rtp_late": sum(s["late"] for s in rtp),
        "sip_errors": sip_errors(caplog),
        "messages": [(c["what"], c.get("sent") or c.get("recv"), c.get("retrans"), c.get("unexp")) for c in counts],
    }
    print("SIPp load:", json.dumps(figures))  # the figures, for a run with -s
    (tmp_path / "figures.json").write_text(json.dumps(figures, indent=1))
    assert run.returncode == 0, f"{figures}\n{run.report()}"
    assert stats.get("SuccessfulCall(C)") == str(CALLS) and stats.get("FailedCall(C)") == "0", figures
    by_what = {}
    for entry in counts:
        by_what.setdefault(entry["what"], []).append(entry)
    ok_received = [int(entry.get("recv") or 0) for entry in by_what.get("200", [])]
    assert ok_received == [CALLS, CALLS], f"200 to the INVITE and to the BYE, for every call: {figures}"
    assert len(answers) == CALLS, figures
    assert watch.lowest <= slots - CALLS, f"the calls never held {CALLS} slots at once: {figures}"
    assert status == 200 and metric_free == slots - CALLS, figures
    assert healthz == 200
    assert len(rtp) == CALLS, f"{CALLS} RTP sessions closed: {figures}"
    # every call's recording (300 packets) reached the server; its session keeps reading for the call's length
    assert min(s["received"] for s in rtp) >= SPEECH_PACKETS * 0.9, figures
    assert all(s["malformed"] == 0 for s in rtp), figures
    assert min(s["sent"] for s in rtp) > 0, f"the server spoke back to every caller: {figures}"
    assert not figures["sip_errors"], figures


# ---------------------------------------------------------------- 2. malformed requests beside a good call


def status_codes(data: bytes) -> int | None:
    """A SIP response's status code (its status line only), None for anything else."""
    match = re.match(rb"^SIP/2\.0 ([1-6]\d\d) ", data)
    return int(match.group(1)) if match else None


class Prober:
    """A UDP socket on another loopback address than SIPp's (the server's rate limit counts per address)."""

    def __init__(self, server_port: int, host: str = "127.0.0.2") -> None:
        self.server = ("127.0.0.1", server_port)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.host, self.port = self.sock.getsockname()
        self.number = 0
        self.received: list[bytes] = []  # every answer, whole

    def close(self) -> None:
        self.sock.close()

    def request(self, method: str, *, call_id: bool = True, cseq: bool = True, extra: str = "",
                body: str = "", content_length: str | None = None, uri: str | None = None) -> bytes:
        self.number += 1
        lines = [f"{method} {uri or f'sip:kame@127.0.0.1:{self.server[1]}'} SIP/2.0",
                 f"Via: SIP/2.0/UDP {self.host}:{self.port};branch=z9hG4bK-probe-{self.port}-{self.number};rport",
                 "Max-Forwards: 70",
                 f"From: <sip:probe@{self.host}:{self.port}>;tag=probe{self.number}",
                 f"To: <sip:kame@127.0.0.1:{self.server[1]}>"]
        if call_id:
            lines.append(f"Call-ID: probe-{self.port}-{self.number}@{self.host}")
        if cseq:
            lines.append(f"CSeq: {self.number} {method}")
        lines.append(f"Contact: <sip:probe@{self.host}:{self.port}>")
        if extra:
            lines.append(extra)
        if body:
            lines.append("Content-Type: application/sdp")
        length = str(len(body.encode())) if content_length is None else content_length
        lines.append(f"Content-Length: {length}")
        return ("\r\n".join(lines) + "\r\n\r\n" + body).encode()

    def send(self, data: bytes) -> None:
        self.sock.sendto(data, self.server)

    def answers(self, wait_s: float, until_final: bool = True) -> list[int]:
        """Status codes received within `wait_s` (sooner once a final one came, with `until_final`)."""
        codes: list[int] = []
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                break
            code = status_codes(data)
            if code is not None:
                codes.append(code)
                self.received.append(data)
                if until_final and code >= 200:
                    break
        return codes

    def ask(self, data: bytes, wait_s: float = 3.0) -> list[int]:
        self.send(data)
        return self.answers(wait_s)

    def ack(self, invite: bytes) -> bytes:
        """The ACK of the last (failure) answer to `invite` (RFC 3261 §17.1.1.3): the INVITE's request URI, Via,
        From and Call-ID, its CSeq number, and the answer's To (with the server's tag)."""
        to = re.search(rb"^To: .*$", self.received[-1], re.MULTILINE | re.IGNORECASE)
        assert to is not None, self.received[-1]
        head = invite.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
        lines = [b"ACK " + head[0].split(b" ", 1)[1]]
        for line in head[1:]:
            name = line.split(b":", 1)[0].lower()
            if name == b"to":
                lines.append(to.group(0).rstrip(b"\r"))
            elif name == b"cseq":
                lines.append(line.replace(b"INVITE", b"ACK"))
            elif name not in (b"content-type", b"content-length", b"contact"):
                lines.append(line)
        return b"\r\n".join([*lines, b"Content-Length: 0", b"", b""])


def flood(source: Prober, request, count: int = 500, then=None) -> tuple[int, float]:
    """`count` requests (`request()` makes each) in a second from `source`, then `then()`: how many were
    answered within 3 s of the flood's start, and how long the sending took."""
    collected: list[int] = []
    reader = threading.Thread(target=lambda: collected.extend(source.answers(3.0, until_final=False)),
                              name="flood-answers", daemon=True)
    reader.start()
    began = time.monotonic()
    for index in range(count):
        source.send(request())
        time.sleep(max(0.0, began + (index + 1) / count - time.monotonic()))
    seconds = time.monotonic() - began
    if then is not None:
        then()
    reader.join(10)
    return len(collected), seconds


def g729_offer(host: str) -> str:
    return "\r\n".join(["v=0", f"o=probe 1 1 IN IP4 {host}", "s=-", f"c=IN IP4 {host}", "t=0 0",
                        "m=audio 40000 RTP/AVP 18", "a=rtpmap:18 G729/8000", "a=fmtp:18 annexb=no", ""])


def test_malformed_sip_beside_a_good_call(tmp_path, caplog):
    """While a SIPp call is up, a raw socket on another loopback address sends broken, unwanted and too many
    requests: each gets its documented answer (or none), a flood of OPTIONS is mostly dropped by the
    per-address rate limit, other addresses are still answered, and the good call completes."""
    require_sipp()
    caplog.set_level("INFO", logger="kame.sip.rtp")
    port, server = sip_server(max_sessions=4, requests_per_s=20.0)
    with server as (url, services):
        wait_until(lambda: free_slots(services) == 4, "the server's slots all free", 30)
        run = start_sipp(tmp_path / "sipp", port, calls=1, call_ms=GOOD_CALL_MS, timeout_s=90)
        probes: list[Prober] = []

        def prober(host: str = "127.0.0.2") -> Prober:
            probes.append(Prober(port, host))
            return probes[-1]

        try:
            wait_until(lambda: free_slots(services) == 3 or run.process.poll() is not None, "the good call is up", 20)
            assert run.process.poll() is None, run.report()
            seen: dict[str, list[int]] = {}
            probing = time.monotonic()
            p = prober()
            # a header line without a colon, the rest readable: 400 (RFC 3261 §8.2, a response can be built)
            broken = p.request("OPTIONS").replace(b"Max-Forwards: 70\r\n", b"this is not a header\r\n")
            seen["broken header line"] = prober().ask(broken)
            # a request line that is not one: nothing to answer to but the Via; 400 or silence
            seen["broken request line"] = prober().ask(p.request("OPTIONS").replace(b" SIP/2.0\r\n", b"\r\n", 1))
            # headers that never end (no empty line)
            seen["no end of headers"] = prober().ask(p.request("OPTIONS")[:-4], 1.5)
            # no Call-ID, no CSeq: a response could not name its request (§8.1.1): dropped, or 400
            q = prober()
            seen["no Call-ID"] = q.ask(q.request("OPTIONS", call_id=False), 1.5)
            seen["no CSeq"] = q.ask(q.request("OPTIONS", cseq=False), 1.5)
            q = prober()
            seen["negative Content-Length"] = q.ask(q.request("OPTIONS", content_length="-5"))
            seen["Content-Length past the body"] = q.ask(q.request("OPTIONS", content_length="500"))
            q = prober()
            seen["INVITE without SDP"] = q.ask(q.request("INVITE"))
            q = prober()
            invite = q.request("INVITE", body=g729_offer(q.host))
            seen["INVITE offering G.729 only"] = q.ask(invite)
            q.send(q.ack(invite))  # the 488 is sent again until its ACK (Timer G): no more after it
            seen["the 488 again after its ACK"] = q.answers(2.0, until_final=False)
            q = prober()
            seen["INVITE with a garbled SDP"] = q.ask(q.request("INVITE", body="v=0\r\nthis is not SDP\r\n"))
            q = prober()
            seen["unknown method"] = q.ask(q.request("FROBNICATE"))
            seen["REGISTER"] = q.ask(q.request("REGISTER", uri="sip:127.0.0.1"))
            seen["BYE for no call"] = q.ask(q.request("BYE"))
            q = prober()
            seen["binary garbage"] = q.ask(bytes(range(256)) * 4 + os.urandom(512), 1.5)
            seen["OPTIONS after all that"] = q.ask(q.request("OPTIONS"))

            # floods of 500 requests in a second, each from one socket of yet another address: unreadable ones
            # (their 400s count against the same rate: a garbage flood is not reflected), then OPTIONS
            garbage = prober("127.0.0.5")
            garbage_answered, garbage_s = flood(garbage, lambda: garbage.request("OPTIONS").replace(
                b"Max-Forwards: 70\r\n", b"not a header\r\n"))
            flooder = prober("127.0.0.3")
            other = prober("127.0.0.4")
            flood_answered, flood_s = flood(flooder, lambda: flooder.request("OPTIONS"), then=lambda: seen.update({
                "OPTIONS from another address, the flooder's bucket empty": other.ask(other.request("OPTIONS"))}))
            time.sleep(3.5)  # the flooding address's bucket refills (60 at 20 a second)
            again = prober("127.0.0.3")
            seen["OPTIONS from the flooding address after 3.5 s"] = again.ask(again.request("OPTIONS"))
            probing_s = time.monotonic() - probing
            assert run.process.poll() is None and free_slots(services) == 3, \
                f"the good call ended before the probes did ({probing_s:.1f} s): {seen}\n{run.report()}"

            run.wait(60)
            healthz, _ = http(url, "/healthz")
            wait_until(lambda: free_slots(services) == 4, "the good call's slot came back", 20)
        finally:
            run.stop()
            for each in probes:
                each.close()
    stats, counts = run.statistics(), run.counts()
    print("SIP probes:", json.dumps(seen), f"floods: {flood_answered} of 500 OPTIONS answered in {flood_s:.2f} s,",
          f"{garbage_answered} of 500 unreadable in {garbage_s:.2f} s; probes took {probing_s:.1f} s")
    expected = {
        "broken header line": [400],
        "negative Content-Length": [400],
        "Content-Length past the body": [400],
        "INVITE without SDP": [100, 488],
        "INVITE offering G.729 only": [100, 488],
        "the 488 again after its ACK": [],
        "INVITE with a garbled SDP": [100, 400],
        "unknown method": [501],
        "REGISTER": [405],
        "BYE for no call": [481],
        "binary garbage": [],
        "OPTIONS after all that": [200],
        "OPTIONS from another address, the flooder's bucket empty": [200],
        "OPTIONS from the flooding address after 3.5 s": [200],
    }
    for what, codes in expected.items():
        assert seen[what] == codes, f"{what}: {seen[what]} (expected {codes}); all: {seen}"
    for what in ("broken request line", "no end of headers", "no Call-ID", "no CSeq"):
        assert seen[what] in ([], [400]), f"{what}: {seen[what]}; all: {seen}"
    # the bucket: a burst of 3 x 20, then 20 a second (a second more for what the server had yet to read)
    for answered, seconds, what in ((flood_answered, flood_s, "OPTIONS"), (garbage_answered, garbage_s, "unreadable")):
        assert 20 <= answered <= 60 + 20 * (seconds + 1), f"{answered} of 500 {what} answered in {seconds:.2f} s"
        assert answered < 125, f"most of the flood dropped: {answered} of 500 {what} answered in {seconds:.2f} s"
    assert run.returncode == 0 and stats.get("SuccessfulCall(C)") == "1", run.report()
    assert [int(c.get("recv") or 0) for c in counts if c["what"] == "200"] == [1, 1], counts  # INVITE's, BYE's
    assert healthz == 200
    rtp = rtp_summaries(caplog)
    assert len(rtp) == 1 and rtp[0]["received"] >= SPEECH_PACKETS * 0.9, rtp
    assert not sip_errors(caplog), sip_errors(caplog)
