"""A phone call is a GPT-Live session in every other way: the session id the server logs when the call starts
is the one a sideband attaches to (the openai SDK's `client.live.sideband.connect`), the sideband sees the
caller's keypad as GPT-Live's `transport.dtmf.received` (typed by the SDK), and the recording keeps it."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest

from .phone_caller import Caller, TwilioWire
from .server_harness import running_server, wait_until
from .test_live import sdk
from .test_live_sideband import SIDEBAND_EVENT
from .test_realtime import Events

pytestmark = pytest.mark.slow


def test_a_sideband_attaches_to_a_call_by_the_logged_id_and_sees_its_digits(tmp_path, caplog):
    async def go(url: str):
        async with Caller.dial(f"{url}/twilio/media", TwilioWire()) as caller:
            await wait_until(lambda: logged(caplog), "the call's session in the log", 20)
            session_id = logged(caplog)
            client = sdk(url)
            async with client.live.sideband.connect(session_id=session_id) as band:
                side = Events(band, SIDEBAND_EVENT)
                replayed = await side.type("session.started")
                await caller.press("4")
                await caller.press("#")
                await side.wait_for(lambda e: len(side.of("transport.dtmf.received")) >= 2, 10, "the digits")
                side.close()
            await caller.hang_up()
            await client.close()
        return session_id, replayed, side

    with caplog.at_level(logging.INFO, logger="server.phone"), \
            running_server(asr="none", record_dir=tmp_path) as (url, _):
        session_id, replayed, side = asyncio.run(go(url))
    assert replayed["session"]["id"] == session_id
    assert [e["event"] for e in side.of("transport.dtmf.received")] == ["4", "#"]
    recorded = [json.loads(line) for line in (tmp_path / session_id / "events.jsonl").read_text().splitlines()]
    digits = [r["live"]["event"] for r in recorded if r.get("live", {}).get("type") == "transport.dtmf.received"]
    assert digits == ["4", "#"]


def logged(caplog) -> str | None:
    """The session id of `twilio call CA... (stream MZ...): live session <id>`."""
    found = [re.search(r"live session (\S+)$", r.getMessage()) for r in caplog.records]
    return next((m.group(1) for m in found if m), None)
