"""`kame bench load` against a real server: it reports latency, overhead, CPU and RSS per level."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from client.live_client import client_frames
from client.loadgen import FRAME, _MoshiFrames
from kame.cli import main
from kame.frontend.engine import FRAME_SIZE, BatchedEngine, NullEngine
from kame.frontend.oracle import OracleUpdate

from .server_harness import running_server

FIXTURES = Path(__file__).parent / "fixtures"


def skipped(level: dict) -> int:
    """The input frames the server says it dropped during the level: after an engine step slower than a
    frame (a busy machine), a live session skips to live by design, and those frames never come back."""
    return int(level["server_frames_dropped"]["in"])


def test_moshi_frames_back_are_matched_past_the_drops_the_server_counts():
    timed: list[tuple[int, float]] = []
    frames = _MoshiFrames(timed)
    for _ in range(3):
        frames.audio(FRAME // 2)  # half frames: a frame counts once whole
        frames.audio(FRAME - FRAME // 2)
    frames.dropped(0)  # a stats event, no drop: frames 0-2 back answer frames 0-2 sent
    frames.audio(2 * FRAME)
    frames.dropped(2)  # two frames dropped since the last stats: which the two back answer is unknown
    frames.audio(FRAME)  # past both drops: the 6th frame back answers the 8th sent
    frames.end()
    assert [frame for frame, _ in timed] == [0, 1, 2, 7] and frames.unmatched == 2


@pytest.mark.realtime
def test_bench_load_reports_every_level(tmp_path, capsys):
    out = tmp_path / "load.json"
    with running_server(asr="none", max_sessions=2, frontend="tiny") as (url, _):
        code = main(["bench", "load", "--url", url + "/api/chat", "--levels", "1,2", "--seconds", "2",
                     "--json-out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert [level["sessions"] for level in result["levels"]] == [1, 2]
    for level in result["levels"]:
        assert level["refused"] == 0 and level["frames_sent"] >= 2 * 12 * level["sessions"]
        assert level["frames_dropped"] <= level["sessions"] + skipped(level)  # the last frame in flight
        rt = level["round_trip_ms"]
        assert 0 < rt["p50"] <= rt["p95"] <= rt["p99"]
        assert level["engine_step_ms"] > 0 and level["server_rss_mb"] > 100
        assert level["overhead_ms"]["p50"] == round(rt["p50"] - level["engine_step_ms"], 2)
    fitting = [level["sessions"] for level in result["levels"] if level["round_trip_ms"]["p99"] <= 80]
    assert result["max_sessions_p99_under_80ms"] == max(fitting, default=0)
    assert "| sessions |" in capsys.readouterr().out


@pytest.mark.realtime
def test_bench_load_drives_both_transports_side_by_side(tmp_path, capsys):
    """/api/chat and /v1/realtime, each level on both: every frame's round trip, matched by frame."""
    out = tmp_path / "load.json"
    with running_server(asr="none", max_sessions=2, frontend="tiny-copy") as (url, _):
        code = main(["bench", "load", "--url", url + "/api/chat", "--levels", "2", "--seconds", "2",
                     "--transport", "both", "--json-out", str(out)])
    assert code == 0
    levels = json.loads(out.read_text())["levels"]
    assert [(level["transport"], level["sessions"]) for level in levels] == [("moshi", 2), ("realtime", 2)]
    moshi, realtime = levels
    # the Realtime endpoint sends only speech: all but the first frames (before the model's audio is ready)
    assert moshi["frames_dropped"] <= 2 + skipped(moshi)
    assert 0 < realtime["frames_dropped"] <= 2 * 4 + skipped(realtime)
    assert realtime["frames_sent"] - realtime["frames_dropped"] >= 2 * 12 * 2 - 2 * 4 - skipped(realtime)
    for level in levels:
        rt = level["round_trip_ms"]
        assert 0 < rt["p50"] <= rt["p95"] <= rt["p99"] < 1000  # matched frame to frame, not shifted by one
    assert "| realtime | 2 |" in capsys.readouterr().out


@pytest.mark.realtime
def test_bench_load_times_every_frame_over_webrtc(tmp_path):
    """GPT-Live over WebRTC: the frames back are timed by the RTP packets that carried their starts, which
    the server names in batched `kame.output_audio.sent` events (a frame the server did not name, its
    batch lost, counts as not back)."""
    out = tmp_path / "load.json"
    with running_server(asr="none", max_sessions=2, frontend="tiny-copy") as (url, _):
        code = main(["bench", "load", "--url", url, "--levels", "2", "--seconds", "3",
                     "--transport", "live,live-webrtc", "--json-out", str(out)])
    assert code == 0
    levels = json.loads(out.read_text())["levels"]
    assert [(level["transport"], level["sessions"]) for level in levels] == [("live", 2), ("live-webrtc", 2)]
    webrtc = levels[1]
    assert webrtc["frames_sent"] >= 2 * 3 * 12
    # a frame whose packet the server did not name is not counted back: all but the last in flight were
    assert webrtc["frames_dropped"] <= 2 + skipped(webrtc) and webrtc["frames_untimed"] <= 2
    rt = webrtc["round_trip_ms"]
    assert 0 < rt["p50"] <= rt["p95"] < 1000  # (a frame matched to a later one sent would come out negative)


@pytest.mark.realtime
def test_the_null_frontend_echoes_speech_and_the_loop_lag_is_reported(tmp_path):
    """`--frontend null` (host-side benchmarks): each frame back is the frame sent at half the level,
    and a level reports the event loop's lag from the server's own probe."""
    out = tmp_path / "load.json"
    with running_server(asr="none", max_sessions=2, frontend="null") as (url, services):
        code = main(["bench", "load", "--url", url + "/api/chat", "--levels", "2", "--seconds", "2",
                     "--input", str(FIXTURES / "question.wav"), "--json-out", str(out)])
        lag_samples = services.metrics.loop_lag.collect()[0].samples
    assert code == 0
    level = json.loads(out.read_text())["levels"][0]
    assert level["refused"] == 0 and level["frames_dropped"] <= 2 + skipped(level)
    count = next(s.value for s in lag_samples if s.name.endswith("_count"))
    assert count >= 10  # the probe ran every 100 ms while the level did
    assert level["loop_lag_ms"]["mean"] is not None and level["loop_lag_ms"]["mean"] >= 0
    assert level["client_cpu_cores"] > 0


def test_the_null_engine_steps_nothing_but_keeps_the_slots_books(tiny):
    frame = np.linspace(-1, 1, FRAME_SIZE, dtype=np.float32)
    runs = {}
    for kind in (NullEngine, BatchedEngine):
        engine = kind(tiny, batch_size=2)
        try:
            slot = engine.acquire()
            engine.push_oracle(slot, OracleUpdate.reset(0, (10, 11)))
            runs[kind] = [engine.step({slot: frame})[0] for _ in range(4)]
        finally:
            engine.close()
    null, real = runs[NullEngine], runs[BatchedEngine]
    assert [out.frame for out in null] == [0, 1, 2, 3]
    assert all(np.array_equal(out.pcm, frame * 0.5) and out.audio_ready and out.text_token is None for out in null)
    # the oracle timeline and its updates as the real engine keeps them
    assert [out.oracle_token for out in null] == [out.oracle_token for out in real]
    assert [out.applied for out in null] == [out.applied for out in real]
    assert len(null[0].applied) == 1


def test_webrtc_frames_back_are_matched_by_the_probes():
    """The probes of the session's timeline take out the silence the server fed, and a frame back
    across a jump (silence fed mid-session) is left untimed rather than matched to the wrong frame."""
    back = [(frame, 10.0 + frame) for frame in range(2, 12)]
    # 2 frames of silence before the client spoke; ~1.5 frames in flight at each later probe; at the
    # 4th a frame of silence more (the lag jumps by one)
    probes = [(160, 0), (380, 4), (700, 8), (1100, 12)]
    matched, untimed = client_frames(back, probes, said=14)
    assert matched == [(frame - 2, 10.0 + frame) for frame in range(2, 9)]
    assert untimed == 3  # frames 9-11: between the 3rd probe (8.75 frames in) and the 4th, across the jump


def test_the_server_address_may_be_the_pages():
    import argparse

    from client.bench import server_url

    assert server_url("http://127.0.0.1:8998") == "ws://127.0.0.1:8998/api/chat"
    assert server_url("https://kame.example/") == "wss://kame.example/api/chat"
    assert server_url("ws://h:1/api/chat?token=t") == "ws://h:1/api/chat?token=t"
    with pytest.raises(argparse.ArgumentTypeError, match="not a server address"):
        server_url("127.0.0.1:8998")
