"""/v1/live/sessions end to end: the real `openai` SDK's GPT-Live client (`client.live.connect()`)
against the real server on loopback (tiny-copy, Whisper tiny.en, the scripted LLM), a spoken
question streamed at real-time pace, in both delegation modes. Every server event is validated by
the SDK's own `ServerEvent` union."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
from openai import AsyncOpenAI
from openai.types.live import ServerEvent
from pydantic import TypeAdapter

from client.client import send_paced
from kame.pcm import pcm16_encode

from .conftest import words
from .test_realtime import Events, question_audio

pytestmark = pytest.mark.slow
LIVE_EVENT = TypeAdapter(ServerEvent)
COMMENTARY = "Zebras sing in Oslo."  # words the scripted LLM never says: only the client's commentary has them


def sdk(url: str, key: str = "kame-test") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url.replace("ws://", "http://") + "/v1", api_key=key)


async def stream(conn, pcm: np.ndarray) -> None:
    async def append(chunk: np.ndarray) -> None:
        await conn.session.input_audio.append(audio=base64.b64encode(pcm16_encode(chunk)).decode())

    await send_paced(append, pcm)


def said(events: Events, kind: str) -> list[str]:
    return words("".join(e["delta"] for e in events.of(kind)))


def test_responses_delegation_the_planner_answers_as_delegations(tandem_server, voices):
    url, services = tandem_server
    delegations = services.metrics.delegations.labels("responses")
    before = delegations._value.get()

    async def go():
        async with sdk(url).live.connect() as conn:
            events = Events(conn, LIVE_EVENT)
            await conn.session.start(session={"model": "gpt-live-1", "delegation": {
                "type": "responses", "responses": {"model": "scripted"}}}, event_id="start")
            started = await events.type("session.started")
            speaking = asyncio.ensure_future(stream(conn, question_audio(voices)))
            await events.wait_for(lambda e: "paris" in said(events, "session.output_transcript.delta"), 25,
                                  "the answer in the output transcript")
            await events.wait_for(lambda e: "france" in said(events, "session.input_transcript.delta"), 15,
                                  "the whole question in the input transcript")
            await conn.session.close(event_id="bye")
            closed = await events.type("session.closed", 10)
            speaking.cancel()
            events.close()
            return started, closed, events

    started, closed, events = asyncio.run(go())
    assert events.got[0]["type"] == "session.started" and started["client_event_id"] == "start"
    assert started["session"]["delegation"]["responses"]["model"] == "scripted"
    assert {"capital", "france"} <= set(said(events, "session.input_transcript.delta"))
    created = events.of("session.delegation.created")
    assert created and all(c["delegation"]["target"] == "responses" for c in created)
    completed = [e["event"] for e in events.of("response.event") if e["event"]["type"] == "response.completed"]
    assert any("paris" in words(r["response"]["output"][0]["content"][0]["text"]) for r in completed
               if r["response"]["output"])
    assert len(events.of("session.output_audio.delta")) > 20  # the front-end speaks continuously
    assert closed["reason"] == "close_requested" and closed["client_event_id"] == "bye"
    assert not [e for e in events.got if e["type"].startswith("kame.") or e["type"] == "error"]
    assert delegations._value.get() - before == len(created)  # kame_live_delegations_total{target="responses"}
    assert b'kame_transport_sessions_total{transport="live"}' in services.metrics.render()


def test_client_delegation_the_front_end_says_the_clients_commentary(tandem_server, voices):
    url, _ = tandem_server

    async def go():
        async with sdk(url).live.connect() as conn:
            events = Events(conn, LIVE_EVENT)
            await conn.session.start(session={"model": "gpt-live-1", "delegation": {"type": "client"}})
            await events.type("session.started")
            speaking = asyncio.ensure_future(stream(conn, question_audio(voices)))
            delegation = await events.type("session.delegation.created", 20)
            await conn.session.commentary.append(delegation_id=delegation["delegation"]["id"], content=COMMENTARY,
                                                 event_id="c1")
            ack = await events.type("session.commentary.appended")
            await events.wait_for(lambda e: "zebras" in said(events, "session.output_transcript.delta"), 20,
                                  "the commentary in the output transcript")
            speaking.cancel()
            events.close()
            return delegation, ack, events

    delegation, ack, events = asyncio.run(go())
    assert delegation["delegation"]["target"] == "client" and "response_id" not in delegation["delegation"]
    assert delegation["offset_ms"] > 0 and ack["client_event_id"] == "c1"
    assert "paris" not in said(events, "session.output_transcript.delta")  # no LLM was called
    assert not events.of("response.event") and not events.of("error")


def test_bad_events_get_the_protocols_errors_and_the_session_goes_on(tandem_server):
    url, _ = tandem_server

    async def go():
        async with sdk(url).live.connect() as conn:
            events = Events(conn, LIVE_EVENT)
            await conn.session.input_audio.mute(event_id="early")
            early = await events.type("error")
            await conn.send_raw('{"type": "session.start", "session": {"model": "gpt-live-1", "colour": "red"}}')
            unknown = await events.wait_for(lambda e: e["type"] == "error" and e is not early, 10, "a second error")
            await conn.session.start(session={"model": "gpt-live-1"})
            await events.type("session.started")
            await conn.send_raw("not json")
            await conn.session.input_audio.append(audio=base64.b64encode(b"odd").decode())
            await conn.session.input_audio.mute(event_id="m")
            muted = await events.type("session.input_audio.muted")
            events.close()
            return early, unknown, muted, events

    early, unknown, muted, events = asyncio.run(go())
    assert early["error"]["code"] == "session_not_started" and early["error"]["client_event_id"] == "early"
    assert unknown["error"] == {"type": "invalid_request_error", "code": "unknown_parameter",
                                "message": "Unknown parameter: 'session.colour'.", "param": "session.colour"}
    codes = [e["error"]["code"] for e in events.of("error")]
    assert codes == ["session_not_started", "unknown_parameter", "invalid_json", "invalid_audio"]
    assert muted["client_event_id"] == "m"
