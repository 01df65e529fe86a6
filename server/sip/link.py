"""A SIP call's media as the phone path's link and stream: the RTP session's 20 ms payloads and keypad digits
in, as a carrier's media stream would bring them (`SipStream` reads them into the phone events); the
assistant's G.711 out to RTP, paced there; the call's end both ways (a BYE ends the session, the session's
end sends a BYE)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Coroutine

from kame.sip.rtp import RtpSession
from kame.sip.ua import SipCall
from server.phone.streams import (
    CallAudio,
    CallDigit,
    CallStarted,
    CallStopped,
    Encoding,
    PhoneEvent,
    PhoneProtocolError,
)
from server.runner import Disconnected, Message

logger = logging.getLogger(__name__)

CLEAR = json.dumps({"event": "clear"})
DIGIT = "dtmf:"  # + a key: a digit for the caller's line
QUEUE_MESSAGES = 500  # 10 s of 20 ms payloads: a session that stops reading its link is ended well before


class RtpLink:
    """The runner's link for one SIP call (messages: JSON text for the call's start, digits and end; bytes
    for the caller's audio)."""

    idle_limited = False  # the caller's audio is the message stream; a silent line is the RTP timeout's to judge
    unopened = "the call never started"

    def __init__(self, call: SipCall | None, rtp: RtpSession) -> None:
        self.call, self.rtp = call, rtp
        self._inbox: asyncio.Queue[Message | None] = asyncio.Queue(QUEUE_MESSAGES)
        self._closed = False
        self.held = False
        self.overflowed = 0
        self._tasks: set[asyncio.Task] = set()

    # ---------------------------------------------------------------- the call's side

    def started(self, call_id: str, encoding: Encoding, rate: int, params: dict[str, str]) -> None:
        self._put(json.dumps({"event": "start", "call_id": call_id, "encoding": encoding, "rate": rate,
                              "params": params}))

    def audio(self, payload: bytes) -> None:
        if not self.held:  # on hold the line carries the PBX's music, not the caller
            self._put(payload)

    def digit(self, digit: str) -> None:
        self._put(json.dumps({"event": "dtmf", "digit": digit}))

    def stopped(self, reason: str) -> None:
        self._put(json.dumps({"event": "stop", "reason": reason}), force=True)

    def _put(self, message: Message, force: bool = False) -> None:
        if self._closed:
            return
        if self._inbox.full():
            if not force:
                self.overflowed += 1
                return
            self._inbox.get_nowait()
        self._inbox.put_nowait(message)

    # ---------------------------------------------------------------- the runner's side

    async def opened(self) -> None:
        return None

    async def receive(self) -> Message:
        message = await self._inbox.get()
        if message is None:
            raise Disconnected()
        return message

    async def send(self, message: Message) -> None:
        if self._closed:
            raise Disconnected()
        if isinstance(message, bytes):
            self.rtp.send_audio(message)
        elif message == CLEAR:
            self.rtp.clear()
        elif message.startswith(DIGIT):
            self._send_digit(message[len(DIGIT):])

    def _send_digit(self, digit: str) -> None:
        """RFC 4733 events where the call negotiated them, else SIP INFO."""
        try:
            self.rtp.send_digit(digit)
        except ValueError:  # no telephone-event in the call's SDP
            if self.call is None:
                return
            task = asyncio.get_running_loop().create_task(self.call.info_digit(digit), name="sip-info-digit")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def flush(self, messages: list[Message]) -> None:
        for message in messages:
            await self.send(message)

    async def close(self, code: int, reason: str) -> None:
        """The session ended: a BYE (once the last audio sent has played, a moment at most), the media gone."""
        if self._closed:
            return
        self._closed = True
        if self.call is None:  # an outbound call that never connected
            await self.rtp.close()
            return
        queued = min(self.rtp.queued_ms() / 1000, 1.0)
        if queued > 0 and self.call.state != "ended":
            await asyncio.sleep(queued)
        try:
            await self.call.hangup(reason or "the session ended")
        finally:
            await self.rtp.close()

    def tasks(self) -> list[Coroutine]:
        return []


class SipStream:
    """The phone path's view of a SIP call: its link's messages read as a carrier's stream would be read."""

    name = "sip"
    marks = False  # RTP has no marks: the pacer keeps time on the session's clock

    def read(self, message: str | bytes) -> list[PhoneEvent]:
        if isinstance(message, bytes):
            return [CallAudio(message)]
        data = json.loads(message)
        match data.get("event"):
            case "start":
                return [CallStarted(data["call_id"], data["call_id"], data["encoding"], data["rate"], data["params"])]
            case "dtmf":
                return [CallDigit(data["digit"])]
            case "stop":
                return [CallStopped(data["reason"])]
        raise PhoneProtocolError(f"not a SIP link message: {message[:60]!r}")

    def audio(self, data: bytes) -> list[bytes]:
        return [data]

    def mark(self, name: str) -> list[str]:
        return []

    def clear(self) -> list[str]:
        return [CLEAR]

    def digit(self, digit: str) -> list[str]:
        return [DIGIT + digit]
