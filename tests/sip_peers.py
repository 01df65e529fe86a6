"""Real SIP peers for the tests: baresip (Debian's baresip-core), a softphone run headless that plays a WAV file
as its microphone, records what it hears (sndfile) and is driven over its ctrl_tcp socket (netstring JSON)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import wave
from pathlib import Path

import numpy as np
import pytest

BARESIP = shutil.which("baresip")
MODULES = Path("/usr/lib/baresip/modules")


def require_baresip() -> None:
    """Skip where baresip is not installed (CI installs it: .ci/run), unless KAME_REQUIRE_SIP_PEERS says fail."""
    if BARESIP is None or not MODULES.is_dir():
        if os.environ.get("KAME_REQUIRE_SIP_PEERS"):
            pytest.fail("baresip is not installed (apt-get install baresip-core)")
        pytest.skip("baresip is not installed (apt-get install baresip-core)")


def free_udp_tcp_port() -> int:
    """A port free on loopback for both UDP and TCP (SIP listens on both)."""
    for _ in range(50):
        with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            tcp.bind(("127.0.0.1", 0))
            port = tcp.getsockname()[1]
            try:
                udp.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def write_wav_8k(path: Path, pcm: np.ndarray, rate: int = 8000) -> None:
    """16-bit mono at 8 kHz (16 kHz for G.722): baresip's file source plays at the codec's rate."""
    data = (np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(data)


def read_wav(path: Path) -> tuple[np.ndarray, int]:
    with wave.open(str(path), "rb") as source:
        frames = source.readframes(source.getnframes())
        return np.frombuffer(frames, "<i2").astype(np.float32) / 32768, source.getframerate()


class Baresip:
    """One baresip process with one account (`sip:alice@127.0.0.1:PORT`, auto-answer), in its own directory."""

    def __init__(self, directory: Path, microphone: Path, codecs: str = "PCMU,PCMA") -> None:
        self.dir, self.port, self.ctrl = directory, free_udp_tcp_port(), free_udp_tcp_port()
        self.recordings = directory / "rec"
        self.recordings.mkdir(parents=True, exist_ok=True)
        (directory / "config").write_text("\n".join([
            "poll_method epoll", f"sip_listen 127.0.0.1:{self.port}", "audio_player aubridge,x",
            f"audio_source aufile,{microphone}", "audio_alert aubridge,x", f"module_path {MODULES}",
            "module g711.so", "module g722.so", "module aufile.so", "module aubridge.so", "module sndfile.so",
            "module_app account.so", "module_app menu.so", "module_app ctrl_tcp.so",
            f"ctrl_tcp_listen 127.0.0.1:{self.ctrl}", f"snd_path {self.recordings}", ""]))
        (directory / "accounts").write_text(
            f"<sip:alice@127.0.0.1:{self.port}>;regint=0;answermode=auto;audio_codecs={codecs}\n")
        self.events: list[dict] = []
        self.responses: list[dict] = []
        self._process: subprocess.Popen | None = None
        self._socket: socket.socket | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> Baresip:
        self._process = subprocess.Popen([BARESIP, "-f", str(self.dir)], stdout=open(self.dir / "log.txt", "wb"),
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                self._socket = socket.create_connection(("127.0.0.1", self.ctrl), timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or self._process.poll() is not None:
                    raise RuntimeError(f"baresip did not start: {(self.dir / 'log.txt').read_text()[-2000:]}") from None
                time.sleep(0.1)
        self._socket.settimeout(None)
        self._reader = threading.Thread(target=self._read, name="baresip-ctrl", daemon=True)
        self._reader.start()
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(Exception):
            self.command("quit")
        if self._process is not None and self._process.poll() is None:
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(5)
        if self._socket is not None:
            self._socket.close()

    def kill(self) -> None:
        """Gone at once, as a phone that loses its network: no BYE, its RTP just stops."""
        if self._process is not None:
            self._process.kill()
            self._process.wait(5)

    @property
    def uri(self) -> str:
        return f"sip:alice@127.0.0.1:{self.port}"

    def command(self, command: str, params: str = "") -> None:
        data = json.dumps({"command": command, "params": params, "token": "test"}).encode()
        assert self._socket is not None
        self._socket.sendall(str(len(data)).encode() + b":" + data + b",")

    def _read(self) -> None:
        buffer = b""
        assert self._socket is not None
        while True:
            try:
                chunk = self._socket.recv(65536)
            except OSError:
                return
            if not chunk:
                return
            buffer += chunk
            while b":" in buffer:
                length, _, rest = buffer.partition(b":")
                if not length.isdigit() or len(rest) < int(length) + 1:
                    break
                body, buffer = rest[:int(length)], rest[int(length) + 1:]
                message = json.loads(body)
                (self.events if message.get("event") else self.responses).append(message)

    def types(self) -> list[str]:
        return [event.get("type", "") for event in list(self.events)]

    def wait_for(self, kind: str, timeout_s: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [event for event in list(self.events) if event.get("type") == kind]
            if found:
                return found[-1]
            if self._process is not None and self._process.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"baresip: no {kind} in {timeout_s:.0f} s (events: {self.types()})")

    def heard(self) -> np.ndarray:
        """What baresip heard (sndfile's decoded stream: dump-*-dec.wav), at 8 kHz."""
        files = sorted(self.recordings.glob("dump-*-dec.wav"))
        if not files:
            return np.zeros(0, np.float32)
        return read_wav(files[-1])[0]
