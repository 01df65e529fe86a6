"""What a WebRTC voice session costs the server's CPU, per WebRTC stack, side by side in one run: KAME's
link (`server/live/rtc_link.py`: aiortc, with libopus called directly, one decoding thread and one
pacer) against libwebrtc, Chromium's own stack, as the PyPI wheel `reactor-webrtc` binds it (PyO3;
`pip install reactor-webrtc` to measure it, the project does not depend on it).

Each stack serves `--sessions` peers in a process of its own, with no session logic (no engine, no
events): every 80 ms it gives each peer's track one frame of speech (tests/fixtures/question.wav,
always audible, so every packet is encoded), and it takes the user's audio. The peers are aiortc
clients in another process (the load bench's microphone: 40 ms Opus packets at 24 kHz where the
answer asks for them), each saying speech every 80 ms and decoding what comes back. The figure is
the serving process's CPU (all its threads) over the middle of the run, per session.

    python scripts/bench_rtc_stacks.py [--stacks aiortc,libwebrtc] [--sessions 8] [--seconds 20] [--rounds 2]

What libwebrtc's row does not include: the user's decoded audio handed to Python. libwebrtc gives a
remote audio track's audio to its sinks (`on_audio_frame`, 10 ms at a time) from its playout mixer,
which reactor-webrtc 0.24's synthetic audio device did not run here: its packets arrive and count in
its statistics, its callback is never called (the audio heard stays 0). Its row is the lower bound of what
it would cost a session."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kame.audio import SAMPLE_RATE, read_audio  # noqa: E402

FRAME = SAMPLE_RATE * 80 // 1000
CHUNK = SAMPLE_RATE // 100  # libwebrtc's audio sources take 10 ms at a time
SPEECH = ROOT / "tests" / "fixtures" / "question.wav"


def speech() -> np.ndarray:
    return read_audio(SPEECH)


def frame_of(talk: np.ndarray, index: int) -> np.ndarray:
    start = (index * FRAME) % (len(talk) - FRAME)
    return talk[start:start + FRAME]


# ---------------------------------------------------------------- the serving side, one stack a process

class Heard:
    def __init__(self) -> None:
        self.samples = 0  # of the users' audio, at 24 kHz


async def answer_aiortc(offer: str, heard: Heard, index: int):
    from server.live.rtc_link import WebRTCLink

    link = WebRTCLink()
    link.name = f"bench-{index}"

    def hear(pcm: np.ndarray) -> None:
        heard.samples += len(pcm)

    link.hear = hear
    sdp = await link.answer(offer)
    listening = asyncio.ensure_future(link._listen())
    return sdp, link.track.play, (link, listening)


class LibWebRTC:
    def __init__(self) -> None:
        import reactor_webrtc as rw

        self.rw = rw
        self.factory = rw.PeerConnectionFactory()
        self.factory.set_adm_playout_enabled(True)

    async def answer(self, offer: str, heard: Heard, index: int):
        rw, loop = self.rw, asyncio.get_running_loop()
        observer = rw.PeerConnectionObserver()
        candidates, gathered = [], asyncio.Event()

        def on_gathering(state) -> None:
            if state == rw.IceGatheringState.Complete:
                loop.call_soon_threadsafe(gathered.set)

        def on_audio(pcm: bytes, rate: int, channels: int, frames: int) -> None:
            heard.samples += frames * SAMPLE_RATE // rate

        observer.on_ice_candidate = candidates.append
        observer.on_ice_gathering_change = on_gathering
        observer.on_track = lambda kind, track: track.on_audio_frame(on_audio)
        pc = self.factory.create_peer_connection(rw.RtcConfiguration(ice_servers=[]), observer)
        await pc.set_remote_description(rw.SessionDescription("offer", offer))
        track = self.factory.create_audio_track_with_local_source(f"assistant-{index}")
        for transceiver in await pc.transceivers():
            if transceiver.kind() == rw.MediaKind.Audio:
                await transceiver.set_direction(rw.TransceiverDirection.SendRecv)
                await transceiver.set_track(track)
        answer = await pc.create_answer()
        await pc.set_local_description(answer)
        await asyncio.wait_for(gathered.wait(), 10)
        lines = []
        for line in answer.sdp.split("\r\n"):  # no trickle: the candidates go in the answer
            lines.append(line)
            if line.startswith("a=mid:"):
                lines += [f"a={c.candidate}" for c in candidates if c.sdp_mid in (None, line[6:])]

        def play(pcm: np.ndarray, frame: int) -> None:
            pcm16 = (np.clip(pcm, -1.0, 1.0) * 32767).astype(np.int16)
            for at in range(0, len(pcm16), CHUNK):
                track.push_pcm(pcm16[at:at + CHUNK].tobytes(), SAMPLE_RATE, 1)

        return "\r\n".join(lines), play, (pc, observer, track)


async def serve(stack: str, port: int) -> None:
    heard, players, kept, talk = Heard(), [], [], speech()
    if stack == "aiortc":
        answer = answer_aiortc
    else:
        answer = LibWebRTC().answer

    async def signal(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        offer = json.loads(await reader.readline())["sdp"]
        sdp, play, keep = await answer(offer, heard, len(players))
        players.append(play)
        kept.append(keep)
        writer.write((json.dumps({"sdp": sdp}) + "\n").encode())
        await writer.drain()

    server = await asyncio.start_server(signal, "127.0.0.1", port)
    print(json.dumps({"listening": port}), flush=True)
    async with server:
        frame, start = 0, time.monotonic()
        while True:  # one engine: every session's frame together, each 80 ms
            await asyncio.sleep(max(0.0, start + (frame + 1) * 0.08 - time.monotonic()))
            pcm = frame_of(talk, frame) * 0.5
            for play in players:
                play(pcm, frame)
            frame += 1
            if frame % 25 == 0:
                print(json.dumps({"sessions": len(players), "heard_s": heard.samples / SAMPLE_RATE}), flush=True)


# ---------------------------------------------------------------- the peers

async def peers(count: int, port: int, seconds: float) -> None:
    from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

    from client.live_client import _Microphone
    from kame.rtc import ptime, receive_opus, send_cheaply

    send_cheaply()
    talk, got, connected, draining = speech(), [0], [], []
    for _ in range(count):
        pc, microphone = RTCPeerConnection(RTCConfiguration(iceServers=[])), _Microphone()
        pc.createDataChannel("oai-events")
        pc.addTrack(microphone)
        await pc.setLocalDescription(await pc.createOffer())
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write((json.dumps({"sdp": pc.localDescription.sdp}) + "\n").encode())
        answer = json.loads(await reader.readline())["sdp"]
        writer.close()
        await pc.setRemoteDescription(RTCSessionDescription(answer, "answer"))
        microphone.ptime_ms = ptime(answer)
        audio = next(t for t in pc.getTransceivers() if t.kind == "audio")
        decoded = receive_opus(audio, name="bench-peer")

        async def drain(decoded=decoded) -> None:
            while (pcm := await decoded.frames.get()) is not None:
                got[0] += len(pcm)

        draining.append(asyncio.ensure_future(drain()))
        connected.append((pc, microphone))
    print(json.dumps({"connected": count, "ptime_ms": connected[0][1].ptime_ms}), flush=True)
    start = time.monotonic()
    frame = 0
    while time.monotonic() - start < seconds:
        await asyncio.sleep(max(0.0, start + frame * 0.08 - time.monotonic()))
        for which, (_, microphone) in enumerate(connected):
            microphone.say(frame_of(talk, frame + 3 * which))
        frame += 1
    print(json.dumps({"back_s_per_session": got[0] / SAMPLE_RATE / count, "seconds": seconds}), flush=True)
    for pc, _ in connected:
        await pc.close()


# ---------------------------------------------------------------- the run

def process_cpu_s(pid: int) -> float:
    ticks = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{task}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # a thread that ended meanwhile
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def last_json(text: str, key: str) -> dict:
    found = [json.loads(line) for line in text.splitlines() if line.startswith("{") and key in line]
    return found[-1] if found else {}


def measure(stack: str, sessions: int, seconds: float, port: int) -> dict:
    """One stack's serving process and its peers; its CPU from 6 s after the start to 2 s before the end."""
    me = [sys.executable, __file__]
    server = subprocess.Popen(me + ["--serve", stack, "--port", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        if "listening" not in server.stdout.readline():
            raise SystemExit(f"the {stack} server did not start")
        client = subprocess.Popen(me + ["--peers", str(sessions), "--port", str(port), "--seconds", str(seconds)],
                                  stdout=subprocess.PIPE, text=True)
        time.sleep(6)
        before, t0 = process_cpu_s(server.pid), time.monotonic()
        time.sleep(max(1.0, seconds - 8))
        after, t1 = process_cpu_s(server.pid), time.monotonic()
        out, _ = client.communicate(timeout=seconds + 60)
    finally:
        server.terminate()
        served, _ = server.communicate(timeout=10)
    cores = (after - before) / (t1 - t0)
    return {"stack": stack, "sessions": sessions, "cores": round(cores, 4),
            "cores_per_session": round(cores / sessions, 4),
            "back_s_per_session": round(last_json(out, "back_s").get("back_s_per_session", 0.0), 1),
            "heard_s_per_session": round(last_json(served, "heard_s").get("heard_s", 0.0) / sessions, 1),
            "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stacks", default="aiortc,libwebrtc")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2, help="each stack this many times, alternately")
    parser.add_argument("--port", type=int, default=19400)
    parser.add_argument("--json-out")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--peers", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.port))
        return
    if args.peers:
        asyncio.run(peers(args.peers, args.port, args.seconds))
        return
    stacks = args.stacks.split(",")
    if "libwebrtc" in stacks:
        try:
            import reactor_webrtc  # noqa: F401
        except ImportError:
            raise SystemExit("libwebrtc's row needs `pip install reactor-webrtc` (or --stacks aiortc)") from None
    rows = []
    for round_ in range(args.rounds):
        for stack in stacks:
            print(f"round {round_ + 1}/{args.rounds}: {stack}, {args.sessions} sessions, {args.seconds:.0f} s ...",
                  file=sys.stderr, flush=True)
            rows.append(measure(stack, args.sessions, args.seconds, args.port))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| stack | sessions | server cores per session | audio back a session (s) "
          "| user's audio heard a session (s) |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['stack']} | {row['sessions']} | {row['cores_per_session']:.4f} | "
              f"{row['back_s_per_session']} of {row['seconds']:.0f} | {row['heard_s_per_session']} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
