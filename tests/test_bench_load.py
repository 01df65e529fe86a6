"""`kame bench load` against a real server: it reports latency, overhead, CPU and RSS per level."""

from __future__ import annotations

import json

from client.loadgen import FRAME, _MoshiFrames
from kame.cli import main

from .server_harness import running_server


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
        assert level["frames_dropped"] <= level["sessions"]  # at most the last frame in flight
        rt = level["round_trip_ms"]
        assert 0 < rt["p50"] <= rt["p95"] <= rt["p99"]
        assert level["engine_step_ms"] > 0 and level["server_rss_mb"] > 100
        assert level["overhead_ms"]["p50"] == round(rt["p50"] - level["engine_step_ms"], 2)
    fitting = [level["sessions"] for level in result["levels"] if level["round_trip_ms"]["p99"] <= 80]
    assert result["max_sessions_p99_under_80ms"] == max(fitting, default=0)
    assert "| sessions |" in capsys.readouterr().out


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
    assert moshi["frames_dropped"] <= 2 and 0 < realtime["frames_dropped"] <= 2 * 4
    assert realtime["frames_sent"] - realtime["frames_dropped"] >= 2 * 12 * 2 - 2 * 4
    for level in levels:
        rt = level["round_trip_ms"]
        assert 0 < rt["p50"] <= rt["p95"] <= rt["p99"] < 1000  # matched frame to frame, not shifted by one
    assert "| realtime | 2 |" in capsys.readouterr().out
