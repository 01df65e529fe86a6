"""A phone call on the session runner: a carrier's media stream (`CarrierStream`: Twilio, Telnyx, Vonage, a SIP
call's RTP) around a GPT-Live session (or a Realtime one: server/phone/sessions.py). The call's audio is the
session's media (as over WebRTC: `hear` in, `play` out), its events go to sidebands and the recording only (a
carrier reads none), and the call
adds what a phone needs: the phone band both ways with the telephone echo canceller, the assistant's
audio paced a small lead ahead of what the caller has heard (pacer.py), a `clear` and a truncated
history when the caller talks over it, keypad digits, and the call's end.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Coroutine

import numpy as np

from kame.audio import FRAME_S
from kame.commands import AddUserText, TruncateAssistant
from kame.session import TandemSession
from kame.session_events import AssistantText, SessionEvent, Transcript
from server.deadline import DeadlineTimer
from server.echo import CallEcho
from server.live.client_events import LiveError
from server.phone import audio as phone_audio
from server.phone.pacer import Pacer
from server.phone.sessions import LiveCall, RealtimeCall
from server.phone.streams import (
    CallAudio,
    CallDigit,
    CallMarked,
    CallStarted,
    CallStopped,
    CarrierStream,
)
from server.runner import Finished, Limit, Message, SessionRunner

logger = logging.getLogger(__name__)

KEYPAD = set("0123456789*#ABCD")
DIGITS_END_S = 1.0  # a run of keypad digits ends this long after its last digit (or at '#')
SAID_PIECES = 1000  # of the assistant's words kept for a truncation: 80 s at a piece a frame
# a stream holds a session slot from its first byte: one that has not said which call it carries by then
# is closed (garbage or `connected` alone would keep the socket's idle limit away for good)
START_LIMIT_S = 10.0
# a carrier sends 20 ms every 20 ms, and after a stall the late audio in a burst; the caller's audio beyond
# real time plus this much is dropped before it costs a decode, the echo canceller and the engine's time
AUDIO_BURST_S = 2.0
LOGGED_REFUSALS = 10  # of a call's unreadable messages, those logged one by one (the rest are counted)


class RealTimeBudget:
    """How much of the caller's audio may come now: a bucket that fills at real time up to `burst_s`."""

    def __init__(self, burst_s: float, now: float) -> None:
        self.burst_s, self._level, self._at = burst_s, burst_s, now

    def allows(self, seconds: float, now: float) -> bool:
        self._level, self._at = min(self.burst_s, self._level + max(0.0, now - self._at)), now
        if seconds > self._level + 1e-9:
            return False
        self._level -= seconds
        return True


def _dtmf_send(text: str | None) -> tuple[str, str | None] | None:
    """(the key, its event_id) of a sideband's `transport.dtmf.send`; None for any other event."""
    if text is None or "transport.dtmf.send" not in text:
        return None
    try:
        event = json.loads(text)
    except ValueError:
        return None
    if not isinstance(event, dict) or event.get("type") != "transport.dtmf.send":
        return None
    return event.get("event"), event.get("event_id") if isinstance(event.get("event_id"), str) else None


class PhoneCarrier:
    """One call: the carrier's stream, the protocol session inside it (GPT-Live's; the Realtime API's for a SIP
    call its call control accepted, `realtime` being the accept's session), the pacer."""

    def __init__(self, runner: SessionRunner, tandem: TandemSession, stream: CarrierStream, *, lead_frames: int = 2,
                 keypad_to_llm: bool = True, expected_call: str | None = None, realtime: dict | None = None) -> None:
        self.runner, self.stream, self.clock, self.tandem = runner, stream, runner.clock, tandem
        self.expected_call = expected_call  # the call the stream's token was issued for (None: any)
        self.keypad_to_llm = keypad_to_llm
        self.session: LiveCall | RealtimeCall = (LiveCall(runner, tandem, self.play) if realtime is None
                                                 else RealtimeCall(runner, tandem, self.play, realtime))
        self.pacer = Pacer(lead_frames, marks=stream.marks)
        self.echo = CallEcho(runner.settings.echo_options())
        self.call: CallStarted | None = None
        self._decode = self._encode = None
        self._bytes_per_frame = 0
        self._heard = bytearray()  # the caller's audio not yet a whole frame
        self._digits: list[str] = []
        self._digits_due: float | None = None
        # (frame, text) of the assistant's words since the caller's last turn (the latest, in a long monologue)
        self._said: collections.deque[tuple[int, str]] = collections.deque(maxlen=SAID_PIECES)
        self._start_due: float | None = self.clock.now() + START_LIMIT_S  # None once the call started
        self._budget = RealTimeBudget(AUDIO_BURST_S, self.clock.now())
        self._dropped_s = 0.0  # of the caller's audio, beyond real time
        self._refused = 0  # messages that could not be read
        self.timer = DeadlineTimer(self.clock, self._wake_at, self._on_time, f"call {runner.id}")

    # ---------------------------------------------------------------- the runner's side

    async def greet(self) -> None:
        """Nothing: the carrier speaks first."""

    async def on_message(self, message: Message) -> None:
        for event in self.stream.read(message):
            match event:
                case CallStarted():
                    self._start(event)
                case CallAudio(data=data):
                    self._audio(data)
                case CallMarked(name=name):
                    self.pacer.marked(name, self.clock.now())
                    self._pump()
                case CallDigit(digit=digit):
                    self._digit(digit)
                case CallStopped(reason=reason):
                    raise Finished(1000, reason)

    def refuse(self, exc: Exception) -> None:
        """A carrier has no error message: the server logs what it could not read (the first few; a stream
        of garbage is counted, not written out line by line), and the call goes on."""
        self._refused += 1
        if self._refused <= LOGGED_REFUSALS:
            logger.warning("call %s (%s): %s%s", self.runner.id, self.stream.name, exc,
                           "; more are counted, not logged" if self._refused == LOGGED_REFUSALS else "")

    async def on_event(self, event: SessionEvent) -> None:
        if isinstance(event, AssistantText):
            self._said.append((event.frame, event.text))
        elif isinstance(event, Transcript) and not event.backchannel and event.text.strip():
            self._caller_spoke(event)
        await self.session.on_event(event)

    def report(self, code: str, message: str) -> None:
        self.session.report(code, message)

    def tasks(self) -> list[Coroutine]:
        return [*self.session.tasks(), self.timer.run()]

    async def aclose(self) -> None:
        await self.session.aclose()
        if self._refused > LOGGED_REFUSALS or self._dropped_s or self.pacer.dropped:
            logger.info("call %s ended: %d messages could not be read, %.1f s of the caller's audio came faster "
                        "than real time, %d frames of the assistant's waited too long to play",
                        self.runner.id, self._refused, self._dropped_s, self.pacer.dropped)

    # sidebands (server/live/sideband.py) reach the call's session through these
    @property
    def protocol(self) -> str:
        """Which sideband attaches: GPT-Live's (by the session id) or the Realtime API's (by the call id)."""
        return self.session.protocol

    @property
    def sidebands(self) -> set:
        return self.session.sidebands

    def replayed(self) -> list[dict]:
        return self.session.replayed()

    def steer(self, text: str | None, sideband) -> None:
        command = _dtmf_send(text)
        if command is None:
            self.session.steer(text, sideband)
            return
        try:
            self._send_digit(*command)
        except LiveError as exc:
            self.session.refuse(sideband, exc.code, str(exc), exc.param, exc.client_event_id)

    def _send_digit(self, digit: str, client_event_id: str | None) -> None:
        """A sideband's `transport.dtmf.send`: the key pressed on the caller's line (SIP only: a carrier's media
        stream cannot send one), then `transport.dtmf.sent` to the sidebands."""
        send = getattr(self.stream, "digit", None)
        if send is None:
            raise LiveError("unsupported", "transport.dtmf.send is supported only for SIP calls, not "
                            f"{self.stream.name}", "type", client_event_id)
        if not (isinstance(digit, str) and len(digit) == 1 and digit.upper() in KEYPAD):
            raise LiveError("invalid_value", "event: one of 0-9, A-D, * or #", "event", client_event_id)
        for message in send(digit.upper()):
            self.runner.send(message)
        self.session.digit_sent(digit.upper(), client_event_id)

    # ---------------------------------------------------------------- the call

    def _start(self, call: CallStarted) -> None:
        if self.expected_call is not None and call.call_id != self.expected_call:
            raise Finished(1008, "this stream's token was issued for another call")
        self.echo.formats("audio/pcmu", "audio/pcmu")  # a phone line, whatever its codec: a handset may echo us
        self._decode = self.echo.decoder(phone_audio.decoder(call.encoding, call.rate))
        self._encode = self.echo.encoder(phone_audio.encoder(call.encoding, call.rate))
        self._bytes_per_frame = round(phone_audio.bytes_per_second(call.encoding, call.rate) * FRAME_S)
        self.keypad_to_llm = call.params.get("keypad", "llm" if self.keypad_to_llm else "off") != "off"
        self.call, self._start_due = call, None
        self._budget = RealTimeBudget(AUDIO_BURST_S, self.clock.now())
        logger.info("%s call %s (stream %s): %s session %s", self.stream.name, call.call_id, call.stream_id,
                    self.session.protocol, self.runner.id)
        self.session.start(call.call_id, call.params)

    def _audio(self, data: bytes) -> None:
        """The caller's audio, handed on a frame at a time (a carrier sends 20 ms at a time); what comes
        faster than real time, beyond a burst, is dropped."""
        seconds = len(data) / (self._bytes_per_frame / FRAME_S)
        if not self._budget.allows(seconds, self.clock.now()):
            if not self._dropped_s:
                logger.warning("call %s: the caller's audio comes faster than real time; what is beyond %.0f s "
                               "ahead is dropped", self.runner.id, AUDIO_BURST_S)
            self._dropped_s += seconds
            return
        self._heard += data
        whole = len(self._heard) - len(self._heard) % self._bytes_per_frame
        if whole:
            chunk, self._heard = bytes(self._heard[:whole]), self._heard[whole:]
            self.session.hear(self._decode(chunk))

    def play(self, pcm: np.ndarray, frame: int) -> None:
        """The assistant's next frame (the Live mapping's `Play`): encoded for the line and paced out."""
        if self._encode is not None:
            dropped = self.pacer.dropped
            self.pacer.push(self._encode(pcm), frame)
            if self.pacer.dropped > dropped:  # piled up behind the lead: dropped to stay live
                if not dropped:
                    logger.info("call %s: the assistant's audio came faster than the carrier played it; frames "
                                "waiting behind the lead are dropped to stay live", self.runner.id)
                self.runner.services.metrics.frames_dropped.labels("out").inc(self.pacer.dropped - dropped)
            self._pump()

    def _pump(self) -> None:
        for out in self.pacer.take(self.clock.now()):
            for message in self.stream.audio(out.payload):
                self.runner.send(message)
            if out.mark is not None:
                for message in self.stream.mark(out.mark):
                    self.runner.send(message)
        self.timer.nearer()

    # ---------------------------------------------------------------- barge-in

    def _caller_spoke(self, event: Transcript) -> None:
        """The caller's words while the assistant's words are still playing: the carrier drops what it
        holds (`clear`), and the assistant's turn in the history keeps what the caller heard."""
        heard_frame = self.pacer.heard_frame
        unheard = any(text.strip() for frame, text in self._said if heard_frame is None or frame > heard_frame)
        if unheard and (self.pacer.lead() or self.pacer.waiting):
            heard_frame = self.pacer.clear(self.clock.now())
            for message in self.stream.clear():
                self.runner.send(message)
            self.echo.playback_stopped()
            said = "".join(text for _, text in self._said).strip()
            heard = "".join(text for frame, text in self._said
                            if heard_frame is not None and frame <= heard_frame).strip()
            if said != heard:
                self.tandem.apply(TruncateAssistant(said, heard))
            self._said.clear()
        if event.final:
            self._said.clear()

    # ---------------------------------------------------------------- keypad

    def _digit(self, digit: str) -> None:
        """A key the caller pressed: GPT-Live's `transport.dtmf.received` or Realtime's
        `input_audio_buffer.dtmf_event_received` (for sidebands and the recording: the caller's line carries no
        events), and with the digits around it, the caller's words to the LLM ("The caller pressed 1 2 3 on the
        keypad.")."""
        self.session.digit_received(digit)
        if not self.keypad_to_llm:
            return
        self._digits.append(digit)
        self._digits_due = self.clock.now() + DIGITS_END_S
        if digit == "#":
            self._keyed()
        self.timer.nearer()

    def _keyed(self) -> None:
        digits, self._digits, self._digits_due = self._digits, [], None
        if digits:
            self.tandem.apply(AddUserText(f"The caller pressed {' '.join(digits)} on the keypad."))

    # ---------------------------------------------------------------- time

    def _wake_at(self) -> float:
        now = self.clock.now()
        times = [t for t in (self._digits_due, self._start_due, self.pacer.wake_at(now)) if t is not None]
        return min(times) if times else now + 3600.0

    def _on_time(self, now: float) -> None:
        if self._start_due is not None and now >= self._start_due:
            raise Limit(1008, f"the stream sent no start message within {START_LIMIT_S:.0f} s")
        if self._digits_due is not None and now >= self._digits_due:
            self._keyed()
        self._pump()
