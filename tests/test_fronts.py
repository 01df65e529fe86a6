"""`kame serve --fronts 2`: one engine process, two front processes behind one port, as a user runs it.

The fronts also answer on loopback ports of their own (the log names them), so a test can put a
connection on the front it wants: what must hold across fronts is checked across them for certain, not
only where the kernel happened to send two connections to two processes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from .test_live import LIVE_EVENT, sdk
from .test_realtime import Events

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SLOTS, PER_ADDRESS = 3, 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _running(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def fronts(tmp_path_factory):
    """(public port, [front 0's port, front 1's port], the server process, its log path)."""
    port, log = _free_port(), tmp_path_factory.mktemp("fronts") / "serve.log"
    env = os.environ | {"KAME_MAX_CONNECTIONS_PER_IP": str(PER_ADDRESS)}
    process = subprocess.Popen(
        [sys.executable, "-m", "kame.cli", "serve", "--fronts", "2", "--frontend", "tiny-copy", "--asr", "none",
         "--llm", "local", "--max-sessions", str(SLOTS), "--port", str(port)],
        cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline, privates = time.monotonic() + 180, {}
    while time.monotonic() < deadline and (len(privates) < 2 or _get(f"http://127.0.0.1:{port}/healthz")[0] != 200):
        assert process.poll() is None, log.read_text()[-3000:]
        privates = {int(i): int(p) for i, p in re.findall(r"front (\d) of 2: its own loopback port (\d+), pid",
                                                           log.read_text())}
        time.sleep(0.5)
    assert len(privates) == 2, log.read_text()[-3000:]
    yield port, [privates[0], privates[1]], process, log
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)


async def _moshi(port: int, source: str = "127.0.0.1"):
    """A Moshi-protocol session from `source`: the open socket (after the handshake), or the HTTP status
    of its refusal."""
    try:
        ws = await connect(f"ws://127.0.0.1:{port}/api/chat", local_addr=(source, 0), open_timeout=20)
    except InvalidStatus as exc:
        return exc.response.status_code
    assert (await asyncio.wait_for(ws.recv(), 20))[:1] == b"\x00"  # the handshake
    return ws


def _health(port: int) -> dict:
    return json.loads(_get(f"http://127.0.0.1:{port}/healthz")[1])


def _wait_free(port: int, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while _health(port)["free_slots"] == 0 and time.monotonic() < deadline:
        time.sleep(0.1)


def test_slots_and_connections_per_address_are_one_count_for_every_front(fronts):
    public, (front0, front1), _, _ = fronts

    async def go():
        a = await _moshi(front0)  # one session on each front, from one address
        b = await _moshi(front1)
        third_here = await _moshi(public)  # from that address again, whichever front takes it
        c = await _moshi(public, "127.0.0.2")
        over = await _moshi(public, "127.0.0.3")  # every slot taken: on either front
        full = [_health(front0)["free_slots"], _health(front1)["free_slots"]]
        await a.close()
        await asyncio.to_thread(_wait_free, front1)  # another process's count: read over HTTP
        d = await _moshi(front1, "127.0.0.3")  # the slot front 0 gave back, through front 1
        for ws in (b, c, d):
            await ws.close()
        return a, b, third_here, c, over, full, d

    a, b, third_here, c, over, full, d = asyncio.run(go())
    assert not isinstance(a, int) and not isinstance(b, int) and not isinstance(c, int)
    assert third_here == 429
    assert over == 503
    assert full == [0, 0]
    assert not isinstance(d, int)
    assert _health(public)["max_sessions"] == SLOTS


def test_metrics_are_every_fronts_and_the_engine_counted_once(fronts):
    public, (front0, _), _, _ = fronts
    asyncio.run(_one_short_session(front0))
    time.sleep(1.0)  # the engine's status reaches its fronts every 0.5 s
    status, text = _get(f"http://127.0.0.1:{public}/metrics")
    assert status == 200
    steps = dict(re.findall(r'kame_engine_steps_total\{front="(\d)"\} ([0-9.e+]+)', text))
    assert set(steps) == {"0", "1"} and float(steps["0"]) > 0 and float(steps["1"]) == 0
    assert re.search(r'kame_sessions_total\{front="0"\} [1-9]', text)
    assert re.search(r'kame_sessions_total\{front="1"\}', text)


async def _one_short_session(port: int) -> None:
    """One second of audio through `kame client`'s own client, then gone."""
    from client.client import KameClient

    client = await KameClient.connect(f"ws://127.0.0.1:{port}/api/chat")
    try:
        await client.send_pcm(np.zeros(24000, np.float32))
        await asyncio.sleep(1.5)
    finally:
        await client.close()


def test_a_sideband_reaches_a_session_another_front_holds(fronts):
    _, (front0, front1), _, _ = fronts

    async def go():
        async with sdk(f"ws://127.0.0.1:{front0}").live.connect() as conn:
            primary = Events(conn, LIVE_EVENT)
            await conn.session.start(session={"model": "gpt-live-1", "delegation": {"type": "client"}})
            started = await primary.type("session.started")
            band_client = sdk(f"ws://127.0.0.1:{front1}")
            async with band_client.live.sideband.connect(session_id=started["session"]["id"]) as band:
                side = Events(band, LIVE_EVENT)
                replayed = await side.type("session.started")
                await band.send({"type": "session.close", "event_id": "bye"})
                closed = await primary.type("session.closed", 10)
                side.close()
            primary.close()
            return started, replayed, closed

    started, replayed, closed = asyncio.run(go())
    assert replayed == started
    assert closed["client_event_id"] == "bye"


def test_sigterm_drains_and_stops_every_process(fronts):
    _, _, process, log = fronts
    children = _children(process.pid)
    assert len(children) >= 3  # the engine and two fronts (and multiprocessing's resource tracker)
    process.send_signal(signal.SIGTERM)
    assert process.wait(90) == 0, log.read_text()[-3000:]
    deadline = time.monotonic() + 10  # multiprocessing's resource tracker leaves once its last user has
    while (alive := [pid for pid in children if _running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"left running: {[(pid, _command(pid)) for pid in alive]}"
    text = log.read_text()
    assert text.count("Application shutdown complete") == 2 and "engine process stopped" in text
    assert "Traceback" not in text
