"""The doors of the carriers whose stream URL the application writes itself: Telnyx (a Call Control command's
`stream_url`), Vonage (the NCCO's websocket `uri`), Plivo (the `<Stream>` XML). A carrier cannot send KAME's
API key, so a secret in that URL is the credential: with `[phone] <carrier>_stream_token` set, the route
opens only for `?stream_token=<it>` (compared in constant time; uvicorn's log hides it). Without it the route
is open on a loopback address only, and off (403) anywhere else, as Twilio's are (routes.py).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass

from starlette.websockets import WebSocket

from server.access import Refusal
from server.phone.carrier import PhoneCarrier
from server.phone.plivo import PlivoStream
from server.phone.streams import CarrierStream
from server.phone.telnyx import AUTH_HEADER, TelnyxStream
from server.phone.vonage import VonageStream
from server.settings import ServerSettings, is_loopback


@dataclass(frozen=True)
class StreamCarrier:
    name: str  # its route is /<name>/media; its setting [phone] <name>_stream_token
    stream: Callable[[], CarrierStream]
    header: str | None = None  # a handshake header the carrier itself can put the token in


CARRIERS = (StreamCarrier("telnyx", TelnyxStream, AUTH_HEADER), StreamCarrier("vonage", VonageStream),
            StreamCarrier("plivo", PlivoStream))


class StreamTokenDoor:
    """One carrier's media route on one server."""

    def __init__(self, settings: ServerSettings, carrier: StreamCarrier) -> None:
        self.settings, self.carrier, self.name = settings, carrier, carrier.name
        secret = getattr(settings.phone, f"{carrier.name}_stream_token")
        self._token = secret.get_secret_value().encode() if secret is not None else None
        self.closed = None if self._token is not None or is_loopback(settings.host) else (
            f"the {carrier.name} route is off: the server listens on {settings.host} and [phone] "
            f"{carrier.name}_stream_token is not set (carriers cannot send the server's API key)")

    def admit(self, ws: WebSocket) -> Refusal | None:
        if self.closed is not None:
            return Refusal(403, 1008, self.closed)
        if self._token is None:
            return None
        given = [ws.query_params.get("stream_token"), self.carrier.header and ws.headers.get(self.carrier.header)]
        if not any(value and hmac.compare_digest(value.encode(), self._token) for value in given):
            return Refusal(403, 1008, f"a {self.name} stream opens with its stream_token")
        return None

    def phone_carrier(self, runner, tandem) -> PhoneCarrier:
        phone = self.settings.phone
        return PhoneCarrier(runner, tandem, self.carrier.stream(), lead_frames=phone.lead_frames,
                            keypad_to_llm=phone.keypad_to_llm)


def stream_token_doors(settings: ServerSettings) -> list[StreamTokenDoor]:
    return [StreamTokenDoor(settings, carrier) for carrier in CARRIERS]
