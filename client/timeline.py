"""`kame replay REC --timeline out.html`: a recorded session's timeline (the browser page's
`client/web/timeline.js`, inlined with the recording's events) as one self-contained HTML file."""

from __future__ import annotations

import html
import json
from pathlib import Path

from kame.errors import KameError

TIMELINE_JS = Path(__file__).resolve().parent / "web" / "timeline.js"
CHAT_EVENTS = ("transcript", "llm", "oracle", "text")  # the /api/chat shapes timeline.js draws
PX_PER_SECOND = 120  # a recording is drawn whole, at a fixed scale (the page scrolls)


def timeline_entries(folder: Path) -> list[dict]:
    """The recording's events as timeline.js takes them: `{event, at}` (`at`: ms since the
    recording began). A GPT-Live session's are its `{"live": event}` lines, plus the recorder's
    own `oracle` lines when the client did not ask for `kame.oracle`; any other session's are
    its /api/chat events."""
    path = folder / "events.jsonl"
    if not path.is_file():
        raise KameError(f"{folder} holds no events.jsonl: not a recorded session")
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    live = [_entry(line["live"], line) for line in lines if "live" in line]
    if not live:
        return [_entry(line, line) for line in lines if line.get("type") in CHAT_EVENTS]
    if not any(entry["event"]["type"] == "kame.oracle" for entry in live):
        live += [_entry(line, line) for line in lines if line.get("type") == "oracle"]
    return sorted(live, key=lambda entry: entry["at"])


def _entry(event: dict, line: dict) -> dict:
    return {"event": {k: v for k, v in event.items() if k != "t"}, "at": round(line.get("t", 0.0) * 1000)}


def timeline_html(title: str, entries: list[dict]) -> str:
    """One HTML file: timeline.js and the events inline, nothing fetched."""
    script = TIMELINE_JS.read_text()
    data = json.dumps(entries).replace("</", "<\\/")  # no "</script>" inside the data
    return f"""<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><title>KAME timeline: {html.escape(title)}</title>
<style>body {{ font-family: system-ui, sans-serif; margin: 1rem; color: #1d2433; }}
#timeline {{ overflow-x: auto; border: 1px solid #d5dae3; border-radius: 0.5rem; padding: 0.3rem; }}</style>
</head>
<body>
<h1>KAME timeline <small>{html.escape(title)}</small></h1>
<div id="timeline" data-testid="timeline"></div>
<script type="application/json" id="events">{data}</script>
<script type="module">
{script}
const entries = JSON.parse(document.getElementById("events").textContent);
const model = timelineOf(entries);
window.kameTimeline = model;
const container = document.getElementById("timeline");
container.before(legend());
renderTimeline(container, model, {{ pxPerSecond: {PX_PER_SECOND} }});
</script>
</body>
</html>
"""


def write_timeline(folder: Path, out: Path) -> Path:
    out.write_text(timeline_html(folder.name, timeline_entries(folder)))
    return out
