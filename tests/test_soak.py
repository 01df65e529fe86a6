"""A short soak: good sessions keep real-time audio while garbage, churn and a faulty LLM hit the server.
The long version: scripts/soak.py --minutes N."""

from __future__ import annotations

import asyncio
import urllib.request

from client.loadgen import soak
from kame.testing.openai_server import ScriptedOpenAIServer, faulty_script
from server.settings import ProfileSettings

from .server_harness import rss_mb, running_server, wait_until_all_slots_free

SECONDS = 20


def test_short_soak(voices):
    llm = ScriptedOpenAIServer(faulty_script(0))
    llm.start_in_thread()
    profiles = {"faulty": ProfileSettings(base_url=llm.base_url, model="m", api_key_env=None,
                                          first_token_timeout_s=1.0, token_timeout_s=0.5)}
    try:
        with running_server(asr="whisper", max_sessions=4, llm="faulty", profiles=profiles,
                            breaker_failures=50) as (url, services):
            before = rss_mb()
            report = asyncio.run(soak(url + "/api/chat", voices["spider"], SECONDS, good=2))
            http = url.replace("ws://", "http://")
            healthy = urllib.request.urlopen(http + "/healthz", timeout=5).status == 200
            wait_until_all_slots_free(services)  # every slot was freed
            growth = rss_mb() - before
    finally:
        llm.stop_thread()
    assert healthy  # the server is up
    for good in report["good"]:
        assert not good.errors
        assert good.real_time_ratio > 0.95  # every good session kept getting its audio back
        assert good.frames_sent >= 0.9 * SECONDS * 12.5
    assert report["garbage_connections"] >= 3 and report["churn_sessions"] >= 3
    assert len(llm.requests) >= 2  # the faulty LLM was really in the loop
    assert growth < 300, f"RSS grew by {growth:.0f} MB"
