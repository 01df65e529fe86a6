"""GPT-Live's sideband end to end: the openai SDK's `client.live.sideband.connect(session_id=...)`
attaches to a session another connection started, sees its replay, its events and its audio both
ways (timed), and steers it: the sideband's commentary for a client delegation is what the
front-end says. Every sideband event is validated by the SDK's `ConnectServerEvent` union."""

from __future__ import annotations

import asyncio
import base64

import pytest
from openai.types.live.connect_server_event import ConnectServerEvent
from pydantic import TypeAdapter
from websockets.exceptions import InvalidStatus

from .conftest import words
from .test_live import LIVE_EVENT, sdk, stream
from .test_realtime import Events, question_audio

pytestmark = pytest.mark.slow
SIDEBAND_EVENT = TypeAdapter(ConnectServerEvent)
STEERED = "Penguins juggle in Lima."


def test_a_sideband_watches_and_steers_a_session(tandem_server, voices):
    url, _ = tandem_server

    async def go():
        client = sdk(url)
        async with client.live.connect() as conn:
            primary = Events(conn, LIVE_EVENT)
            await conn.session.start(session={"model": "gpt-live-1", "delegation": {"type": "client"}})
            started = await primary.type("session.started")
            async with client.live.sideband.connect(session_id=started["session"]["id"]) as band:
                side = Events(band, SIDEBAND_EVENT)
                replayed = await side.type("session.started")
                speaking = asyncio.ensure_future(stream(conn, question_audio(voices)))
                delegation = await side.type("session.delegation.created", 20)
                await band.send({"type": "session.commentary.append", "event_id": "steer",
                                 "delegation_id": delegation["delegation"]["id"], "content": STEERED})
                await primary.wait_for(lambda e: "penguins" in words("".join(
                    x["delta"] for x in primary.of("session.output_transcript.delta"))), 20, "the steered words")
                await band.send({"type": "session.input_audio.append", "audio": "AAAA", "event_id": "nope"})
                refused = await side.type("error")
                # the primary stops speaking first: audio it sends into the closing session gets an
                # error of its own ("The session is closing."; seen once on a loaded machine)
                speaking.cancel()
                await asyncio.gather(speaking, return_exceptions=True)
                await band.send({"type": "session.close", "event_id": "bye"})
                closed = await primary.type("session.closed", 10)
                await side.type("session.closed", 10)
                side.close()
            primary.close()
            return started, replayed, refused, closed, primary, side

    started, replayed, refused, closed, primary, side = asyncio.run(go())
    assert replayed == started  # the replay holds the session's start
    reflected = side.of("session.input_audio.append")
    assert reflected and all("event_id" not in e for e in reflected)
    heard = sum(len(base64.b64decode(e["audio"])) for e in reflected) / 2 / 24000
    assert heard > 1  # seconds of the user's audio (PCM16 at 24 kHz) before the steered words came
    out = side.of("session.output_audio.delta")
    assert out and all(e["end_ms"] - e["start_ms"] == 80 for e in out)
    assert [e["start_ms"] for e in out] == sorted(e["start_ms"] for e in out)
    assert not primary.of("session.input_audio.append")  # reflections are the sideband's alone
    assert "start_ms" not in primary.of("session.output_audio.delta")[0]
    ack = next(e for e in side.of("session.commentary.appended") if e.get("client_event_id") == "steer")
    assert ack in primary.got  # the acknowledgement goes to both
    assert refused["error"]["client_event_id"] == "nope" and refused not in primary.got
    # no error reached the primary but, possibly, the closing session's refusal of audio of its own that
    # was still on its way when the sideband's close came (the two connections are not ordered)
    assert all(e["error"]["code"] == "session_closed" for e in primary.of("error")), primary.of("error")
    assert closed["reason"] == "close_requested" and closed["client_event_id"] == "bye"


def test_attaching_to_no_session_is_refused(tandem_server):
    url, _ = tandem_server

    async def go():
        async with sdk(url).live.sideband.connect(session_id="nosuchsession", max_retries=0) as band:
            await band.recv()

    with pytest.raises(InvalidStatus) as caught:
        asyncio.run(go())
    assert caught.value.response.status_code == 404
