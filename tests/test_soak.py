"""A short soak: good sessions keep real-time audio, each frame back within a bound, while garbage,
churn and a faulty LLM hit the server. The long version: scripts/soak.py --minutes N."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest

from kame.testing.openai_server import ScriptedOpenAIServer, faulty_script
from server.settings import ProfileSettings

from .server_harness import (
    ROUND_TRIP_P50_S,
    ROUND_TRIP_P99_S,
    few_dropped,
    round_trip_ms,
    rss_mb,
    running_server,
    soak_with_probe,
    wait_until_all_slots_free,
)

SECONDS = 20


@pytest.mark.realtime
def test_short_soak(voices):
    llm = ScriptedOpenAIServer(faulty_script(0))
    llm.start_in_thread()
    profiles = {"faulty": ProfileSettings(base_url=llm.base_url, model="m", api_key_env=None,
                                          first_token_timeout_s=1.0, token_timeout_s=0.5)}
    try:
        with running_server(asr="whisper", max_sessions=4, llm="faulty", profiles=profiles,
                            breaker_failures=50) as (url, services):
            before = rss_mb()
            # two good sessions: one speaks (the ASR and the faulty LLM in the loop), one times its frames
            report, probe = asyncio.run(soak_with_probe(url + "/api/chat", voices["spider"], SECONDS, good=1))
            http = url.replace("ws://", "http://")
            healthy = urllib.request.urlopen(http + "/healthz", timeout=5).status == 200
            wait_until_all_slots_free(services)  # every slot was freed
            growth = rss_mb() - before
    finally:
        llm.stop_thread()
    assert healthy  # the server is up
    for good in report["good"]:
        assert not good.errors
        # every frame of a good session came back or was reported dropped (a busy machine's stall skips
        # the session to live, counted), but for the last in flight; and most came back
        assert good.accounted_ratio >= 1 - 2 / good.frames_sent, (good.frames_sent, good.frames_received,
                                                                   good.frames_dropped)
        assert few_dropped(good.frames_dropped, good.frames_sent), good.frames_dropped
        assert good.frames_sent >= 0.9 * SECONDS * 12.5
    assert probe.refused == 0 and probe.frames_sent >= 0.9 * SECONDS * 12.5
    assert probe.frames_received + probe.frames_dropped >= probe.frames_sent - 2, probe  # all accounted ...
    assert few_dropped(probe.frames_dropped, probe.frames_sent), probe  # ... most back
    figures = round_trip_ms(probe)  # ... and soon: not buffered, not ever later
    assert figures["p50"] < ROUND_TRIP_P50_S * 1000, figures
    assert figures["p99"] < ROUND_TRIP_P99_S * 1000, figures
    assert report["garbage_connections"] >= 3 and report["churn_sessions"] >= 3
    assert len(llm.requests) >= 2  # the faulty LLM was really in the loop
    assert growth < 300, f"RSS grew by {growth:.0f} MB"
