"""A phone call's carrier (server/phone/carrier.py) in process, on the session's manual clock: the real runner and
Twilio's mapping around a fake tandem session whose events the test writes. What is promised about time is
proven here, not at real-time pace: a clear goes out at once when the caller talks over unplayed words and
the history keeps what was heard; a stream that never starts is closed after START_LIMIT_S; the caller's
audio faster than real time is dropped past a burst; keypad digits end a run after DIGITS_END_S."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from types import SimpleNamespace

import numpy as np
from openai.types.live.connect_server_event import ConnectServerEvent
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter

from kame.clock import ManualClock, settle
from kame.commands import AddUserText, PushAudio, TruncateAssistant
from kame.session_events import AssistantAudio, AssistantText, Transcript
from server.metrics import Metrics
from server.phone.carrier import DIGITS_END_S, START_LIMIT_S, PhoneCarrier
from server.phone.twilio import TwilioStream
from server.runner import SessionRunner
from server.settings import ServerSettings
from tests.test_session_runner import QueueLink

SIDEBAND_EVENT = TypeAdapter(ConnectServerEvent)
REALTIME_EVENT = TypeAdapter(RealtimeServerEvent)  # the Realtime API's server events, as the SDK types them

STREAM = "MZ0123"
CONNECTED = json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"})
START = json.dumps({"event": "start", "sequenceNumber": "1", "streamSid": STREAM, "start": {
    "accountSid": "AC1", "streamSid": STREAM, "callSid": "CA1", "tracks": ["inbound", "outbound"],
    "customParameters": {}, "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}})
FRAME_PCM = np.zeros(1920, np.float32)


def media(seconds: float = 0.02) -> str:
    payload = base64.b64encode(b"\xff" * round(8000 * seconds)).decode()
    return json.dumps({"event": "media", "streamSid": STREAM, "media": {"track": "inbound", "payload": payload}})


def mark(name: str) -> str:
    return json.dumps({"event": "mark", "streamSid": STREAM, "mark": {"name": name}})


def dtmf(digit: str) -> str:
    return json.dumps({"event": "dtmf", "streamSid": STREAM, "dtmf": {"track": "inbound_track", "digit": digit}})


class Tandem:
    """The session the call's Live mapping drives: its commands are kept (the caller's audio counted), its
    events are what the test emits."""

    backend, system_prompt, dropped_events = "scripted", "Be brief.", 0

    def __init__(self) -> None:
        self.commands: list = []
        self.heard_samples = 0
        self.closed = False
        self._events: asyncio.Queue = asyncio.Queue()

    def apply(self, command) -> None:
        if isinstance(command, PushAudio):
            self.heard_samples += len(command.pcm)
        else:
            self.commands.append(command)

    def emit(self, *events) -> None:
        for event in events:
            self._events.put_nowait(event)

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self._events.get()

    async def aclose(self) -> None:
        self.closed = True

    def of(self, kind: type) -> list:
        return [c for c in self.commands if isinstance(c, kind)]


class Call:
    """A call on the real runner: the link is the carrier's side (`say`), the clock is manual."""

    def __init__(self, realtime: dict | None = None, **settings) -> None:
        self.clock = ManualClock()
        runtime = SimpleNamespace(profiles={"scripted": SimpleNamespace(model="scripted")},
                                  frontend=SimpleNamespace(source="tiny-copy"), asr=SimpleNamespace(name="whisper"))
        services = SimpleNamespace(settings=ServerSettings(**settings), metrics=Metrics(), runtime=runtime)
        self.link = QueueLink()
        self.runner = SessionRunner(services, self.link, "twilio", self.clock)
        self.tandem = Tandem()
        self.carrier = PhoneCarrier(self.runner, self.tandem, TwilioStream(), realtime=realtime)
        self.task = asyncio.create_task(self.runner.run(self.tandem, self.carrier))
        self._read = 0

    async def say(self, *messages: str) -> None:
        for message in messages:
            self.link.client_sends(message)
        await settle()

    def sent(self) -> list[dict]:
        """The messages to the carrier since the last look."""
        new, self._read = self.link.sent[self._read:], len(self.link.sent)
        return [json.loads(m) for m in new]

    async def end(self) -> None:
        self.link.client_goes()
        await asyncio.wait_for(self.task, 5)


def events(sent: list[dict]) -> list[str]:
    return [m["event"] + (f" {m['mark']['name']}" if m["event"] == "mark" else "") for m in sent]


def test_a_clear_goes_out_at_once_when_the_caller_talks_over_unplayed_words():
    """Six frames of the assistant's words come at once: two go out (the lead), two wait behind it and the two
    before those are dropped (a burst kept would be a delay for the rest of the call), the caller's marks let
    the two waiting go; then the caller speaks. The clear is sent in the same step (no time passes: within a
    frame), and the history keeps the words of the frames the caller heard."""
    async def go():
        call = Call()
        await call.say(CONNECTED, START)
        words = [" Paris", " is", " the", " capital", " of", " France"]
        for frame, word in enumerate(words, start=10):
            call.tandem.emit(AssistantText(frame, word), AssistantAudio(frame, FRAME_PCM, True, 0.1))
        await settle()
        first = events(call.sent())
        await call.say(mark("1"), mark("2"))  # frames 10 and 11 have played
        second = events(call.sent())
        call.tandem.emit(Transcript(False, "wait", 1.0, 1.2, 0.1))
        await settle()
        cleared = events(call.sent())
        await call.say(mark("3"), mark("4"))  # Twilio hands back the marks the clear dropped
        call.tandem.emit(AssistantText(16, " Yes?"), AssistantAudio(16, FRAME_PCM, True, 0.1))
        await settle()
        after = events(call.sent())
        heard = call.carrier.pacer.heard_frame
        await call.end()
        return call, first, second, cleared, after, heard

    call, first, second, cleared, after, heard = asyncio.run(go())
    assert first == ["media", "mark 1", "media", "mark 2"]
    assert second == ["media", "mark 3", "media", "mark 4"]
    assert cleared == ["clear"]  # nothing else: nothing was waiting
    assert call.carrier.pacer.dropped == 2  # frames 12 and 13
    assert call.runner.services.metrics.frames_dropped.labels("out")._value.get() == 2
    assert call.tandem.of(TruncateAssistant) == [TruncateAssistant("Paris is the capital of France", "Paris is")]
    assert after == ["media", "mark 5"] and heard == 11  # a fresh lead; the dropped marks changed nothing
    assert all(m["streamSid"] == STREAM for m in map(json.loads, call.link.sent))


def test_words_the_caller_has_heard_are_not_cleared():
    """The caller speaks once every word has played (only silence is unplayed): no clear, no truncation."""
    async def go():
        call = Call()
        await call.say(CONNECTED, START)
        call.tandem.emit(AssistantText(0, " Hello"), AssistantAudio(0, FRAME_PCM, True, 0.1),
                         AssistantText(1, ""), AssistantAudio(1, FRAME_PCM, True, 0.1),
                         AssistantAudio(2, FRAME_PCM, True, 0.1))
        await settle()
        await call.say(mark("1"))
        call.tandem.emit(Transcript(False, "hi there", 1.0, 1.2, 0.1))
        await settle()
        sent = events(call.sent())
        await call.end()
        return call, sent

    call, sent = asyncio.run(go())
    assert "clear" not in sent and call.tandem.of(TruncateAssistant) == []


def test_a_stream_that_never_starts_is_closed_and_frees_its_slot():
    """`connected` and garbage keep the socket's idle limit away; the start deadline does not."""
    async def go():
        call = Call(idle_timeout_s=60)
        await call.say(CONNECTED)
        for _ in range(int(START_LIMIT_S) - 1):
            await call.clock.advance(1.0)
            await call.say("{not json", CONNECTED)
        await call.clock.advance(0.9)
        open_before = call.link.closed is None and not call.tandem.closed
        await call.clock.advance(0.2)
        await asyncio.wait_for(call.task, 1)
        return call, open_before

    call, open_before = asyncio.run(go())
    assert open_before
    assert call.link.closed[0] == 1008 and "start" in call.link.closed[1]
    assert call.tandem.closed and call.runner.ended.is_set()


def test_a_started_call_has_no_start_deadline():
    async def go():
        call = Call(idle_timeout_s=600)
        await call.say(CONNECTED)
        await call.clock.advance(START_LIMIT_S - 1)
        await call.say(START)
        for _ in range(10):
            await call.clock.advance(1.0)
            await call.say(media(1.0))
        still_open = call.link.closed is None
        await call.end()
        return still_open

    assert asyncio.run(go())


def test_the_callers_audio_faster_than_real_time_is_dropped_past_a_burst(caplog):
    """A carrier sends 20 ms every 20 ms; a burst after a stall catches up. Three seconds at once are more than
    that: what is beyond the burst allowance never reaches the session (nor its decoder), said once in the log."""
    from server.phone.carrier import AUDIO_BURST_S

    async def go():
        call = Call(idle_timeout_s=600)
        await call.say(CONNECTED, START)
        with caplog.at_level(logging.WARNING, logger="server.phone.carrier"):
            await call.say(*[media(0.02)] * 150)  # 3 s of audio, no time passing
            flooded = call.tandem.heard_samples
            await call.clock.advance(1.0)  # a second later, a second's audio is welcome again
            await call.say(*[media(0.02)] * 50)
        later = call.tandem.heard_samples - flooded
        await call.end()
        return flooded, later

    flooded, later = asyncio.run(go())
    assert abs(flooded - AUDIO_BURST_S * 24000) <= 1920  # the burst, to a frame
    assert abs(later - 24000) <= 1920
    assert len([r for r in caplog.records if "faster than real time" in r.getMessage()]) == 1


def test_keypad_digits_reach_the_llm_as_one_run_and_the_sidebands_each():
    async def go():
        call = Call(idle_timeout_s=600)
        await call.say(CONNECTED, START)
        await call.say(dtmf("4"))
        await call.clock.advance(DIGITS_END_S / 2)
        await call.say(dtmf("2"))
        await call.clock.advance(DIGITS_END_S * 0.9)
        early = call.tandem.of(AddUserText)
        await call.clock.advance(DIGITS_END_S * 0.2)
        run = call.tandem.of(AddUserText)
        await call.say(dtmf("7"), dtmf("#"))  # '#' ends a run at once
        hashed = call.tandem.of(AddUserText)
        replay = [SIDEBAND_EVENT.validate_python(e).event for e in call.carrier.replayed()
                  if e["type"] == "transport.dtmf.received"]  # GPT-Live's own event, as the SDK types it
        await call.end()
        return early, run, hashed, replay

    early, run, hashed, replay = asyncio.run(go())
    assert early == []
    assert run == [AddUserText("The caller pressed 4 2 on the keypad.")]
    assert hashed[1:] == [AddUserText("The caller pressed 7 # on the keypad.")]
    assert replay == ["4", "2", "7", "#"]


def test_stop_ends_the_call_at_once_and_a_start_for_another_call_is_refused():
    async def go():
        call = Call()
        stop = {"event": "stop", "streamSid": STREAM, "stop": {"accountSid": "AC1", "callSid": "CA1"}}
        await call.say(CONNECTED, START, json.dumps(stop))
        await asyncio.wait_for(call.task, 1)
        stopped = call.link.closed, call.tandem.closed

        other = Call()
        other.carrier.expected_call = "CA-the-token-was-for"
        await other.say(CONNECTED, START)
        await asyncio.wait_for(other.task, 1)
        return stopped, other.link.closed, other.tandem.closed

    (stopped, freed), refused, refused_freed = asyncio.run(go())
    assert stopped[0] == 1000 and freed
    assert refused[0] == 1008 and "another call" in refused[1] and refused_freed


class Band:
    """A sideband's queue, as server/live/sideband.py's `Sideband` is to the carrier."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.ended = False

    def put(self, event: dict, droppable: bool) -> None:
        self.events.append(event)

    def end(self) -> None:
        self.ended = True

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]


def test_a_call_the_realtime_call_control_accepted_runs_the_realtime_api_on_its_line():
    """The accept's body configures a Realtime session; the caller's audio is its input, a response's audio goes
    down the line (never as deltas), its events reach the call's sidebands as the SDK types them (the line
    carries none); a key press is `input_audio_buffer.dtmf_event_received`; a sideband's bad event is
    answered to it alone."""
    accept = {"type": "realtime", "model": "gpt-realtime", "instructions": "You answer the phone.",
              "audio": {"output": {"voice": "marin"}}}

    async def go():
        call = Call(realtime=accept, idle_timeout_s=600)
        await call.say(CONNECTED, START)
        watching, other = Band(), Band()
        replayed = call.carrier.replayed()
        call.carrier.sidebands.update((watching, other))
        await call.say(*[media(0.02)] * 8)  # 160 ms of the caller's audio
        call.tandem.emit(AssistantAudio(9, FRAME_PCM, True, 0.1),  # quiet: no response, the line goes on
                         AssistantText(10, " Hello"), AssistantAudio(10, np.full(1920, 0.1, np.float32), True, 0.1))
        await settle()
        line = events(call.sent())
        await call.say(dtmf("5"))
        call.carrier.steer(json.dumps({"type": "session.update", "session": {"instructions": "Be brief."}}), watching)
        call.carrier.steer(json.dumps({"type": "input_audio_buffer.commit", "event_id": "ev1"}), watching)
        call.carrier.steer(json.dumps({"type": "transport.dtmf.send", "event": "x", "event_id": "ev2"}), watching)
        heard = call.tandem.heard_samples
        call.carrier.steer(json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA", "event_id": "ev3"}),
                           watching)  # the caller's line is the input: a sideband appends none
        assert call.tandem.heard_samples == heard
        call.tandem.emit(*[AssistantText(20 + i, " word") for i in range(80)])  # more events than a replay holds
        await settle()
        late = call.carrier.replayed()  # what a sideband attaching now gets first
        await call.end()
        return call, replayed, watching, other, line, late

    call, replayed, watching, other, line, late = asyncio.run(go())
    assert [e["type"] for e in late[:2]] == ["session.created", "session.updated"] and len(late) > 64
    assert late[1]["session"]["instructions"] == "Be brief."  # the latest configuration
    assert [e["type"] for e in replayed] == ["session.created", "session.updated"]
    session = REALTIME_EVENT.validate_python(replayed[1]).session
    assert session.instructions == "You answer the phone."
    assert call.tandem.heard_samples == 8 * 480  # 20 ms each at 24 kHz, through the phone band
    assert line == ["media", "mark 1", "media", "mark 2"]  # a quiet frame, then the response's
    sent = [m for m in map(json.loads, call.link.sent) if m["event"] == "media"]
    assert set(base64.b64decode(sent[0]["media"]["payload"])) == {0xFF}  # mu-law's silence
    assert len(set(base64.b64decode(sent[1]["media"]["payload"]))) > 1  # the response's audio
    assert "response.output_audio.delta" not in watching.types()  # the line carries the audio
    assert {"response.created", "response.output_audio_transcript.delta"} <= set(watching.types())
    typed = [REALTIME_EVENT.validate_python(e) for e in watching.events]
    digits = [e for e in typed if e.type == "input_audio_buffer.dtmf_event_received"]
    assert [d.event for d in digits] == ["5"] and digits[0].received_at > 1_700_000_000
    updated = [e.session.instructions for e in typed if e.type == "session.updated"]
    assert updated == ["Be brief."]
    errors = [e.error for e in typed if e.type == "error"]
    # with server VAD the server commits; a media stream's line cannot press keys (a SIP call's can)
    assert [(e.event_id, e.code) for e in errors] == [("ev1", "invalid_request"), ("ev2", "unsupported"),
                                                      ("ev3", "invalid_request")]
    assert "error" not in other.types() and "session.updated" in other.types()
    assert watching.ended and other.ended  # the call's end ends its sidebands
