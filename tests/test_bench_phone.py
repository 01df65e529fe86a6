"""`kame bench load --transport twilio,telnyx,vonage`: the benchmark's carrier (client/phone_client.py)
returns each mark only once its audio has played, hands the pending ones back on a clear, and a level
reports the lead the server's pacer let it hold."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest

from client.phone_client import FRAME_S, PhoneCall, Playout, carrier_media, phone_url
from kame.audio import SAMPLE_RATE
from kame.cli import main
from kame.clock import ManualClock
from kame.pcm import ulaw_encode

from .server_harness import running_server
from .test_bench_load import skipped

FRAME = round(SAMPLE_RATE * FRAME_S)
ULAW_FRAME = ulaw_encode(np.zeros(640, np.float32))  # 80 ms of mu-law silence at 8 kHz


def _twilio(call: PhoneCall, event: str, **body) -> str:
    """A message from the server on a Twilio stream."""
    return json.dumps({"event": event, **call.media.stream, **body})


def _marks(replies: list) -> list[str]:
    return [json.loads(reply)["mark"]["name"] for reply in replies]


def test_the_playout_plays_back_to_back_from_arrival_and_marks_fall_due_after_their_audio():
    playout = Playout()
    assert playout.push(0.08, now=10.0) == pytest.approx(0.08)
    playout.mark("1", now=10.0)
    assert playout.push(0.08, now=10.05) == pytest.approx(0.11)  # queued behind the first
    playout.mark("2", now=10.05)
    assert playout.next_due() == pytest.approx(10.08)
    assert playout.due(10.079) == [] and playout.due(10.081) == ["1"]
    assert playout.due(10.159) == [] and playout.due(10.161) == ["2"]
    assert playout.push(0.08, now=11.0) == pytest.approx(0.08)  # after a gap: plays from its arrival
    playout.mark("3", now=11.0)
    playout.mark("4", now=11.01)  # nothing between: due with "3"
    assert playout.clear(11.02) == ["3", "4"] and playout.due(12.0) == []
    assert playout.push(0.02, now=11.03) == pytest.approx(0.02)  # the clear dropped what had not played


def test_a_twilio_call_returns_each_mark_once_its_audio_has_played():
    clock = ManualClock(start=100.0)
    call = PhoneCall(None, carrier_media("twilio"), clock)
    payload = base64.b64encode(ULAW_FRAME).decode()

    async def scenario() -> None:
        frames, replies = call.received(_twilio(call, "media", media={"payload": payload}))
        assert [len(pcm) for pcm in frames] == [FRAME] and replies == []  # a whole frame, as it arrives
        assert call.received(_twilio(call, "mark", mark={"name": "1"})) == ([], [])
        await clock.advance(0.05)
        call.received(_twilio(call, "media", media={"payload": payload}))
        call.received(_twilio(call, "mark", mark={"name": "2"}))
        assert call.leads == pytest.approx([0.08, 0.11])
        await clock.advance(0.029)
        assert call.returns() == []  # the first frame has 1 ms to play
        await clock.advance(0.002)
        assert _marks(call.returns()) == ["1"]
        await clock.advance(0.078)
        assert call.returns() == []  # the second: 1 ms
        await clock.advance(0.002)
        assert _marks(call.returns()) == ["2"]

    asyncio.run(scenario())
    assert call.max_lead_s == pytest.approx(0.11) and 0.08 < call.lead_p99_s <= 0.11


def test_a_clear_drops_the_audio_and_hands_back_the_pending_marks():
    clock = ManualClock(start=100.0)
    call = PhoneCall(None, carrier_media("telnyx"), clock)
    payload = base64.b64encode(ULAW_FRAME).decode()

    async def scenario() -> None:
        for name in ("1", "2"):
            call.received(json.dumps({"event": "media", "media": {"payload": payload}}))
            call.received(json.dumps({"event": "mark", "mark": {"name": name}}))
        await clock.advance(0.1)
        assert _marks(call.returns()) == ["1"]
        _, replies = call.received(json.dumps({"event": "clear"}))
        assert _marks(replies) == ["2"] and all(json.loads(r)["stream_id"] == call.media.stream["stream_id"]
                                                for r in replies)
        await clock.advance(1.0)
        assert call.returns() == []
        call.received(json.dumps({"event": "media", "media": {"payload": payload}}))
        assert call.leads[-1] == pytest.approx(0.08)  # nothing left ahead of it

    asyncio.run(scenario())


def test_vonage_audio_is_binary_and_its_notify_payload_comes_back():
    clock = ManualClock(start=5.0)
    call = PhoneCall(None, carrier_media("vonage"), clock)
    opening = json.loads(call.media.opening()[0])
    assert opening["event"] == "websocket:connected" and opening["content-type"] == "audio/l16;rate=16000"
    packet = bytes(640)  # 20 ms at 16 kHz
    frames = [call.received(packet)[0] for _ in range(4)]
    assert [len(f) for f in frames] == [0, 0, 0, 1] and len(frames[3][0]) == FRAME  # a frame once whole
    assert call.leads == pytest.approx([0.02, 0.04, 0.06, 0.08])
    call.received(json.dumps({"action": "notify", "payload": {"name": "7"}}))

    async def scenario() -> None:
        await clock.advance(0.08)
        assert [json.loads(r) for r in call.returns()] == [{"event": "websocket:notify", "payload": {"name": "7"}}]

    asyncio.run(scenario())
    sent = []

    class Socket:
        async def send(self, message) -> None:
            sent.append(message)

    call.ws = Socket()
    asyncio.run(call.send_pcm(np.zeros(FRAME, np.float32)))
    assert [len(m) for m in sent] == [640] * 4 and all(isinstance(m, bytes) for m in sent)


def test_the_media_url_comes_from_the_servers():
    assert phone_url("ws://h:1/api/chat?token=t", "twilio") == "ws://h:1/twilio/media"
    assert phone_url("wss://kame.example", "vonage") == "wss://kame.example/vonage/media"


@pytest.mark.realtime
def test_bench_load_calls_over_each_carrier_beside_live(tmp_path, capsys):
    """Each carrier's call: every frame sent comes back (tiny-copy speaks each frame), timed as it arrives,
    and the carrier never holds more than the pacer's two frames unplayed (plus scheduling slack). No frame
    index on a carrier's wire: frame k back is timed against frame k sent, so each input frame the server
    skipped (a busy machine) makes the later frames of its call look 80 ms slower, as for `live`."""
    out = tmp_path / "load.json"
    with running_server(asr="none", max_sessions=2, frontend="tiny-copy") as (url, _):
        code = main(["bench", "load", "--url", url, "--levels", "2", "--seconds", "3",
                     "--transport", "live,twilio,telnyx,vonage", "--json-out", str(out)])
    assert code == 0
    levels = json.loads(out.read_text())["levels"]
    assert [(level["transport"], level["sessions"]) for level in levels] == [
        ("live", 2), ("twilio", 2), ("telnyx", 2), ("vonage", 2)]
    assert "lead_ms" not in levels[0]
    for level in levels[1:]:
        assert level["refused"] == 0 and level["frames_sent"] >= 2 * 3 * 12
        # the last frame may be in flight when the call hangs up
        assert level["frames_dropped"] <= 2 + skipped(level), level
        rt = level["round_trip_ms"]
        assert 0 < rt["p50"] <= rt["p95"] <= rt["p99"] and rt["p50"] < 1000 + 80 * skipped(level), level
        lead = level["lead_ms"]
        assert 0 < lead["p99"] <= lead["max"] <= 250, level
    table = capsys.readouterr().out
    assert "| twilio | 2 |" in table and "carrier lead p99 / max ms" in table
