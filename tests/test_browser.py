"""The browser page in a real headless Chromium, with Chromium's fake microphone reading a WAV.

Needs Debian's `chromium` (CI installs it). Without it the tests are skipped, unless
KAME_REQUIRE_BROWSER=1 (as in CI), where they fail instead.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import wave
from pathlib import Path

import numpy as np
import pytest

from client.client import KameClient, ServerBusy

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"

if not Path(CHROMIUM).exists():
    if os.environ.get("KAME_REQUIRE_BROWSER") == "1":
        raise RuntimeError("Chromium is required (apt-get install chromium)")
    pytest.skip("Chromium is not installed (apt-get install chromium)", allow_module_level=True)


def write_pcm16(path: Path, pcm: np.ndarray) -> None:
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(24000)
        out.writeframes((np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes())


async def open_page(wav: Path):
    from playwright.async_api import async_playwright

    manager = async_playwright()
    playwright = await manager.start()
    browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=[
        "--no-sandbox", "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={wav}", "--disable-background-networking",
        "--autoplay-policy=no-user-gesture-required", "--disable-gpu",
    ])
    page = await browser.new_page()
    return playwright, browser, page


async def heard_and_answered(page) -> None:
    """Once the page shows the question heard and the scripted answer said (tiny-copy says its oracle)."""
    await page.wait_for_function(
        "document.querySelector('[data-testid=user-transcript]').textContent.includes('capital')", timeout=30000)
    await page.wait_for_function(
        "document.querySelector('[data-testid=assistant-text]').textContent"
        ".includes('Paris is the capital of France')", timeout=30000)


@pytest.fixture
def question_wav(voices, tmp_path) -> Path:
    path = tmp_path / "question.wav"
    silence = np.zeros(24000 * 6, np.float32)
    write_pcm16(path, np.concatenate([np.zeros(12000, np.float32), voices["france"], silence]))
    return path


def test_page_talks_to_the_server(tandem_server, question_wav):
    url, services = tandem_server
    errors_before = services.metrics.protocol_errors._value.get()
    http = url.replace("ws://", "http://") + "/?transport=chat"  # the page's default is GPT-Live (test_browser_live)

    async def scenario():
        manager, browser, page = await open_page(question_wav)
        try:
            await page.goto(http)
            start = page.get_by_role("button", name="Start")
            await start.click()
            status = page.get_by_test_id("status")
            await page.wait_for_function("document.querySelector('[data-testid=status]').textContent === 'connected'",
                                         timeout=20000)
            await page.get_by_role("button", name="Stop").wait_for(timeout=5000)
            await heard_and_answered(page)
            result = {
                "user": await page.get_by_test_id("user-transcript").text_content(),
                "oracle": await page.get_by_test_id("oracle-text").text_content(),
                "assistant": await page.get_by_test_id("assistant-text").text_content(),
                "stats": await page.evaluate("window.kameStats"),
                "rtt": await page.get_by_test_id("rtt").text_content(),
                "backends": await page.locator("#backend option").all_text_contents(),
            }
            ARTIFACTS.mkdir(exist_ok=True)
            await page.screenshot(path=str(ARTIFACTS / "browser-session.png"), full_page=True)
            await page.get_by_role("button", name="Stop").click()
            result["status_after"] = await status.text_content()
            return result
        finally:
            await browser.close()
            await manager.stop()

    result = asyncio.run(scenario())
    assert "capital of France" in result["user"]
    assert "Paris" in result["oracle"]
    assert "Paris is the capital of France" in result["assistant"]
    stats = result["stats"]
    assert stats["framesSent"] > 20 and stats["framesReceived"] > 20 and stats["framesPlayed"] > 10
    assert result["rtt"].isdigit()
    assert stats["uplink"] == "opus"  # Chromium has WebCodecs' Opus encoder: the microphone goes up as Ogg/Opus
    assert services.metrics.protocol_errors._value.get() == errors_before  # every Ogg page was well formed
    assert "scripted" in result["backends"]
    assert result["status_after"] == "idle"


@pytest.mark.parametrize("transport", ["chat", "live"])
def test_page_explains_a_refused_connection_and_offers_retry(tandem_server, question_wav, transport):
    """Every slot taken: /api/chat's websocket closes before its handshake, the WebRTC POST gets 503."""
    url, services = tandem_server

    async def scenario():
        holders = []
        while len(holders) <= services.runtime.engine.batch_size:  # fill every slot
            try:
                holders.append(await KameClient.connect(url + "/api/chat"))
            except ServerBusy:
                break
        manager, browser, page = await open_page(question_wav)
        try:
            await page.goto(url.replace("ws://", "http://") + f"/?transport={transport}")
            await page.get_by_role("button", name="Start").click()
            error = page.get_by_role("alert")
            await error.wait_for(state="visible", timeout=15000)
            text = await error.text_content()
            retry_visible = await page.get_by_role("button", name="Retry").is_visible()
            start_again = await page.get_by_role("button", name="Start").is_visible()
            return text, retry_visible, start_again
        finally:
            await browser.close()
            await manager.stop()
            for holder in holders:
                await holder.close()

    text, retry_visible, start_again = asyncio.run(scenario())
    assert "refused" in text and retry_visible and start_again


def test_page_asks_for_a_language_and_a_persona_and_shows_why_they_are_refused(tandem_server, question_wav):
    """The page's Language, Persona and Voice fields go into /api/chat's query at Start; the shared server (the
    bundled English-only Whisper, tiny-copy: no persona) refuses each, and the page says why instead of "full or
    down".
    With GPT-Live as the transport the fields are off (it does not carry them yet)."""
    url, _ = tandem_server

    async def scenario():
        manager, browser, page = await open_page(question_wav)
        asked = []
        page.on("websocket", lambda ws: asked.append(ws.url))
        try:
            shown = []
            await page.goto(url.replace("ws://", "http://") + "/?transport=chat")
            for language, persona, voice in (("ja", "", ""), ("", "You are a pirate.", ""), ("", "", "NATF2.pt")):
                await page.get_by_label("Language").select_option(language)
                await page.get_by_label("Persona").fill(persona)
                await page.get_by_label("Voice").fill(voice)
                await page.get_by_role("button", name="Start").click()
                error = page.get_by_role("alert")
                await error.wait_for(state="visible", timeout=15000)
                shown.append(await error.text_content())
                await page.get_by_role("button", name="Start").wait_for(timeout=5000)
            await page.get_by_label("Transport").select_option("live")
            disabled = [await page.get_by_label(name).is_disabled() for name in ("Language", "Persona", "Voice")]
            return asked, shown, disabled
        finally:
            await browser.close()
            await manager.stop()

    asked, shown, disabled = asyncio.run(scenario())
    assert len(asked) == 3 and "language=ja" in asked[0] and "text_prompt=You+are+a+pirate." in asked[1]
    assert "text_prompt" not in asked[0] and "language" not in asked[1] and "voice_prompt=NATF2.pt" in asked[2]
    assert shown[0].startswith("The server refused the session: ") and "hears English only, not Japanese" in shown[0]
    assert "takes no persona (a role text)" in shown[1] and "takes no persona (a role text or a voice)" in shown[2]
    assert disabled == [True, True, True]
