"""The doors of Telnyx, Vonage and Plivo (server/phone/doors.py): a secret token in the stream URL the
application wrote is the credential; without one the route is open on loopback only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from server.phone.doors import CARRIERS, StreamTokenDoor, stream_token_doors
from server.phone.plivo import PlivoStream
from server.phone.telnyx import TelnyxStream
from server.phone.vonage import VonageStream
from server.settings import ServerSettings


def settings(host: str = "127.0.0.1", **phone) -> ServerSettings:
    return ServerSettings.model_validate({"host": host, "auth_tokens": ["api-key"], "phone": phone})


def ws(query: dict | None = None, headers: dict | None = None) -> SimpleNamespace:
    return SimpleNamespace(query_params=query or {}, headers=headers or {})


def test_each_carrier_has_its_door_and_its_stream():
    doors = stream_token_doors(settings())
    assert [(d.name, type(d.carrier.stream())) for d in doors] == [
        ("telnyx", TelnyxStream), ("vonage", VonageStream), ("plivo", PlivoStream)]


@pytest.mark.parametrize("carrier", CARRIERS, ids=lambda c: c.name)
def test_without_a_token_the_route_is_open_on_loopback_and_off_elsewhere(carrier):
    assert StreamTokenDoor(settings("127.0.0.1"), carrier).admit(ws()) is None
    door = StreamTokenDoor(settings("0.0.0.0"), carrier)
    assert f"{carrier.name}_stream_token is not set" in door.closed
    refusal = door.admit(ws({"stream_token": "anything"}))
    assert (refusal.status, refusal.reason) == (403, door.closed)


@pytest.mark.parametrize("carrier", CARRIERS, ids=lambda c: c.name)
@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1"])
def test_with_a_token_only_the_url_that_carries_it_opens(carrier, host):
    door = StreamTokenDoor(settings(host, **{f"{carrier.name}_stream_token": "s3cret-é"}), carrier)
    assert door.closed is None
    assert door.admit(ws({"stream_token": "s3cret-é"})) is None
    for query in ({}, {"stream_token": ""}, {"stream_token": "s3cret"}, {"token": "s3cret-é"}):
        refusal = door.admit(ws(query))
        assert (refusal.status, refusal.reason) == (403, f"a {carrier.name} stream opens with its stream_token")


def test_telnyx_may_send_the_token_as_its_stream_auth_token_header():
    carrier = CARRIERS[0]
    door = StreamTokenDoor(settings("0.0.0.0", telnyx_stream_token="s3cret"), carrier)
    assert door.admit(ws(headers={"x-telnyx-streaming-auth-token": "s3cret"})) is None
    assert door.admit(ws(headers={"x-telnyx-streaming-auth-token": "other"})) is not None
    vonage = StreamTokenDoor(settings("0.0.0.0", vonage_stream_token="s3cret"), CARRIERS[1])
    assert vonage.admit(ws(headers={"x-telnyx-streaming-auth-token": "s3cret"})) is not None


def test_the_tokens_are_hidden_in_the_settings():
    phone = settings(telnyx_stream_token="s3cret", vonage_stream_token="v", plivo_stream_token="p").phone
    assert "s3cret" not in repr(phone) and "s3cret" not in str(phone.model_dump())
