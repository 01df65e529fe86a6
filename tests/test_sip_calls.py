"""SIP calls into `kame serve --sip`, with a real softphone (baresip) on loopback: it plays a spoken question as
its microphone and records what it hears. With no webhook a call from loopback is answered at once; with one,
the receiver verifies OpenAI's signed `realtime.call.incoming` with the openai SDK and accepts, rejects, refers or
hangs up through the SDK's own call-control methods pointed at KAME's base URL. A call beyond the slots hears
486 at once; an address not allowed, 403. The server: tiny-copy, Whisper tiny.en, a scripted LLM."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kame.testing.openai_server import ScriptedOpenAIServer
from server.settings import ProfileSettings

from .server_harness import running_server
from .sip_peers import Baresip, free_udp_tcp_port, require_baresip, write_wav_8k
from .test_phone_twilio_e2e import SPIDER, asked, phone_answer

SECRET = "whsec_" + "c2lwLXdlYmhvb2tzLW9mLXRoZS10ZXN0cw=="  # base64 of a test key
TOKEN = "sip-tests-server-token"

pytestmark = [pytest.mark.realtime, pytest.mark.slow]


@pytest.fixture(scope="module")
def sip_llm():
    server = ScriptedOpenAIServer(phone_answer)
    server.start_in_thread()
    yield server
    server.stop_thread()


@pytest.fixture(scope="module")
def question_wav(tmp_path_factory):
    """The question at 8 kHz (baresip's file source plays at the codec's rate), then 12 s of quiet: the end of
    the file would end baresip's call."""
    from kame.testing.speech import speech

    pcm = speech(SPIDER, tmp_path_factory.mktemp("tts"), sample_rate=8000)
    path = tmp_path_factory.mktemp("wav") / "question.wav"
    write_wav_8k(path, np.concatenate([np.zeros(4000, np.float32), pcm, np.zeros(8000 * 12, np.float32)]))
    return path


def sip_server(llm: ScriptedOpenAIServer, **sip):
    profiles = {"scripted": ProfileSettings(base_url=llm.base_url, model="scripted", api_key_env=None)}
    port = free_udp_tcp_port()
    return port, running_server(asr="whisper", max_sessions=sip.pop("max_sessions", 2), profiles=profiles,
                                llm="scripted", auth_tokens=[TOKEN],
                                sip={"listen": f"127.0.0.1:{port}", **sip})


def wait_until(predicate, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.05)


def free_slots(services) -> int:
    return services.runtime.runner.free_slots


def test_a_softphone_calls_the_server_with_no_webhook(sip_llm, question_wav, tmp_path):
    require_baresip()
    port, server = sip_server(sip_llm)
    with server as (_, services), Baresip(tmp_path / "alice", question_wav) as alice:
        slots = free_slots(services)
        alice.command("dial", f"sip:kame@127.0.0.1:{port}")
        alice.wait_for("CALL_ESTABLISHED")
        wait_until(lambda: free_slots(services) == slots - 1, "the call holds a slot")
        wait_until(lambda: asked(sip_llm, SPIDER), "the question reached the LLM", 40)
        time.sleep(2.0)  # the answer's audio plays to the caller
        alice.command("hangup")
        alice.wait_for("CALL_CLOSED")
        wait_until(lambda: free_slots(services) == slots, "the slot came back", 10)
    heard = alice.heard()
    assert len(heard) > 8000 * 3, len(heard)  # seconds of the call recorded at the caller ...
    assert float(np.sqrt(np.mean(heard ** 2))) > 1e-3  # ... not silence: the assistant's audio


class WebhookReceiver:
    """The application's side: a real HTTP server that takes OpenAI's webhook, verifies it with the SDK and
    then runs `act(event)` in a thread (the SDK's call control, back at KAME)."""

    def __init__(self, act, on: str = "realtime.call.incoming") -> None:
        self.act, self.on, self.events, self.errors = act, on, [], []
        self.sdk = openai.OpenAI(api_key="unused", webhook_secret=SECRET)
        app = Starlette(routes=[Route("/hook", self.hook, methods=["POST"])])
        self.port = free_udp_tcp_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="webhook-receiver", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def hook(self, request: Request) -> Response:
        body = await request.body()
        try:
            event = self.sdk.webhooks.unwrap(body, dict(request.headers))
        except Exception as exc:  # a bad signature: the test fails on `errors`
            self.errors.append(repr(exc))
            return Response(status_code=400)
        self.events.append(event)
        if event.type == self.on:
            threading.Thread(target=self._act, args=(event,), daemon=True).start()
        return Response(status_code=200)

    def _act(self, event) -> None:
        try:
            self.act(event)
        except Exception as exc:
            self.errors.append(repr(exc))

    def __enter__(self) -> WebhookReceiver:
        self.thread.start()
        wait_until(lambda: self.server.started, "the webhook receiver started", 10)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def kame_client(url: str) -> openai.OpenAI:
    """The openai SDK pointed at KAME: the application changes its base URL, nothing else."""
    return openai.OpenAI(api_key=TOKEN, base_url=url.replace("ws://", "http://") + "/v1")


def test_the_openai_sdk_accepts_a_call_from_the_webhook_and_hangs_it_up(sip_llm, question_wav, tmp_path):
    require_baresip()
    accepted: list[str] = []
    urls: list[str] = []

    def accept(event) -> None:
        kame_client(urls[0]).realtime.calls.accept(event.data.call_id, type="realtime", model="gpt-realtime",
                                                   instructions="You answer the phone for the tests.")
        accepted.append(event.data.call_id)

    with WebhookReceiver(accept) as receiver:
        port, server = sip_server(sip_llm, webhook_url=receiver.url, webhook_secret=SECRET)
        with server as (url, services), Baresip(tmp_path / "alice", question_wav) as alice:
            urls.append(url)
            alice.command("dial", f"sip:kame@127.0.0.1:{port}")
            alice.wait_for("CALL_RINGING")
            alice.wait_for("CALL_ESTABLISHED")
            wait_until(lambda: accepted, "the application accepted")
            live = next(e for e in receiver.events if e.type == "live.transport.incoming")
            call = next(e for e in receiver.events if e.type == "realtime.call.incoming")
            headers = {h.name: h.value for h in call.data.sip_headers}
            assert "alice" in headers["From"] and live.data.type == "sip"
            with pytest.raises(openai.ConflictError):  # the Live session's accept comes second: refused
                kame_client(url).live.sessions.accept(live.data.session_id, session={"model": "gpt-live",
                                                                                     "type": "live"})
            wait_until(lambda: asked(sip_llm, SPIDER), "the question reached the LLM", 40)
            kame_client(url).realtime.calls.hangup(accepted[0])
            alice.wait_for("CALL_CLOSED")
            wait_until(lambda: free_slots(services) == 2, "the slot came back", 10)
    assert not receiver.errors, receiver.errors


def test_reject_busy_and_addresses_not_allowed(sip_llm, question_wav, tmp_path):
    require_baresip()

    def reject(event) -> None:
        kame_client(urls[0]).realtime.calls.reject(event.data.call_id, status_code=486)

    urls: list[str] = []
    with WebhookReceiver(reject) as receiver:
        port, server = sip_server(sip_llm, webhook_url=receiver.url, webhook_secret=SECRET)
        with server as (url, _), Baresip(tmp_path / "alice", question_wav) as alice:
            urls.append(url)
            alice.command("dial", f"sip:kame@127.0.0.1:{port}")
            closed = alice.wait_for("CALL_CLOSED")
            assert "486" in closed.get("param", ""), closed
    assert not receiver.errors, receiver.errors
    port, server = sip_server(sip_llm, allow_from=["192.0.2.0/24"])  # not loopback
    with server, Baresip(tmp_path / "bob", question_wav) as bob:
        bob.command("dial", f"sip:kame@127.0.0.1:{port}")
        closed = bob.wait_for("CALL_CLOSED")
        assert "403" in closed.get("param", ""), closed


def test_a_call_beyond_the_slots_hears_busy_at_once(sip_llm, question_wav, tmp_path):
    require_baresip()
    port, server = sip_server(sip_llm, max_sessions=1)
    with server as (_, services), Baresip(tmp_path / "alice", question_wav) as alice, \
            Baresip(tmp_path / "bob", question_wav) as bob:
        alice.command("dial", f"sip:kame@127.0.0.1:{port}")
        alice.wait_for("CALL_ESTABLISHED")
        began = time.monotonic()
        bob.command("dial", f"sip:kame@127.0.0.1:{port}")
        closed = bob.wait_for("CALL_CLOSED")
        assert "486" in closed.get("param", ""), closed
        assert time.monotonic() - began < 5.0  # at once: nothing rang, nothing waited for a slot
        alice.command("hangup")
        alice.wait_for("CALL_CLOSED")
        wait_until(lambda: free_slots(services) == 1, "the slot came back", 10)



def test_an_outbound_call_through_a_trusted_trunk(sip_llm, question_wav, tmp_path):
    """GPT-Live's SIP transport: KAME dials baresip (the trunk and the callee at once), which answers on its own;
    its question reaches the LLM; the SDK's hangup ends the call at baresip. A trunk not trusted for plain SIP
    is refused before anything is dialled."""
    require_baresip()
    with Baresip(tmp_path / "alice", question_wav) as alice:
        port, server = sip_server(sip_llm, trusted_trunks=[f"127.0.0.1:{alice.port}"])
        with server as (url, services):
            http = url.replace("ws://", "http://")
            headers = {"Authorization": f"Bearer {TOKEN}"}

            def dial(provider_url: str) -> httpx.Response:
                return httpx.post(f"{http}/v1/live/sessions", headers=headers, timeout=40, json={
                    "session": {"model": "gpt-live", "type": "live", "instructions": "You call for the tests."},
                    "transport": {"type": "sip", "destination": "alice",
                                  "trunk": {"provider_url": provider_url, "caller_number": "+15550001111"}}})

            refused = dial("sip:192.0.2.77:5060")
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "trunk_not_trusted"
            reply = dial(f"sip:127.0.0.1:{alice.port}")
            assert reply.status_code == 200, reply.text
            session_id = reply.json()["session"]["id"]
            established = alice.wait_for("CALL_ESTABLISHED")
            assert established["direction"] == "incoming" and "+15550001111" in established["peeruri"]
            wait_until(lambda: asked(sip_llm, SPIDER), "the callee's question reached the LLM", 40)
            kame_client(url).live.sessions.hangup(session_id)
            alice.wait_for("CALL_CLOSED")
            wait_until(lambda: free_slots(services) == 2, "the slot came back", 10)


def test_digits_both_ways_and_a_transfer_over_gpt_live_call_control(sip_llm, question_wav, tmp_path):
    """GPT-Live's accept runs the call; its sideband (the SDK's live.sideband.connect) sees the digits baresip
    presses (RFC 4733) as transport.dtmf.received, and its transport.dtmf.send presses one at baresip
    (answered transport.dtmf.sent); refer sends baresip a REFER; hangup a BYE."""
    require_baresip()
    accepted: list[str] = []
    urls: list[str] = []

    def accept(event) -> None:  # the application answers with GPT-Live's accept
        kame_client(urls[0]).live.sessions.accept(event.data.session_id, session={"model": "gpt-live", "type": "live"})
        accepted.append(event.data.session_id)

    async def steer(url: str, session_id: str, alice: Baresip) -> dict:
        from .test_live import sdk
        from .test_live_sideband import SIDEBAND_EVENT
        from .test_realtime import Events

        client = sdk(url, TOKEN)
        async with client.live.sideband.connect(session_id=session_id) as band:
            side = Events(band, SIDEBAND_EVENT)
            alice.command("sndcode", "4")
            await asyncio.sleep(0.5)
            alice.command("sndcode", "#")
            await side.wait_for(lambda e: len(side.of("transport.dtmf.received")) >= 2, 15, "the caller's digits")
            await band.send({"type": "transport.dtmf.send", "event": "7", "event_id": "press-7"})
            sent = await side.wait_for(lambda e: e["type"] == "transport.dtmf.sent", 10, "transport.dtmf.sent")
            side.close()
        await client.close()
        return {"received": [e["event"] for e in side.of("transport.dtmf.received")], "sent": sent}

    with WebhookReceiver(accept, on="live.transport.incoming") as receiver:
        port, server = sip_server(sip_llm, webhook_url=receiver.url, webhook_secret=SECRET)
        with server as (url, services), Baresip(tmp_path / "alice", question_wav) as alice:
            urls.append(url)
            alice.command("dial", f"sip:kame@127.0.0.1:{port}")
            alice.wait_for("CALL_ESTABLISHED")
            wait_until(lambda: accepted, "the application accepted")
            with pytest.raises(openai.ConflictError):  # the Realtime accept comes second: refused
                call_id = next(e for e in receiver.events if e.type == "realtime.call.incoming").data.call_id
                kame_client(url).realtime.calls.accept(call_id, type="realtime", model="gpt-realtime")
            seen = asyncio.run(steer(url, accepted[0], alice))
            pressed = alice.wait_for("CALL_DTMF_START")
            kame_client(url).live.sessions.refer(accepted[0], target_uri="sip:bob@127.0.0.1:9")
            wait_until(lambda: any("TRANSFER" in kind for kind in alice.types()), "baresip saw the REFER", 10)
            kame_client(url).live.sessions.hangup(accepted[0])
            alice.wait_for("CALL_CLOSED")
            wait_until(lambda: free_slots(services) == 2, "the slot came back", 10)
    assert not receiver.errors, receiver.errors
    assert seen["received"] == ["4", "#"]
    assert seen["sent"]["event"] == "7" and seen["sent"]["client_event_id"] == "press-7"
    assert pressed["param"] == "7", pressed


def test_hold_keeps_a_call_whose_rtp_stops_and_a_lost_phone_or_the_session_limit_ends_it(sip_llm, question_wav,
                                                                                          tmp_path):
    """A re-INVITE puts the call on hold (no RTP, and no timeout while so) and resumes it; a phone that vanishes
    (no BYE) is ended by the RTP timeout and its slot comes back; a session that reaches its limit hangs up with
    a BYE the caller sees."""
    require_baresip()
    port, server = sip_server(sip_llm, rtp_timeout_s=2.0)
    with server as (_, services), Baresip(tmp_path / "alice", question_wav) as alice:
        alice.command("dial", f"sip:kame@127.0.0.1:{port}")
        alice.wait_for("CALL_ESTABLISHED")
        alice.command("hold")
        time.sleep(4.0)  # twice the RTP timeout, on hold
        assert "CALL_CLOSED" not in alice.types() and free_slots(services) == 1
        alice.command("resume")
        time.sleep(1.0)
        assert "CALL_CLOSED" not in alice.types()
        alice.kill()
        wait_until(lambda: free_slots(services) == 2, "the RTP timeout ended the lost phone's call", 15)
    port, server = sip_server(sip_llm, max_session_s=4.0)
    with server as (_, services), Baresip(tmp_path / "bob", question_wav) as bob:
        bob.command("dial", f"sip:kame@127.0.0.1:{port}")
        bob.wait_for("CALL_ESTABLISHED")
        bob.wait_for("CALL_CLOSED", 20)  # the server's BYE at the session's limit
        wait_until(lambda: free_slots(services) == 2, "the slot came back", 10)


def test_a_call_nobody_accepts_is_declined_and_never_holds_a_slot(sip_llm, question_wav, tmp_path):
    require_baresip()
    with WebhookReceiver(lambda event: None) as receiver:  # the application hears of the call, and does nothing
        port, server = sip_server(sip_llm, webhook_url=receiver.url, webhook_secret=SECRET, ring_timeout_s=2.0)
        with server as (_, services), Baresip(tmp_path / "alice", question_wav) as alice:
            alice.command("dial", f"sip:kame@127.0.0.1:{port}")
            alice.wait_for("CALL_RINGING")
            assert free_slots(services) == 2  # ringing costs no slot
            closed = alice.wait_for("CALL_CLOSED", 15)
            assert "480" in closed.get("param", ""), closed
            assert free_slots(services) == 2
    assert {event.type for event in receiver.events} == {"realtime.call.incoming", "live.transport.incoming"}
    assert not receiver.errors, receiver.errors


def test_a_wideband_call_in_g722(sip_llm, tmp_path):
    """A softphone that offers only G.722 (16 kHz) gets it: its question reaches the LLM, it hears the answer."""
    require_baresip()
    from kame.testing.speech import speech

    pcm = speech(SPIDER, tmp_path / "tts", sample_rate=16000)
    wav = tmp_path / "question16k.wav"
    write_wav_8k(wav, np.concatenate([np.zeros(8000, np.float32), pcm, np.zeros(16000 * 12, np.float32)]), 16000)
    port, server = sip_server(sip_llm)
    with server as (_, services), Baresip(tmp_path / "alice", wav, codecs="G722") as alice:
        alice.command("dial", f"sip:kame@127.0.0.1:{port}")
        alice.wait_for("CALL_ESTABLISHED")
        wait_until(lambda: asked(sip_llm, SPIDER), "the wideband question reached the LLM", 40)
        time.sleep(1.5)
        alice.command("hangup")
        alice.wait_for("CALL_CLOSED")
        wait_until(lambda: free_slots(services) == 2, "the slot came back", 10)
    heard = alice.heard()
    assert len(heard) > 16000 * 2 and float(np.sqrt(np.mean(heard ** 2))) > 1e-3
