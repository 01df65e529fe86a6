"""Twilio phone calls end to end, on the real server on loopback (tiny-copy, Whisper tiny.en, a scripted LLM),
with a carrier-side caller written from Twilio's message reference (tests/phone_caller.py): the signed voice
webhook's TwiML, the stream that opens once with its token, a spoken question heard by the LLM, the answer
paced back (the caller's lead never above 200 ms), a clear when the caller talks over it, a keypad digit
at the LLM, and a hang-up that frees the slot at once; beside it, calls sending garbage and a flood, which
neither end the server nor hurt the call. What is promised about time is proven on the manual clock in
tests/test_phone_carrier.py; here the real-time runs are few and short."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from pathlib import Path
from urllib.parse import urlencode, urlsplit, urlunsplit

import httpx
import numpy as np
import pytest
from websockets.exceptions import InvalidStatus

from kame.testing.openai_server import ScriptedOpenAIServer, ScriptedReply

from .conftest import words
from .phone_caller import Caller, LineFormat, Playout, TwilioWire, read_wav, stream_of, twilio_signature
from .server_harness import running_server, wait_until

TOKEN = "twilio-auth-token-of-the-tests"
FIXTURES = Path(__file__).parent / "fixtures"
INSTRUCTIONS = "You answer the phone for the tests."
LONG_ANSWER = ("Paris is the capital of France. It is famous for the Eiffel Tower, the Louvre and its museums, the "
               "cafes along its wide boulevards, the bridges over the river Seine, and a history of art, fashion "
               "and food that goes back more than two thousand years.")
SPIDER = "How many legs does a spider have?"
LEAD_TARGET_S = 0.2  # issue 54: the audio buffered at the carrier never above this


def phone_answer(body: dict) -> ScriptedReply:
    """The scripted LLM: a long answer about France (time to talk over it), a short one about spiders and digits."""
    last = " ".join(words(body["messages"][-1]["content"].split("\n")[-1]))
    if "pressed" in last:
        return ScriptedReply(text="You pressed one.")
    if "spider" in last or "legs" in last:
        return ScriptedReply(text="Spiders have eight legs.")
    if "france" in last:
        return ScriptedReply(text=LONG_ANSWER)
    return ScriptedReply(text="Let me think.")


@pytest.fixture(scope="module")
def phone_llm():
    server = ScriptedOpenAIServer(phone_answer)
    server.start_in_thread()
    yield server
    server.stop_thread()


@pytest.fixture(scope="module")
def phone_server(phone_llm):
    """The server a Twilio number points at: Whisper, the scripted LLM, three slots, Twilio's auth token set."""
    from server.settings import ProfileSettings

    profiles = {"scripted": ProfileSettings(base_url=phone_llm.base_url, model="scripted", api_key_env=None)}
    with running_server(asr="whisper", max_sessions=3, profiles=profiles, llm="scripted",
                        phone={"twilio_auth_token": TOKEN}) as (url, services):
        yield url.replace("ws://", "http://"), services


# -------------------------------------------------------------------- Twilio's side of a call


def call_form(call_sid: str | None = None) -> dict[str, str]:
    """What Twilio posts to a number's voice URL when a call comes in (the parameters that matter here)."""
    return {"CallSid": call_sid or "CA" + uuid.uuid4().hex, "AccountSid": "AC" + uuid.uuid4().hex,
            "From": "+15551230001", "To": "+15557650002", "CallStatus": "ringing", "Direction": "inbound"}


async def webhook(http: httpx.AsyncClient, base: str, form: dict, query: str = "", signed_as: str | None = None,
                  token: str = TOKEN, headers: dict | None = None) -> httpx.Response:
    """POST the voice webhook as Twilio does, signed for `signed_as` (the URL Twilio requested; by default the
    one posted to)."""
    url = f"{base}/twilio/voice" + (f"?{query}" if query else "")
    signature = twilio_signature(token, signed_as or url, form)
    return await http.post(url, data=form, headers={"X-Twilio-Signature": signature, **(headers or {})})


async def answered_call(http: httpx.AsyncClient, base: str, query: str = "") -> tuple[str, dict, TwilioWire]:
    """A call's webhook answered: its Stream URL, the stream's parameters, the carrier's wire for the call."""
    form = call_form()
    reply = await webhook(http, base, form, query)
    assert reply.status_code == 200, reply.text
    url, parameters = stream_of(reply.text)
    return url, parameters, TwilioWire(form["CallSid"])


HANDSET_ECHO = (-35.0, 0.12)  # a handset's loudspeaker back in its mouthpiece: 35 dB down, 120 ms later


def asked(llm: ScriptedOpenAIServer, phrase: str) -> list[str]:
    """The user lines the LLM was asked about that hold `phrase`'s words."""
    wanted = " ".join(words(phrase))
    lines = [body["messages"][-1]["content"].split("\n")[-1] for body in list(llm.requests)]
    return [line for line in lines if wanted in " ".join(words(line))]


def last_asked(llm: ScriptedOpenAIServer) -> str:
    """The user line of the LLM's last request."""
    requests = list(llm.requests)
    return requests[-1]["messages"][-1]["content"].split("\n")[-1] if requests else ""


def speech(path: Path) -> tuple[np.ndarray, int]:
    pcm, rate = read_wav(path)
    return np.concatenate([pcm, np.zeros(rate // 4, np.float32)]), rate


@pytest.fixture(scope="module")
def spider_speech(tmp_path_factory) -> tuple[np.ndarray, int]:
    """The interruption, spoken by piper at its own rate (not resampled by the project)."""
    from kame.testing.speech import cached_path, synthesize_wav

    path = cached_path(SPIDER, tmp_path_factory.mktemp("tts"))
    return speech(synthesize_wav(SPIDER, path))


# -------------------------------------------------------------------- the caller's own playout


def test_the_callers_playout_plays_back_to_back_and_acknowledges_marks_as_they_play():
    """The reference the end-to-end test measures with: audio plays back to back from its arrival, a mark is
    due when the audio before it has played, a clear hands back every pending mark and drops the unplayed."""
    line = LineFormat("pcmu", 8000)
    playout = Playout(line)
    frame = b"\x01" * 640  # 80 ms
    playout.push(frame, 10.0)
    playout.mark("1", 10.0)
    playout.push(frame, 10.02)  # queued behind the first: plays 10.08-10.16
    playout.mark("2", 10.02)
    assert playout.lead(10.02) == pytest.approx(0.14)
    assert playout.due(10.079) == [] and playout.due(10.08) == ["1"]
    assert playout.next_due() == pytest.approx(10.16)
    assert playout.clear(10.12) == ["2"] and playout.lead(10.12) == 0.0
    assert playout.heard(11.0) == frame + b"\x01" * 320  # the second frame stopped half way
    playout.push(frame, 12.0)  # after a gap: from its arrival
    assert playout.lead(12.0) == pytest.approx(0.08) and len(playout.heard(12.04)) == 640 + 320 + 320
    # what the loudspeaker played over a stretch of time (a handset's echo is made of it): silence in the gap
    tone = line.encode(np.full(160, 0.5, np.float32))  # 20 ms
    playout.push(tone, 13.0)
    played = playout.playing(12.99, 13.03)
    assert len(played) == 320 and not played[:80].any() and not played[240:].any()
    assert np.allclose(played[80:240], line.decode(tone))


# -------------------------------------------------------------------- the call, end to end


GARBAGE: list[str | bytes] = [
    "{not json", json.dumps({"event": "hangup"}), "[" * 50_000, "x" * 100_000, b"\x00\x01 a binary frame",
    json.dumps({"event": "media", "media": {"payload": "not base64!"}}),
    json.dumps({"event": "media", "media": {"payload": "/" * 12_000}}),  # 9000 bytes of audio: over the limit
    json.dumps({"event": "mark", "mark": {}}), json.dumps({"event": "dtmf", "dtmf": {"digit": "x"}}),
]


async def garbage_call(http: httpx.AsyncClient, base: str) -> dict:
    """Media before the start, then every kind of bad message: the call goes on (audio keeps coming), and
    ends normally when the caller hangs up."""
    url, parameters, wire = await answered_call(http, base)
    async with Caller.dial(url, wire, parameters, greet=False) as caller:  # its audio starts before the start
        await asyncio.sleep(0.2)
        for message in wire.opening(parameters):
            await caller.send(message)
        for message in GARBAGE:
            await caller.send(message)
        after_garbage = caller.frames_heard
        await wait_until(lambda: caller.frames_heard >= after_garbage + 20, "the call's audio after the garbage", 20)
        closed = await caller.hang_up()
    return {"closed": closed, "faults": caller.faults}


async def flood_call(http: httpx.AsyncClient, base: str) -> dict:
    """Media far faster than a carrier sends it: the runner's flood limit closes the stream."""
    url, parameters, wire = await answered_call(http, base)
    silence = wire.format.encode(np.zeros(160, np.float32))
    async with Caller.dial(url, wire, parameters) as caller:
        start = time.monotonic()
        while caller.closed is None and time.monotonic() - start < 15:
            for _ in range(8):  # 400 messages a second (and the caller's own 50)
                for message in wire.media(silence):
                    await caller.send(message)
            await asyncio.sleep(0.02)
        return {"closed": caller.closed, "after_s": time.monotonic() - start}


async def main_call(http: httpx.AsyncClient, base: str, llm: ScriptedOpenAIServer, services, question,
                    interruption) -> dict:
    """The question, the answer played, an interruption over it, a digit, the hang-up."""
    url, parameters, wire = await answered_call(http, base, urlencode({"instructions": INSTRUCTIONS}))
    runner = services.runtime.runner
    # a handset's faint echo: with none at all (a headset), the server's echo canceller holds back words said
    # over the assistant until it has learned there is no echo (docs/echo.md), and the interruption is lost
    async with Caller.dial(url, wire, parameters, echo=HANDSET_ECHO) as caller:
        await asyncio.sleep(0.3)
        await caller.say(*question)
        await wait_until(lambda: asked(llm, "capital of France"), "the question's words at the LLM", 30)
        await asyncio.sleep(1.5)  # the long answer is playing
        interrupted_at = caller.now()
        said = caller.say(*interruption)
        await wait_until(lambda: any(t >= interrupted_at for t in caller.clears), "a clear after the interruption", 20)
        await said
        # (Whisper tiny hears the phone band's "spider" as "fighter" at times: the question is the legs)
        await wait_until(lambda: asked(llm, "how many legs"), "the interruption at the LLM", 30,
                         lambda: f"; the LLM was last asked {last_asked(llm)!r}")
        await asyncio.sleep(0.5)
        await caller.press("1")
        await wait_until(lambda: asked(llm, "The caller pressed 1 on the keypad."), "the digit at the LLM", 10)
        busy = runner.free_slots
        stopped = time.monotonic()
        closed = await caller.hang_up()
        closed_after = time.monotonic() - stopped
        await wait_until(lambda: runner.free_slots > busy, "the call's slot back", 10)
        freed_after = time.monotonic() - stopped
    return {"caller": caller, "closed": closed, "closed_after_s": closed_after, "freed_after_s": freed_after,
            "interrupted_at": interrupted_at}


@pytest.mark.realtime
@pytest.mark.slow
def test_a_twilio_call_end_to_end_beside_calls_that_misbehave(phone_server, phone_llm, spider_speech, caplog):
    base, services = phone_server
    phone_llm.requests.clear()
    question = speech(FIXTURES / "question.wav")

    async def scenario():
        async with httpx.AsyncClient() as http:
            return await asyncio.gather(main_call(http, base, phone_llm, services, question, spider_speech),
                                        garbage_call(http, base), flood_call(http, base))

    with caplog.at_level(logging.INFO, logger="server"):
        main, garbage, flood = asyncio.run(scenario())
    caller = main["caller"]

    # the question reached the LLM, with the call's instructions (a <Parameter> of the TwiML)
    assert asked(phone_llm, "capital of France")
    assert any(INSTRUCTIONS in body["messages"][0]["content"] for body in phone_llm.requests)
    # the answer came back paced: never more than LEAD_TARGET_S buffered at the carrier, and it kept coming
    assert caller.faults == []
    assert caller.frames_heard > 50 and caller.max_lead <= LEAD_TARGET_S, caller.max_lead
    # talked over, the assistant's audio was cleared; the digit reached the LLM as the caller's words
    assert [t for t in caller.clears if t >= main["interrupted_at"]]
    assert asked(phone_llm, "The caller pressed 1 on the keypad.")
    # stop: the server closes at once and the slot is free again
    assert main["closed"][0] == 1000 and main["closed_after_s"] < 2.0, main
    assert main["freed_after_s"] < 5.0, main
    # the calls beside it: garbage is logged and the call goes on to a normal end; the flood is closed
    assert garbage["closed"][0] == 1000 and garbage["faults"] == [], garbage
    assert flood["closed"][0] == 1008 and "messages/s" in flood["closed"][1], flood
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records
                                                                           if r.levelno >= logging.ERROR]
    runner = services.runtime.runner
    assert runner.free_slots == services.runtime.engine.batch_size


# -------------------------------------------------------------------- admission: the webhook and the stream


def run(coro_fn):
    async def go():
        async with httpx.AsyncClient() as http:
            return await coro_fn(http)
    return asyncio.run(go())


def test_a_webhook_without_twilios_signature_gets_403_and_no_twiml(phone_server):
    base, services = phone_server
    form = call_form()
    url = f"{base}/twilio/voice"

    async def go(http):
        return [await http.post(url, data=form),  # no signature
                await webhook(http, base, form, token="another account's auth token"),
                await http.post(url, data=form | {"From": "+15550000000"},  # a parameter changed after signing
                                headers={"X-Twilio-Signature": twilio_signature(TOKEN, url, form)}),
                await webhook(http, base, form, signed_as=f"{base}/elsewhere")]  # signed for another URL

    replies = run(go)
    assert [r.status_code for r in replies] == [403] * 4
    assert not any("Stream" in r.text or "stream_token" in r.text for r in replies)


def test_the_twiml_streams_back_by_the_host_and_scheme_the_call_came_with_its_parameters(phone_server):
    base, services = phone_server
    form = call_form()
    query = urlencode({"instructions": "Be brief.", "llm": "scripted", "voice": "marin", "keypad": "off",
                       "other": "not passed on"})
    proxied = "https://voice.example.com/twilio/voice?" + query  # what Twilio requested, through a TLS proxy

    async def go(http):
        return (await webhook(http, base, form, query),
                await webhook(http, base, form, query, signed_as=proxied,
                              headers={"Host": "voice.example.com", "X-Forwarded-Proto": "https"}))

    direct, behind = run(go)
    assert direct.status_code == 200 and direct.headers["content-type"].startswith("application/xml")
    url, parameters = stream_of(direct.text)
    assert url.startswith(f"{base.replace('http://', 'ws://')}/twilio/media?stream_token=")
    assert parameters == {"CallSid": form["CallSid"], "From": form["From"], "To": form["To"],
                          "instructions": "Be brief.", "llm": "scripted", "voice": "marin", "keypad": "off"}
    assert behind.status_code == 200, behind.text
    assert stream_of(behind.text)[0].startswith("wss://voice.example.com/twilio/media?stream_token=")


@pytest.mark.slow
def test_a_stream_opens_only_with_its_token_once_for_its_call(phone_server):
    base, services = phone_server

    async def refused(url: str) -> int:
        with pytest.raises(InvalidStatus) as refusal:
            async with Caller.dial(url, TwilioWire()):
                pass
        return refusal.value.response.status_code

    async def go(http):
        url, parameters, wire = await answered_call(http, base)
        scheme, netloc, path, query, _ = urlsplit(url)
        statuses = [await refused(urlunsplit((scheme, netloc, path, "", ""))),
                    await refused(url[:-3] + ("AAA" if not url.endswith("AAA") else "BBB"))]  # forged
        async with Caller.dial(url, TwilioWire("CA" + uuid.uuid4().hex), parameters) as other:  # another call's start
            await wait_until(lambda: other.closed is not None, "the stream's close", 10)
        statuses.append(await refused(url))  # the token again: used
        url, parameters, wire = await answered_call(http, base)
        async with Caller.dial(url, wire, parameters) as caller:
            await wait_until(lambda: caller.frames_heard >= 3, "the call's audio", 20)
            closed = await caller.hang_up()
        return statuses, other.closed, closed

    statuses, other, closed = run(go)
    assert statuses == [403, 403, 403]
    assert other[0] == 1008 and "another call" in other[1]
    assert closed[0] == 1000


@pytest.mark.slow
def test_a_call_beyond_capacity_hears_busy_and_takes_no_slot(phone_server):
    base, services = phone_server
    runner, slots = services.runtime.runner, services.runtime.engine.batch_size

    async def go(http):
        answered = [await answered_call(http, base) for _ in range(slots + 1)]
        held = []
        async with contextlib.AsyncExitStack() as stack:
            for url, parameters, wire in answered[:slots]:  # each stream holds a slot from its opening
                held.append(await stack.enter_async_context(Caller.dial(url, wire, parameters)))
            await wait_until(lambda: runner.free_slots == 0, "every slot taken", 10)
            busy = await webhook(http, base, call_form())
            url, parameters, wire = answered[-1]
            with pytest.raises(InvalidStatus) as late:  # a stream of an earlier TwiML finds no slot either
                async with Caller.dial(url, wire, parameters):
                    pass
        await wait_until(lambda: runner.free_slots == slots, "the slots back", 15)
        return busy, late.value.response.status_code

    busy, late = run(go)
    assert busy.status_code == 200
    assert busy.text.endswith('<Response><Reject reason="busy"/></Response>') and "Stream" not in busy.text
    assert late == 503


@pytest.mark.slow
def test_off_loopback_the_twilio_routes_are_off_until_twilios_auth_token_is_set(caplog):
    """A server reachable from the network without the token: both routes 403, and the start-up log says why.
    With it, they are on, and the configured public URL (a proxy's, with its path) is what the signature
    covers and what the Stream URL names."""
    form, public = call_form(), "https://voice.example.com/kame"

    async def dial(url: str) -> int:
        with pytest.raises(InvalidStatus) as refusal:
            async with Caller.dial(url, TwilioWire()):
                pass
        return refusal.value.response.status_code

    with caplog.at_level(logging.INFO, logger="server.app"):
        with running_server(host="0.0.0.0", auth_tokens=["the-api-key"], asr="none") as (url, _):
            base = url.replace("ws://", "http://")
            voice = httpx.post(f"{base}/twilio/voice", data=form,
                               headers={"X-Twilio-Signature": twilio_signature(TOKEN, f"{base}/twilio/voice", form)})
            media = asyncio.run(dial(f"{url}/twilio/media"))
        with running_server(host="0.0.0.0", auth_tokens=["the-api-key"], asr="none",
                            phone={"twilio_auth_token": TOKEN, "public_url": public}) as (url, _):
            on = run(lambda http: webhook(http, url.replace("ws://", "http://"), form,
                                          signed_as=f"{public}/twilio/voice"))
    assert voice.status_code == 403 and "twilio_auth_token" in voice.text and media == 403
    said = [r.getMessage() for r in caplog.records if r.name == "server.app"
            and r.getMessage().startswith(("the twilio routes", "phone calls: a Twilio"))]  # at start-up
    assert len(said) == 2 and "twilio routes are off" in said[0] and "0.0.0.0" in said[0], said
    assert "voice.example.com/kame/twilio/voice" in said[1], said
    assert on.status_code == 200, on.text
    assert stream_of(on.text)[0].startswith("wss://voice.example.com/kame/twilio/media?stream_token=")
