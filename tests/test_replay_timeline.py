"""`kame replay REC --timeline out.html`: recordings written by the real recorder (a GPT-Live
session's `{"live": event}` lines, an /api/chat session's events) become one self-contained HTML
file that draws the browser page's timeline; drawn in headless Chromium where it is installed."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from client.timeline import timeline_entries
from kame.cli import main
from kame.session_events import AssistantText, LLMAttempt, OracleApplied, Transcript
from server.recorder import SessionRecorder

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"


class Clock:
    """The recorder's clock (the session's), set by the test: each line's `t` is where the scenario says."""

    def __init__(self) -> None:
        self.at = 0.0

    def now(self) -> float:
        return self.at


@pytest.fixture
def clock() -> Clock:
    return Clock()


def live_session(root: Path, clock: Clock) -> Path:
    """A spoken question over GPT-Live: two delegations, the first superseded, the second answering
    while the user still talks; the recorder's own lines (transcript, oracle) beside the live ones."""
    recorder = SessionRecorder(root, "live1", clock, {"transport": "live-webrtc"})

    def at(t: float, event: dict) -> None:
        clock.at = t
        recorder.write_event({"live": event})

    at(0.1, {"type": "session.started", "session": {"id": "live1"}})
    for i, word in enumerate(["What ", "is ", "the ", "capital ", "of ", "France?"]):
        at(0.9 + 0.4 * i, {"type": "session.input_transcript.delta", "delta": word,
                           "start_ms": 500 + 400 * i, "end_ms": 850 + 400 * i})
    for n, (t, offset) in enumerate([(1.6, 1500), (2.4, 2300)], 1):
        at(t, {"type": "session.delegation.created", "offset_ms": offset,
               "delegation": {"id": f"d{n}", "type": "delegation", "target": "responses"}})
        at(t + 0.05, {"type": "response.event", "delegation_id": f"d{n}", "event": {"type": "response.created"}})
    at(2.5, {"type": "response.event", "delegation_id": "d1",
             "event": {"type": "response.completed", "response": {"status": "cancelled"}}})
    at(2.7, {"type": "response.event", "delegation_id": "d2", "event": {"type": "response.in_progress"}})
    clock.at = 2.75
    recorder.on_event(OracleApplied("reset", 2, "Paris is the capital of France.", 8, 34, True, 0))
    recorder.on_event(Transcript(True, "What is the capital of France?", 0.5, 2.85, 0.3))  # drawn from live
    at(3.0, {"type": "response.event", "delegation_id": "d2",
             "event": {"type": "response.output_text.done", "text": "Paris is the capital of France."}})
    at(3.0, {"type": "response.event", "delegation_id": "d2",
             "event": {"type": "response.completed", "response": {"status": "completed"}}})
    for i, word in enumerate(["Paris ", "is ", "the ", "capital."]):
        at(3.2 + 0.2 * i, {"type": "session.output_transcript.delta", "delta": word,
                           "start_ms": 3120 + 160 * i, "end_ms": 3200 + 160 * i})
    clock.at = 5.0
    recorder.close()
    return recorder.folder


def chat_session(root: Path, clock: Clock) -> Path:
    """The same question on /api/chat: the recorder's own event lines."""
    recorder = SessionRecorder(root, "chat1", clock, {"transport": "moshi"})
    script = [(1.0, Transcript(False, "what is the capital", 0.5, 0.9, 0.2)),
              (1.6, LLMAttempt("started", 1, "scripted", "words")),
              (1.7, LLMAttempt("first_token", 1, "scripted", "words", latency_s=0.1)),
              (1.8, OracleApplied("reset", 1, "Paris", 2, 22, True, 0)),
              (2.0, LLMAttempt("done", 1, "scripted", "words", answer="Paris.", took_oracle=True)),
              (2.4, Transcript(True, "what is the capital of France", 0.5, 2.9, 0.2)),
              (2.6, AssistantText(30, " Paris")), (2.7, AssistantText(31, " is"))]
    for t, event in script:
        clock.at = t
        recorder.on_event(event)
    clock.at = 4.0
    recorder.close()
    return recorder.folder


def test_a_live_recording_gives_its_live_events_and_the_recorders_oracle(tmp_path, clock):
    entries = timeline_entries(live_session(tmp_path, clock))
    kinds = [e["event"]["type"] for e in entries]
    assert "oracle" in kinds and "transcript" not in kinds  # the user's words come from the live deltas
    assert kinds.count("session.delegation.created") == 2
    assert entries == sorted(entries, key=lambda e: e["at"]) and entries[-1]["at"] == 3800
    assert all("t" not in e["event"] for e in entries)


def test_replay_timeline_writes_one_self_contained_file(tmp_path, clock, capsys):
    folder = live_session(tmp_path / "rec", clock)
    out = tmp_path / "live.html"
    assert main(["replay", str(folder), "--timeline", str(out)]) == 0
    text = out.read_text()
    assert "export function renderTimeline" in text and "session.delegation.created" in text
    assert "<script src" not in text and "import " not in text  # nothing to fetch
    assert '"timeline": "' in capsys.readouterr().out


def test_replay_timeline_wants_one_session(tmp_path, clock, capsys):
    live_session(tmp_path, clock)
    chat_session(tmp_path, clock)
    assert main(["replay", str(tmp_path), "--timeline", str(tmp_path / "x.html")]) != 0
    assert "draws one session" in capsys.readouterr().err


def draw(path: Path, screenshot: str | None = None) -> dict:
    """The HTML file in headless Chromium: what its timeline drew."""
    from playwright.async_api import async_playwright

    def count(kind: str) -> str:
        return f"document.querySelectorAll('#timeline [data-kind={kind}]').length"

    async def go():
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            try:
                page = await browser.new_page(viewport={"width": 1100, "height": 420})
                errors = []
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                await page.goto(path.as_uri())
                await page.wait_for_function("window.kameTimeline !== undefined", timeout=5000)
                drawn = {kind: await page.evaluate(count(kind)) for kind in
                         ("user", "attempt", "oracle-reset", "assistant", "first-words", "user-end")}
                drawn["statuses"] = await page.evaluate(
                    "[...document.querySelectorAll('#timeline [data-kind=attempt]')].map(a => a.dataset.status)")
                drawn["summary"] = await page.text_content("[data-testid=timeline-summary]")
                drawn["errors"] = errors
                if screenshot:
                    ARTIFACTS.mkdir(exist_ok=True)
                    await page.screenshot(path=str(ARTIFACTS / screenshot), full_page=True)
                return drawn
            finally:
                await browser.close()

    return asyncio.run(go())


browser = pytest.mark.skipif(not Path(CHROMIUM).exists() and os.environ.get("KAME_REQUIRE_BROWSER") != "1",
                             reason="Chromium is not installed (apt-get install chromium)")


@browser
@pytest.mark.slow
def test_the_replayed_live_timeline_draws_every_lane(tmp_path, clock):
    out = tmp_path / "live.html"
    main(["replay", str(live_session(tmp_path / "rec", clock)), "--timeline", str(out)])
    drawn = draw(out, "replay-timeline-live.png")
    assert drawn["errors"] == []
    assert drawn["statuses"] == ["cancelled", "adopted"]
    assert drawn["user"] == 1 and drawn["assistant"] == 1 and drawn["oracle-reset"] == 1
    assert drawn["first-words"] == 1 and drawn["user-end"] == 1
    # d2's first words: 2.7 s on the recorder's clock, whose offset to the timeline is the largest
    # (ms - t) of the timed events, -50 ms (the input deltas): 2.65 s, before the user's last word
    # ended (2.85 s)
    assert "Paris is the capital of France." in drawn["summary"] and "0.2 s before" in drawn["summary"]


@browser
@pytest.mark.slow
def test_the_replayed_chat_timeline_draws_every_lane(tmp_path, clock):
    out = tmp_path / "chat.html"
    main(["replay", str(chat_session(tmp_path / "rec", clock)), "--timeline", str(out)])
    drawn = draw(out, "replay-timeline-chat.png")
    assert drawn["errors"] == []
    assert drawn["statuses"] == ["adopted"]
    assert drawn["user"] == 1 and drawn["assistant"] == 1 and drawn["oracle-reset"] == 1
    assert "Paris." in drawn["summary"]
