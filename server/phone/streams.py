"""What a carrier's media stream says, whichever carrier: its messages read into these events, and the
three things a call sends back (audio, a mark, a clear). Each carrier (twilio.py, telnyx.py, vonage.py)
is one `CarrierStream`: pure, messages in and out, no socket."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from kame.protocol import ProtocolError

Encoding = Literal["audio/pcmu", "audio/pcma", "audio/pcm", "audio/g722"]


class PhoneProtocolError(ProtocolError):
    """A carrier message that cannot be read; the call goes on (a carrier is told nothing: it has no
    error message), the server logs it and counts it."""


@dataclass(frozen=True)
class CallStarted:
    call_id: str  # the carrier's id of the call (Twilio's CallSid)
    stream_id: str  # of the media stream (Twilio's streamSid): every message back names it
    encoding: Encoding
    rate: int  # samples a second
    params: dict[str, str] = field(default_factory=dict)  # what the application passed (customParameters)


@dataclass(frozen=True)
class CallAudio:
    data: bytes  # the caller's audio in the stream's encoding


@dataclass(frozen=True)
class CallDigit:
    digit: str  # 0-9, *, #, A-D


@dataclass(frozen=True)
class CallMarked:
    name: str  # a mark sent back: the audio before it has played, or a clear dropped it


@dataclass(frozen=True)
class CallStopped:
    reason: str


PhoneEvent = CallStarted | CallAudio | CallDigit | CallMarked | CallStopped


class CarrierStream(Protocol):
    """One call's media stream protocol."""

    name: str  # "twilio", ...
    marks: bool  # the carrier sends marks back (else the pacer keeps time itself)

    def read(self, message: str | bytes) -> list[PhoneEvent]:
        """A message from the carrier; PhoneProtocolError for one that cannot be read."""

    def audio(self, data: bytes) -> list[str | bytes]:
        """Messages that play `data` (the stream's encoding) to the caller."""

    def mark(self, name: str) -> list[str | bytes]:
        """Messages asking for `name` back once the audio before it has played ([] where there are no marks)."""

    def clear(self) -> list[str | bytes]:
        """Messages that drop the audio sent and not yet played."""
