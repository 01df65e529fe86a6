"""KAME's SIP webhooks, posted to a real HTTP receiver and checked with the OpenAI SDK's own `webhooks.unwrap`."""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
import socket
import threading
import time
from dataclasses import dataclass, field

import httpx2
import openai
import pytest
import uvicorn
from openai.types.webhooks.live_transport_incoming_webhook_event import LiveTransportIncomingWebhookEvent
from openai.types.webhooks.realtime_call_incoming_webhook_event import RealtimeCallIncomingWebhookEvent
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from server.sip import webhooks
from server.sip.webhooks import Delivery, WebhookPoster

SECRET = "whsec_" + base64.b64encode(b"kame-test-webhook-key-32-bytes!!").decode()
OTHER_SECRET = "whsec_" + base64.b64encode(b"not-the-receivers-key-32-bytes!!").decode()
FAST = (0.05, 0.1)
INVITE = [("From", '"Alice" <sip:+15550100@carrier.example>;tag=1'), ("To", "<sip:+15550199@kame.example>"),
          ("Authorization", 'Digest username="alice", response="0123"'), ("X-Account", "a"), ("X-Account", "b"),
          ("proxy-authorization", "Digest secret")]
KEPT = [(n, v) for n, v in INVITE if n.lower() not in ("authorization", "proxy-authorization")]


@dataclass
class Reply:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    hang: bool = False  # answer nothing until the client hangs up


@dataclass
class Seen:
    headers: dict[str, str]
    body: bytes


class Receiver:
    """An application's webhook endpoint: it verifies with the SDK (when it has a secret), then answers as told."""

    def __init__(self) -> None:
        self.secret: str | None = SECRET
        self.replies: list[Reply] = []
        self.seen: list[Seen] = []
        self.url = ""

    def reset(self, *replies: Reply, secret: str | None = SECRET) -> None:
        self.secret, self.replies, self.seen = secret, list(replies), []

    async def endpoint(self, request: Request) -> Response:
        body = await request.body()
        self.seen.append(Seen(dict(request.headers), body))
        if self.secret is not None:
            try:
                openai.OpenAI(api_key="x", webhook_secret=self.secret).webhooks.unwrap(body, request.headers)
            except openai.InvalidWebhookSignatureError:
                return Response(status_code=400)
        reply = self.replies.pop(0) if self.replies else Reply()
        if reply.hang:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        return Response(status_code=reply.status, headers=reply.headers)


@pytest.fixture(scope="module")
def receiver():
    receiver = Receiver()
    app = Starlette(routes=[Route("/hooks", receiver.endpoint, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, name="webhook-receiver", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    receiver.url = f"http://127.0.0.1:{port}/hooks"
    yield receiver
    server.should_exit = True
    thread.join(5)


def deliver(url: str, event: dict, secret: str | None = SECRET, **kw) -> Delivery:
    still_wanted = kw.pop("still_wanted", lambda: True)

    async def run() -> Delivery:
        poster = WebhookPoster(url, secret, **({"backoff_s": FAST} | kw))
        try:
            return await poster.post(event, still_wanted=still_wanted)
        finally:
            await poster.aclose()

    return asyncio.run(run())


def unwrap(seen: Seen, secret: str = SECRET):
    return openai.OpenAI(api_key="x", webhook_secret=secret).webhooks.unwrap(seen.body, seen.headers)


def test_signature_is_the_sdks():
    body = b'{"a":1}'
    verify = openai.OpenAI(api_key="x").webhooks.verify_signature
    for secret in (SECRET, "a plain secret"):
        headers = webhooks.signed_headers(secret, body)
        verify(body, headers, secret=secret)
        assert headers["webhook-id"].startswith("msg_")
        assert headers["content-type"] == "application/json" and headers["user-agent"] == "kame-webhooks"
    headers = webhooks.signed_headers(SECRET, body, webhook_id="msg_1", now=1_700_000_000.7)
    assert headers["webhook-id"] == "msg_1" and headers["webhook-timestamp"] == "1700000000"
    assert headers["webhook-signature"] == webhooks.sign(SECRET, "msg_1", 1_700_000_000, body)
    # several signatures (a key rotation): any one that matches will do
    fresh = webhooks.signed_headers(SECRET, body)
    rotated = fresh | {"webhook-signature": "v1,AAAA " + fresh["webhook-signature"]}
    verify(body, rotated, secret=SECRET)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        verify(body, fresh, secret=OTHER_SECRET)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        verify(body + b" ", fresh, secret=SECRET)
    with pytest.raises(openai.InvalidWebhookSignatureError, match="too old"):
        verify(body, webhooks.signed_headers(SECRET, body, now=time.time() - 301), secret=SECRET)


def test_event_ids_are_unique():
    ids = {webhooks.event_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(i.startswith("evt_") and len(i) > 20 for i in ids)


def test_realtime_call_incoming_as_the_sdk_parses_it(receiver):
    receiver.reset()
    event = webhooks.realtime_call_incoming("rtc_abc123", INVITE, now=1_750_000_000.5)
    delivery = deliver(receiver.url, event)
    assert delivery == Delivery(delivered=True, attempts=1, status=200, error=None)
    [seen] = receiver.seen
    assert seen.headers["user-agent"] == "kame-webhooks" and seen.headers["content-type"] == "application/json"
    parsed = unwrap(seen)
    assert isinstance(parsed, RealtimeCallIncomingWebhookEvent)
    assert parsed.type == "realtime.call.incoming" and parsed.object == "event"
    assert parsed.id == event["id"] and parsed.id.startswith("evt_") and parsed.created_at == 1_750_000_000
    assert parsed.data.call_id == "rtc_abc123" and parsed.data.sip_media_security is None
    assert [(h.name, h.value) for h in parsed.data.sip_headers] == KEPT
    # unwrap only constructs; the strict model says no required field is missing and no literal is off
    RealtimeCallIncomingWebhookEvent.model_validate_json(seen.body, strict=True)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        unwrap(seen, OTHER_SECRET)


def test_live_transport_incoming_as_the_async_sdk_parses_it(receiver):
    receiver.reset()
    event = webhooks.live_transport_incoming("live_xyz789", INVITE, sip_media_security="srtp")
    assert deliver(receiver.url, event).delivered
    [seen] = receiver.seen
    parsed = openai.AsyncOpenAI(api_key="x", webhook_secret=SECRET).webhooks.unwrap(seen.body, seen.headers)
    assert isinstance(parsed, LiveTransportIncomingWebhookEvent)
    assert parsed.type == "live.transport.incoming" and parsed.object == "event" and parsed.id.startswith("evt_")
    assert abs(parsed.created_at - time.time()) < 5
    assert parsed.data.session_id == "live_xyz789" and parsed.data.type == "sip"
    assert parsed.data.sip_media_security == "srtp"
    assert [(h.name, h.value) for h in parsed.data.sip_headers] == KEPT
    LiveTransportIncomingWebhookEvent.model_validate_json(seen.body, strict=True)


def test_wrong_secret_is_refused_and_not_retried(receiver):
    receiver.reset()
    delivery = deliver(receiver.url, webhooks.realtime_call_incoming("rtc_1", []), secret=OTHER_SECRET)
    assert delivery == Delivery(delivered=False, attempts=1, status=400, error="HTTP 400")
    assert len(receiver.seen) == 1


@pytest.mark.parametrize("status", [400, 401, 404, 410, 422])
def test_a_refusal_is_not_retried(receiver, status):
    receiver.reset(Reply(status))
    delivery = deliver(receiver.url, webhooks.realtime_call_incoming("rtc_1", []))
    assert (delivery.delivered, delivery.attempts, delivery.status) == (False, 1, status)


def test_server_errors_retried_with_one_id_and_fresh_signatures(receiver, monkeypatch):
    # a clock 10 s on per reading, so that each attempt's timestamp (whole seconds) differs
    ticks = itertools.count()
    start = time.time()
    monkeypatch.setattr(webhooks, "_now", lambda: start + 10 * next(ticks))
    receiver.reset(Reply(500), Reply(503), Reply(200))
    event = webhooks.realtime_call_incoming("rtc_retry", [("From", "<sip:a@b>")])
    delivery = deliver(receiver.url, event, backoff_s=(0.01, 0.01, 0.01))
    assert delivery == Delivery(delivered=True, attempts=3, status=200, error=None)
    assert len({s.headers["webhook-id"] for s in receiver.seen}) == 1
    assert len({s.body for s in receiver.seen}) == 1
    stamps = [int(s.headers["webhook-timestamp"]) for s in receiver.seen]
    assert stamps == sorted(set(stamps))
    assert len({s.headers["webhook-signature"] for s in receiver.seen}) == 3
    for seen in receiver.seen:  # each attempt's own signature is valid (the receiver answered 400 otherwise)
        assert unwrap(seen).data.call_id == "rtc_retry"


@pytest.mark.parametrize("status", [408, 409, 429, 502])
def test_passing_problems_are_retried(receiver, status):
    receiver.reset(Reply(status))
    delivery = deliver(receiver.url, webhooks.realtime_call_incoming("rtc_1", []))
    assert delivery == Delivery(delivered=True, attempts=2, status=200, error=None)


def test_retry_after_is_honoured_up_to_the_backoff(receiver):
    receiver.reset(Reply(429, {"retry-after": "3600"}), Reply(503, {"retry-after": "0"}), Reply(200))
    began = time.monotonic()
    delivery = deliver(receiver.url, webhooks.realtime_call_incoming("rtc_1", []), backoff_s=(0.05, 30.0))
    assert delivery.delivered and delivery.attempts == 3
    assert time.monotonic() - began < 15  # capped at 0.05 s, then 0 s instead of 30 s


def test_gives_up_when_the_backoff_is_spent(receiver):
    receiver.reset(*[Reply(500)] * 5)
    delivery = deliver(receiver.url, webhooks.realtime_call_incoming("rtc_1", []))
    assert delivery == Delivery(delivered=False, attempts=3, status=500, error="HTTP 500")


def test_a_silent_receiver_times_out_until_the_call_stops_ringing(receiver):
    receiver.reset(*[Reply(hang=True)] * 20)
    # the call stops ringing once the receiver has been tried twice (by state, not by time: a busy machine)
    delivery = deliver(receiver.url, webhooks.realtime_call_incoming("rtc_1", []), timeout_s=0.2,
                       backoff_s=(0.05,) * 20, still_wanted=lambda: len(receiver.seen) < 2)
    assert not delivery.delivered and delivery.status is None
    assert delivery.attempts == 2 and "no longer wanted" in delivery.error and "0.2 s" in delivery.error


def test_a_backoff_wait_ends_when_the_call_stops_ringing(receiver):
    receiver.reset(Reply(500))
    began = time.monotonic()
    delivery = deliver(receiver.url, webhooks.realtime_call_incoming("rtc_1", []), backoff_s=(30.0,),
                       still_wanted=lambda: not receiver.seen)  # the call stops ringing after the first try
    assert (delivery.delivered, delivery.attempts, delivery.status) == (False, 1, 500)
    assert time.monotonic() - began < 15  # not the 30 s backoff


def test_nobody_listening_is_retried_then_given_up():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    delivery = deliver(f"http://127.0.0.1:{port}/hooks", webhooks.realtime_call_incoming("rtc_1", []))
    assert (delivery.delivered, delivery.attempts, delivery.status) == (False, 3, None)
    assert "Connect" in delivery.error


def test_unsigned_posting_warns_once(receiver, caplog):
    receiver.reset(secret=None)

    async def run() -> list[Delivery]:
        poster = WebhookPoster(receiver.url, None, backoff_s=FAST)
        try:
            return [await poster.post(webhooks.realtime_call_incoming(f"rtc_{i}", [])) for i in range(2)]
        finally:
            await poster.aclose()

    with caplog.at_level(logging.WARNING, logger="server.sip.webhooks"):
        deliveries = asyncio.run(run())
    assert all(d.delivered for d in deliveries)
    assert len([r for r in caplog.records if "UNSIGNED" in r.getMessage()]) == 1
    assert all("webhook-signature" not in s.headers and "webhook-id" in s.headers for s in receiver.seen)


def test_bad_configuration_fails_at_start_without_echoing_the_secret():
    with pytest.raises(ValueError) as info:
        WebhookPoster("http://127.0.0.1:1/hooks", "whsec_abc")
    assert "abc" not in str(info.value)
    with pytest.raises(ValueError):
        WebhookPoster("http://127.0.0.1:1/hooks", "")
    with pytest.raises(ValueError):
        WebhookPoster("ftp://example.com/hooks", SECRET)


def test_a_client_passed_in_stays_open(receiver):
    receiver.reset()

    async def run() -> bool:
        async with httpx2.AsyncClient() as client:  # the poster's own HTTP client library
            poster = WebhookPoster(receiver.url, SECRET, client=client)
            delivery = await poster.post(webhooks.realtime_call_incoming("rtc_1", []))
            await poster.aclose()
            return delivery.delivered and not client.is_closed

    assert asyncio.run(run())
