"""/v1/realtime end to end: the real `openai` SDK against the real server on loopback (tiny-copy,
Whisper tiny.en, the scripted LLM), a spoken question streamed at real-time pace."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time

import numpy as np
import pytest
from openai import AsyncOpenAI
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter
from websockets.exceptions import InvalidStatus

from client.client import send_paced
from kame.audio import SAMPLE_RATE
from kame.pcm import TELEPHONE_RATE, Resampler, pcm16_decode, pcm16_encode, ulaw_decode, ulaw_encode

from .conftest import words
from .server_harness import running_server, wait_until_all_slots_free

pytestmark = pytest.mark.slow
SERVER_EVENT = TypeAdapter(RealtimeServerEvent)
INSTRUCTIONS = "You are the test's assistant. Answer in one short sentence."


def sdk(url: str, key: str = "kame-test") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url.replace("ws://", "http://") + "/v1", api_key=key)


class Events:
    """Every server event of a connection, as JSON, read in the background; all but KAME's own
    checked against the SDK's types (`schema`: the Realtime API's, or GPT-Live's)."""

    def __init__(self, conn, schema: TypeAdapter = SERVER_EVENT) -> None:
        self.conn, self.schema, self.got, self.arrived = conn, schema, [], []
        self._new = asyncio.Event()
        self._task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        while True:
            raw = json.loads(await self.conn.recv_bytes())
            if not raw["type"].startswith("kame."):
                self.schema.validate_python(raw)  # the SDK's models accept it as it is
            self.got.append(raw)
            self.arrived.append(time.monotonic())
            self._new.set()

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.got if e["type"] == kind]

    async def wait_for(self, predicate, limit_s: float, what: str) -> dict:
        deadline = time.monotonic() + limit_s
        seen = 0
        while True:
            for event in self.got[seen:]:
                if predicate(event):
                    return event
            seen = len(self.got)
            if self._task.done():
                self._task.result()  # the reader's error (a malformed event), or the socket closed
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {what} within {limit_s} s; got {[e['type'] for e in self.got]}")
            self._new.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._new.wait(), remaining)

    async def type(self, kind: str, limit_s: float = 10.0) -> dict:
        return await self.wait_for(lambda e: e["type"] == kind, limit_s, kind)

    def close(self) -> None:
        self._task.cancel()


async def stream(conn, pcm: np.ndarray, encode=pcm16_encode) -> None:
    """`pcm` (24 kHz) in 80 ms appends at real-time pace, on an absolute schedule."""
    async def append(chunk: np.ndarray) -> None:
        await conn.input_audio_buffer.append(audio=base64.b64encode(encode(chunk)).decode())

    await send_paced(append, pcm)


def question_audio(voices) -> np.ndarray:
    return np.concatenate([np.zeros(12000, np.float32), voices["france"], np.zeros(24000 * 4, np.float32)])


def answered(events: Events):
    """A response.done whose transcript speaks the scripted answer."""
    def done(event: dict) -> bool:
        if event["type"] != "response.done" or not event["response"]["output"]:
            return False
        content = event["response"]["output"][0]["content"][0]
        return "paris" in words(content.get("transcript") or content.get("text") or "")
    return done


def test_the_openai_sdk_talks_to_kame(tandem_server, scripted_llm, voices):
    url, services = tandem_server

    async def go():
        async with sdk(url).realtime.connect(model="kame") as conn:
            events = Events(conn)
            created = await events.type("session.created")
            await conn.session.update(session={"type": "realtime", "instructions": INSTRUCTIONS,
                                               "kame": {"events": True}})
            updated = await events.type("session.updated")
            speaking = asyncio.ensure_future(stream(conn, question_audio(voices)))
            # the answer may be spoken before the user's final transcript: the LLM starts on partials
            done = await events.wait_for(answered(events), 25, "a response speaking the answer")
            await events.type("conversation.item.input_audio_transcription.completed", 15)
            speaking.cancel()
            events.close()
            return created, updated, done, events

    created, updated, done, events = asyncio.run(go())
    assert created["session"]["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert updated["session"]["instructions"] == INSTRUCTIONS
    assert any(r["messages"][0]["content"] == INSTRUCTIONS for r in scripted_llm.requests)  # reached the LLM

    # the user's side: speech started, transcription deltas, stopped, committed, the completed transcript
    started = events.of("input_audio_buffer.speech_started")[0]
    deltas = [e for e in events.of("conversation.item.input_audio_transcription.delta")
              if e["item_id"] == started["item_id"]]
    completed = next(e for e in events.of("conversation.item.input_audio_transcription.completed")
                     if e["item_id"] == started["item_id"])
    assert deltas and words("".join(d["delta"] for d in deltas))[:3] == ["what", "is", "the"]
    heard = " ".join(e["transcript"] for e in events.of("conversation.item.input_audio_transcription.completed"))
    assert words(heard)[:6] == words("What is the capital of France")  # in one utterance or split at a pause
    assert words(completed["transcript"])[:3] == ["what", "is", "the"]
    assert any(e["item_id"] == started["item_id"] for e in events.of("input_audio_buffer.speech_stopped"))
    assert any(e["item_id"] == started["item_id"] for e in events.of("input_audio_buffer.committed"))
    assert 200 <= started["audio_start_ms"] <= 1500  # the question starts 0.5 s into the audio

    # the assistant's side: one response, its audio at 24 kHz PCM16 in 80 ms deltas, at real-time pace
    response_id = done["response"]["id"]
    assert done["response"]["status"] == "completed"
    assert any(e["response"]["id"] == response_id for e in events.of("response.created"))
    audio = [(e, t) for e, t in zip(events.got, events.arrived, strict=True)
             if e["type"] == "response.output_audio.delta" and e["response_id"] == response_id]
    chunks = [base64.b64decode(e["delta"]) for e, _ in audio]
    assert len(chunks) >= 5 and all(len(c) == 1920 * 2 for c in chunks)  # one 80 ms frame each
    span = audio[-1][1] - audio[0][1]
    assert span >= 0.5 * (len(chunks) - 1) * 0.08  # it came at the pace it is played, not faster
    assert np.isfinite(np.concatenate([pcm16_decode(c) for c in chunks])).all()
    transcript = "".join(e["delta"] for e in events.of("response.output_audio_transcript.delta")
                         if e["response_id"] == response_id)
    # tiny-copy repeats its oracle: the answer (after "let me think", the reply to an early partial)
    assert " ".join(words("Paris is the capital of France")) in " ".join(words(transcript))
    spoken_done = next(e for e in events.of("response.output_audio_transcript.done") if e["response_id"] == response_id)
    assert words(spoken_done["transcript"]) == words(transcript)

    # the kame.* extension events came because the session asked for them
    assert events.of("kame.oracle") and events.of("kame.llm")
    wait_until_all_slots_free(services)


def test_telephone_audio_both_ways(tandem_server, voices):
    url, services = tandem_server
    downsample = Resampler(SAMPLE_RATE, TELEPHONE_RATE)

    def pcmu(chunk: np.ndarray) -> bytes:
        return ulaw_encode(downsample(chunk))

    async def go():
        async with sdk(url).realtime.connect(model="kame") as conn:
            events = Events(conn)
            await events.type("session.created")
            await conn.session.update(session={"type": "realtime", "audio": {
                "input": {"format": {"type": "audio/pcmu"}}, "output": {"format": {"type": "audio/pcmu"}}}})
            updated = await events.type("session.updated")
            speaking = asyncio.ensure_future(stream(conn, question_audio(voices), encode=pcmu))
            done = await events.wait_for(answered(events), 25, "a response speaking the answer")
            await events.type("conversation.item.input_audio_transcription.completed", 15)
            speaking.cancel()
            events.close()
            return updated, done, events

    updated, done, events = asyncio.run(go())
    assert updated["session"]["audio"]["output"]["format"] == {"type": "audio/pcmu"}
    heard = " ".join(e["transcript"] for e in events.of("conversation.item.input_audio_transcription.completed"))
    assert words(heard)[:6] == words("What is the capital of France")
    chunks = [base64.b64decode(e["delta"]) for e in events.of("response.output_audio.delta")
              if e["response_id"] == done["response"]["id"]]
    assert chunks and all(len(c) == 640 for c in chunks)  # 80 ms at 8 kHz, one byte a sample
    assert np.abs(ulaw_decode(b"".join(chunks))).max() > 0.01  # tiny-copy's noise, through G.711
    wait_until_all_slots_free(services)


def test_every_bad_event_gets_an_error_and_the_session_goes_on(tandem_server):
    url, services = tandem_server
    bad = [
        ({"type": "no.such.event"}, "unknown_event"),
        ({"type": "input_audio_buffer.append", "audio": "not base64!"}, "invalid_base64"),
        ({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x00" * 3).decode()}, "invalid_audio"),
        ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"format": {
            "type": "audio/pcm", "rate": 16000}}}}}, "invalid_value"),
        ({"type": "input_audio_buffer.append", "audio": "A" * (2 << 20)}, "event_too_large"),
        ({"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": "c",
                                                       "output": "{}"}}, "invalid_value"),  # no such call
        ({"type": "conversation.item.truncate", "item_id": "item_nope", "content_index": 0,
          "audio_end_ms": 10}, "item_truncate_invalid_item_id"),
        ({"type": "response.cancel"}, "response_cancel_not_active"),
    ]

    async def go():
        async with sdk(url).realtime.connect(model="kame") as conn:
            events = Events(conn)
            await events.type("session.created")
            errors = []
            for index, (event, code) in enumerate(bad):
                await conn.send(event | {"event_id": f"client_{index}"})
                await events.wait_for(lambda e, n=index + 1: len(events.of("error")) >= n, 10, f"the error of {code}")
                errors.append(events.of("error")[index]["error"])
            await conn._connection.send("{not json")  # what the SDK never sends: raw text
            unreadable = await events.wait_for(lambda e: e["type"] == "error" and e["error"]["code"] == "invalid_json",
                                               10, "invalid_json")
            errors.append(unreadable["error"])
            await conn.session.update(session={"type": "realtime", "instructions": "Still here."})
            still = await events.type("session.updated")
            events.close()
            return errors, still

    errors, still = asyncio.run(go())
    assert [e["code"] for e in errors] == [code for _, code in bad] + ["invalid_json"]
    # each names the event it answers, but the one too large to be read
    assert [e["event_id"] for e in errors[:len(bad)]] == [None if code == "event_too_large" else f"client_{i}"
                                                          for i, (_, code) in enumerate(bad)]
    assert all(e["type"] == "invalid_request_error" and e["message"] for e in errors)
    assert still["session"]["instructions"] == "Still here."
    wait_until_all_slots_free(services)


def test_a_full_server_and_a_wrong_token_are_refused_clearly():
    with running_server(asr="none", max_sessions=1, auth_tokens=["right-token"]) as (url, services):
        async def go():
            async with sdk(url, "right-token").realtime.connect(model="kame") as conn:
                first = json.loads(await conn.recv_bytes())
                with pytest.raises(InvalidStatus) as busy:
                    async with sdk(url, "right-token").realtime.connect(model="kame") as second:
                        await second.recv_bytes()
            with pytest.raises(InvalidStatus) as wrong:
                async with sdk(url, "wrong-token").realtime.connect(model="kame") as third:
                    await third.recv_bytes()
            return first, busy.value, wrong.value

        first, busy, wrong = asyncio.run(go())
        assert first["type"] == "session.created"
        assert busy.response.status_code == 503 and b"busy" in busy.response.body
        assert wrong.response.status_code == 401


def test_a_typed_question_is_answered_and_a_truncated_answer_is_what_the_llm_remembers(tandem_server, scripted_llm):
    """No audio from the client at all: the server feeds the front-end silence while it waits."""
    url, services = tandem_server

    async def go():
        async with sdk(url).realtime.connect(model="kame") as conn:
            events = Events(conn)
            await events.type("session.created")
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "What is the capital of France?"}]})
            added = await events.type("conversation.item.added")
            done = await events.wait_for(answered(events), 25, "a response speaking the answer")
            item = done["response"]["output"][0]
            await conn.conversation.item.truncate(item_id=item["id"], content_index=0, audio_end_ms=0)
            truncated = await events.type("conversation.item.truncated")
            asked = len(scripted_llm.requests)
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Thank you."}]})
            await events.wait_for(lambda e: len(scripted_llm.requests) > asked, 10, "the next LLM request")
            events.close()
            return added, item, truncated, scripted_llm.requests[asked]

    added, item, truncated, request = asyncio.run(go())
    assert added["item"]["role"] == "user" and added["item"]["content"][0]["text"] == "What is the capital of France?"
    assert truncated["item_id"] == item["id"] and truncated["audio_end_ms"] == 0
    transcript = request["messages"][-1]["content"]
    assert "user: What is the capital of France?" in transcript and "user: Thank you." in transcript
    said = item["content"][0]["transcript"]
    assert said and said not in transcript  # cut at 0 ms: the LLM is not told it was said
    wait_until_all_slots_free(services)
