"""The browser page over GPT-Live's WebRTC transport, in real headless Chromium with the fake
microphone reading the question: the page's own RTCPeerConnection posts its offer to
/v1/live/sessions on the real server, the panes fill from the Live events and the timeline draws
the user's words, the backend's delegations and the assistant's speech.

Skipped without Chromium, unless KAME_REQUIRE_BROWSER=1 (as test_browser.py).
"""

from __future__ import annotations

import asyncio

import pytest

from .test_browser import ARTIFACTS, heard_and_answered, open_page, question_wav  # noqa: F401 (a fixture)


def count(selector: str) -> str:
    return f"document.querySelectorAll({selector!r}).length"


@pytest.mark.slow
def test_page_talks_gpt_live_over_webrtc_and_draws_the_timeline(tandem_server, question_wav):  # noqa: F811
    url, services = tandem_server
    sessions_before = services.metrics.transport_sessions.labels("live-webrtc")._value.get()
    asked_40ms = services.metrics.webrtc_peer_packets.labels("40")
    forty_before = asked_40ms._value.get()

    async def scenario():
        manager, browser, page = await open_page(question_wav)
        try:
            await page.set_viewport_size({"width": 1280, "height": 1000})
            page_errors = []
            page.on("pageerror", lambda exc: page_errors.append(str(exc)))
            await page.goto(url.replace("ws://", "http://") + "/?transport=live")
            await page.get_by_role("button", name="Start").click()
            await page.wait_for_function("document.querySelector('[data-testid=status]').textContent === 'connected'",
                                         timeout=20000)
            await heard_and_answered(page)
            await page.wait_for_function(f"{count('#timeline [data-kind=attempt][data-status=adopted]')} > 0"
                                         f" && {count('#timeline [data-kind=assistant]')} > 0", timeout=10000)
            await asyncio.sleep(1.0)  # the cursor and the last words drawn
            result = {
                "user": await page.get_by_test_id("user-transcript").text_content(),
                "oracle": await page.get_by_test_id("oracle-text").text_content(),
                "assistant": await page.get_by_test_id("assistant-text").text_content(),
                "error_hidden": await page.locator("#error").is_hidden(),
                "page_errors": page_errors,
                "stats": await page.evaluate("window.kameStats"),
                "rtt_label": await page.locator("#rtt-label").text_content(),
                "jitter_shown": await page.locator("#jitter-figure").is_visible(),
                "attempts": await page.evaluate(count("#timeline [data-kind=attempt]")),
                "user_blocks": await page.evaluate(count("#timeline [data-kind=user]")),
                "assistant_blocks": await page.evaluate(count("#timeline [data-kind=assistant]")),
                "oracle_resets": await page.evaluate(count("#timeline [data-kind=oracle-reset]")),
                "first_answer": await page.evaluate("window.kameTimeline.firstAnswer()"),
                "user_end": await page.evaluate("window.kameTimeline.userEnd()"),
                "summary": await page.get_by_test_id("timeline-summary").text_content(),
            }
            ARTIFACTS.mkdir(exist_ok=True)
            await page.screenshot(path=str(ARTIFACTS / "browser-live-session.png"), full_page=True)
            await page.get_by_role("button", name="Stop").click()
            await page.wait_for_function("document.querySelector('[data-testid=status]').textContent === 'idle'",
                                         timeout=5000)
            for _ in range(50):  # the server's side of the session ends
                if asked_40ms._value.get() > forty_before:
                    break
                await asyncio.sleep(0.1)
            return result
        finally:
            await browser.close()
            await manager.stop()

    result = asyncio.run(scenario())
    assert "capital of France" in " ".join(result["user"].split()), result  # (spaces kept the user turn open)
    assert "Paris is the capital of France" in result["assistant"], result
    assert "Paris" in result["oracle"], result  # the delegation's answer in the LLM pane
    assert result["error_hidden"] and result["page_errors"] == [], result
    assert result["stats"]["transport"] == "live-webrtc"
    assert result["stats"]["events"] > 10 and result["stats"]["framesPlayed"] > 10  # the remote track played
    # Chromium's jitter buffer delay, shown as such (the figure for docs/benchmarks.md's WebRTC notes)
    print(f"Chromium jitter buffer {result['stats']['jitterBufferTrace']} ms (a second each), "
          f"network round trip {result['stats'].get('networkRttMs')} ms")
    assert 0 < result["stats"]["jitterBufferMs"] < 1000, result["stats"]
    # the assistant's 40 ms Opus packets decoded, not concealed (what NetEQ plays when it has nothing)
    print(f"Chromium concealed {result['stats']['concealedShare']:.1%} of the samples it played")
    assert result["stats"]["concealedShare"] < 0.5, result["stats"]
    assert result["rtt_label"] == "network round trip" and result["jitter_shown"], result
    assert result["attempts"] >= 1 and result["user_blocks"] >= 1 and result["assistant_blocks"] >= 1
    assert result["oracle_resets"] >= 1  # kame.oracle, asked for with ?kame_events=true
    assert result["first_answer"] is not None and result["user_end"] is not None
    assert "first words came" in result["summary"]
    assert services.metrics.transport_sessions.labels("live-webrtc")._value.get() == sessions_before + 1
    # Chromium's microphone packets are as long as the server's answer asked (a=ptime:40), not its 20 ms default
    assert asked_40ms._value.get() == forty_before + 1, services.metrics.webrtc_peer_packets.collect()
