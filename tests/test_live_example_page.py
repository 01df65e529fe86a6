"""examples/live_webrtc.html, the smallest browser app on GPT-Live over WebRTC, in real headless
Chromium: served from another origin than the server (CORS for an allowed origin), opened with a
client secret minted by the openai SDK with the server's token, it speaks the question (the fake
microphone) and shows both transcripts.

Skipped without Chromium, unless KAME_REQUIRE_BROWSER=1 (as test_browser.py).
"""

from __future__ import annotations

import asyncio
import functools
import http.server
import threading
from pathlib import Path

import pytest
from openai import OpenAI

from .server_harness import running_server
from .test_browser import open_page, question_wav  # noqa: F401 (a fixture)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def examples_site():
    """examples/ served on a loopback port of its own: another origin than the KAME server."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(EXAMPLES))
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=site.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{site.server_address[1]}"
    site.shutdown()


@pytest.mark.slow
def test_the_example_page_talks_from_another_origin_with_a_client_secret(scripted_llm, examples_site,
                                                                           question_wav):  # noqa: F811
    from server.settings import ProfileSettings

    profiles = {"scripted": ProfileSettings(base_url=scripted_llm.base_url, model="scripted", api_key_env=None)}
    with running_server(asr="whisper", profiles=profiles, llm="scripted", auth_tokens=["server-token"],
                        allowed_origins=[examples_site]) as (url, _):
        server = url.replace("ws://", "http://")
        secret = OpenAI(base_url=server + "/v1", api_key="server-token").realtime.client_secrets.create()

        async def scenario():
            manager, browser, page = await open_page(question_wav)
            try:
                await page.goto(f"{examples_site}/live_webrtc.html?server={server}&key={secret.value}")
                await page.get_by_role("button", name="Start").click()
                await page.wait_for_function(
                    "document.getElementById('assistant').textContent.includes('capital of France')"
                    " && document.getElementById('user').textContent.includes('France')",
                    timeout=40000)  # the answer may come before the question's end
                return {key: await page.locator(f"#{key}").text_content() for key in ("status", "user", "assistant")}
            finally:
                await browser.close()
                await manager.stop()

        seen = asyncio.run(scenario())
    assert seen["status"] == "connected"
    assert "capital of France" in " ".join(seen["user"].split())  # (spaces kept the user turn open)
    assert "Paris is the capital of France" in seen["assistant"]
