"""The long soak test: a real server (tiny-copy, Whisper, a faulty scripted LLM) on loopback, good
sessions at real-time pace, one more that times every frame's round trip, garbage and churning
clients, for N minutes; prints a JSON report, exits 1 when a session lost audio, a round trip was
over the bound of tests/test_soak.py or a slot was never freed.

    python scripts/soak.py --minutes 10 [--good 3] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kame.testing.openai_server import ScriptedOpenAIServer, faulty_script
from kame.testing.speech import speech
from server.settings import ProfileSettings
from tests.server_harness import (
    ROUND_TRIP_P50_S,
    ROUND_TRIP_P99_S,
    few_dropped,
    round_trip_ms,
    rss_mb,
    running_server,
    soak_with_probe,
    wait_until_all_slots_free,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--good", type=int, default=3, help="good sessions (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    llm = ScriptedOpenAIServer(faulty_script(args.seed))
    llm.start_in_thread()
    voice = speech("How many legs does a spider have?", Path.home() / ".cache" / "kame-tts")
    profiles = {"faulty": ProfileSettings(base_url=llm.base_url, model="m", api_key_env=None,
                                          first_token_timeout_s=1.0, token_timeout_s=0.5)}
    try:
        with running_server(asr="whisper", max_sessions=args.good + 3, llm="faulty", profiles=profiles,
                            breaker_failures=50) as (url, services):
            before, started = rss_mb(), time.monotonic()
            report, probe = asyncio.run(soak_with_probe(url + "/api/chat", voice, args.minutes * 60, args.good,
                                                        args.seed))
            with contextlib.suppress(AssertionError):  # slots still taken: reported as free_slots_after
                wait_until_all_slots_free(services)
            result = {
                "minutes": args.minutes, "wall_s": round(time.monotonic() - started, 1),
                "rss_before_mb": round(before), "rss_after_mb": round(rss_mb()),
                "free_slots_after": services.runtime.runner.free_slots, "slots": services.runtime.engine.batch_size,
                "llm_requests": len(llm.requests), "garbage_connections": report["garbage_connections"],
                "churn_sessions": report["churn_sessions"],
                "good": [{"frames_sent": g.frames_sent, "frames_received": g.frames_received,
                          "frames_dropped": g.frames_dropped,
                          "errors": g.errors} for g in report["good"]],
                "probe": {"frames_sent": probe.frames_sent, "frames_received": probe.frames_received,
                          "frames_dropped": probe.frames_dropped,
                          "round_trip_ms": round_trip_ms(probe),
                          "bound_ms": {"p50": ROUND_TRIP_P50_S * 1000, "p99": ROUND_TRIP_P99_S * 1000}},
            }
    finally:
        llm.stop_thread()
    print(json.dumps(result, indent=2))
    return 0 if passed(result) else 1


def passed(result: dict) -> bool:
    """What tests/test_soak.py asserts: slots freed, no audio lost without a word (every frame back or
    reported dropped, a quarter at most dropped), every frame back soon."""
    probe, trips = result["probe"], result["probe"]["round_trip_ms"]
    return (result["free_slots_after"] == result["slots"]
            and all(accounted(g) and not g["errors"] for g in result["good"])
            and accounted(probe) and trips["p99"] is not None
            and trips["p50"] < ROUND_TRIP_P50_S * 1000 and trips["p99"] < ROUND_TRIP_P99_S * 1000)


def accounted(session: dict) -> bool:
    sent, dropped = session["frames_sent"], session["frames_dropped"]
    return session["frames_received"] + dropped >= sent - 2 and few_dropped(dropped, sent)


if __name__ == "__main__":
    sys.exit(main())
