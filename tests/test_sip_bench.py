"""`kame bench load --transport sip`: calls placed with the project's SIP stack as the phone (client/sip_phone.py)
into `kame serve --sip`, beside GPT-Live WebSocket sessions: every frame timed from its RTP packets up to the
audio back, and the server's RTP send jitter as the phones saw it."""

from __future__ import annotations

import json

import pytest

from kame.cli import main

from .server_harness import running_server
from .sip_peers import free_udp_tcp_port
from .test_bench_load import skipped


@pytest.mark.realtime
def test_bench_load_places_sip_calls_beside_live(tmp_path, capsys):
    out, port = tmp_path / "load.json", free_udp_tcp_port()
    with running_server(asr="none", max_sessions=2, frontend="tiny-copy",
                        sip={"listen": f"127.0.0.1:{port}"}) as (url, _):
        code = main(["bench", "load", "--url", url, "--levels", "2", "--seconds", "3", "--transport", "live,sip",
                     "--sip", f"127.0.0.1:{port}", "--json-out", str(out)])
    assert code == 0
    live, sip = json.loads(out.read_text())["levels"]
    assert (live["transport"], sip["transport"]) == ("live", "sip")
    assert sip["refused"] == 0 and sip["frames_sent"] >= 2 * 3 * 12, sip
    # every frame back but those in flight when the phone hangs up (an RTP packet is 20 ms of a frame)
    assert sip["frames_dropped"] <= 2 * 2 + skipped(sip) + sip["server_frames_dropped"]["out"], sip
    rt = sip["round_trip_ms"]
    assert 0 < rt["p50"] <= rt["p95"] <= rt["p99"] and rt["p50"] < 1000 + 80 * skipped(sip), sip
    jitter = sip["rtp_send_jitter_ms"]
    assert 0 <= jitter["p99"] <= jitter["max"], sip
    assert "| sip | 2 |" in capsys.readouterr().out
