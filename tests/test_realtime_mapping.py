"""The Realtime mapping of continuous speech onto responses, event by event on a fake clock:
bursts, quiet, barge-in, cancel, push-to-talk (turn_detection null), and the beta names."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pytest

from kame.session_events import AssistantAudio, AssistantText, Transcript
from server import realtime
from server.realtime import RealtimeError, RealtimeSession
from server.settings import ServerSettings

NOISE = np.full(1920, 0.1, np.float32)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Tandem:
    """What the mapping calls on the session: recorded."""

    backend = "scripted"

    def __init__(self) -> None:
        self.calls = []

    def truncate_assistant(self, said, heard):
        self.calls.append(("truncate", said, heard))
        return True

    async def flush(self):
        self.calls.append(("flush",))


class Rig:
    def __init__(self, beta: bool = False) -> None:
        services = SimpleNamespace(
            settings=ServerSettings(), metrics=None,
            runtime=SimpleNamespace(asr=SimpleNamespace(name="whisper"), profiles={"scripted": None},
                                    frontend=SimpleNamespace(source="tiny-copy")))
        self.session = RealtimeSession(None, services, "kame", beta)
        self.tandem = Tandem()
        self.frame = 0

    def events(self) -> list[dict]:
        out = []
        while len(self.session._send):
            out.append(json.loads(self.session._send.get_nowait()))
        return out

    def step(self, clock: Clock, text: str | None = None, frames: int = 1) -> None:
        """`frames` output frames of the front-end, the first with `text`."""
        for index in range(frames):
            clock.now += 0.08
            self.session._on_audio(AssistantAudio(self.frame, NOISE, True, 0.01))
            if text and index == 0:
                self.session._on_text(AssistantText(self.frame, text))
            self.frame += 1

    def quiet(self, clock: Clock, seconds: float = 1.0) -> None:
        self.step(clock, frames=int(seconds / 0.08) + 1)

    def hear(self, text: str, final: bool, start_s: float = 1.0, end_s: float = 2.0) -> None:
        self.session._on_transcript(Transcript(final, text, start_s, end_s, 0.1))

    async def send(self, event: dict) -> None:
        await self.session._handlers()[event["type"]](event, self.tandem)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(realtime.time, "monotonic", clock)
    return clock


def types(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]


def test_a_burst_of_speech_is_one_response_and_quiet_closes_it(clock):
    async def go():
        rig = Rig()
        rig.quiet(clock)
        assert rig.events() == []  # quiet frames between responses are not sent
        rig.step(clock, " Paris")
        rig.step(clock, " is", frames=3)
        rig.quiet(clock)
        return rig.events()

    events = asyncio.run(go())
    assert types(events)[:4] == ["response.created", "response.output_item.added", "conversation.item.added",
                                 "response.content_part.added"]
    audio = [e for e in events if e["type"] == "response.output_audio.delta"]
    assert 4 <= len(audio) <= 4 + 8  # the burst's frames, then up to quiet_s of its tail
    done = events[-1]
    assert done["type"] == "response.done" and done["response"]["status"] == "completed"
    assert done["response"]["output"][0]["content"][0]["transcript"] == "Paris is"
    assert types(events).count("response.created") == 1


def test_barge_in_ends_the_response_as_cancelled_once_the_front_end_yields(clock):
    async def go():
        rig = Rig()
        rig.step(clock, " Paris")
        rig.hear("wait", final=False)  # the user starts talking over it
        rig.step(clock, " is")
        rig.quiet(clock)
        return rig.events()

    events = asyncio.run(go())
    started = types(events).index("input_audio_buffer.speech_started")
    assert started < types(events).index("response.done")
    done = events[-1]["response"]
    assert (done["status"], done["status_details"]["reason"]) == ("cancelled", "turn_detected")


def test_cancel_stops_sending_the_rest_of_the_burst(clock):
    async def go():
        rig = Rig()
        rig.step(clock, " one")
        await rig.send({"type": "response.cancel"})
        rig.events()
        rig.step(clock, " two", frames=3)  # the model goes on: full duplex, it yields by itself
        muted = rig.events()
        rig.quiet(clock)
        rig.step(clock, " three")  # a new burst after quiet is a new response
        return muted, rig.events()

    muted, after = asyncio.run(go())
    assert muted == []
    assert types(after)[0] == "response.created"


def test_push_to_talk_keeps_what_the_model_said_for_response_create(clock):
    async def go():
        rig = Rig()
        await rig.send({"type": "session.update", "session": {"type": "realtime",
                                                             "audio": {"input": {"turn_detection": None}}}})
        rig.events()
        rig.hear("what is", final=False)
        rig.step(clock, " Paris")
        rig.step(clock, " is", frames=2)
        rig.hear("what is the capital of France", final=True)
        assert "input_audio_buffer.speech_started" not in types(rig.events())  # no server VAD events
        await rig.send({"type": "input_audio_buffer.commit"})
        committed = rig.events()
        await rig.send({"type": "response.create"})  # while the model is still speaking
        released = rig.events()
        rig.step(clock, " capital")
        rig.quiet(clock)
        return committed, released, rig.events()

    committed, released, live = asyncio.run(go())
    assert types(committed)[:2] == ["input_audio_buffer.committed", "conversation.item.added"]
    done = next(e for e in committed if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert done["transcript"] == "what is the capital of France"
    assert types(released)[0] == "response.created"
    assert [e["delta"] for e in released if e["type"] == "response.output_audio_transcript.delta"] == [" Paris", " is"]
    # the kept frames at once: those after the one whose text opened the burst (audio lags text)
    assert sum(e["type"] == "response.output_audio.delta" for e in released) == 2
    assert live[-1]["type"] == "response.done"
    assert live[-1]["response"]["output"][0]["content"][0]["transcript"] == "Paris is capital"


def test_a_response_create_nobody_answers_ends_empty(clock):
    async def go():
        rig = Rig()
        await rig.send({"type": "response.create"})
        with pytest.raises(RealtimeError, match="in progress"):
            await rig.send({"type": "response.create"})
        rig.quiet(clock, seconds=6)
        return rig.events()

    events = asyncio.run(go())
    assert types(events) == ["response.created", "response.done"]
    assert events[-1]["response"]["output"] == []


def test_truncate_keeps_what_the_user_heard(clock):
    async def go():
        rig = Rig()
        rig.step(clock, " Paris")
        rig.step(clock, " is", frames=3)
        rig.step(clock, " lovely", frames=3)
        rig.quiet(clock)
        item_id = next(e for e in rig.events() if e["type"] == "response.done")["response"]["output"][0]["id"]
        await rig.send({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                        "audio_end_ms": 200})
        return rig.events(), rig.tandem.calls

    events, calls = asyncio.run(go())
    assert events[-1] == events[-1] | {"type": "conversation.item.truncated", "audio_end_ms": 200}
    assert calls == [("truncate", "Paris is lovely", "Paris is")]


def test_beta_clients_get_beta_names(clock):
    async def go():
        rig = Rig(beta=True)
        rig.step(clock, " Paris")
        rig.quiet(clock)
        return types(rig.events())

    names = asyncio.run(go())
    assert "response.audio.delta" in names and "response.audio_transcript.done" in names
    assert "conversation.item.created" in names and "response.output_audio.delta" not in names


CRASHERS = [  # shapes no field check foresaw once ended the whole session (found by review)
    {"type": "session.update", "session": {"output_modalities": True}},
    {"type": "session.update", "session": {"modalities": 1.5}},
    {"type": "session.update", "session": {"audio": "x"}},
    {"type": "session.update", "session": {"audio": {"input": 5}}},
    {"type": "session.update", "session": {"audio": {"input": ["turn_detection"]}}},
    {"type": "session.update", "session": {"audio": {"output": "voice"}}},
    {"type": "session.update", "session": {"tools": True}},
    {"type": "session.update", "session": {"tools": "abc"}},
    {"type": "session.update", "session": {"kame": {"backend": ["scripted"]}}},
    {"type": "session.update", "session": {"kame": {"events": "false"}}},
    {"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "server_vad", "create_response": "false"}}}}},
    {"type": "conversation.item.create", "item": {"id": {"a": 1}, "type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "hi"}]}},
    {"type": "conversation.item.truncate", "item_id": [], "content_index": 0, "audio_end_ms": 0},
    {"type": "conversation.item.retrieve", "item_id": {"x": 1}},
    {"type": "response.create", "response": {"metadata": {"k": 1}}},
]


def test_every_odd_shape_is_a_realtime_error_never_a_crash():
    async def go():
        rig = Rig()
        outcomes = []
        for event in CRASHERS:
            try:
                await rig.session._on_message({"text": json.dumps(event)}, rig.tandem)
                outcomes.append("accepted")
            except RealtimeError as exc:
                outcomes.append(exc.code)
        for text in ("[" * 100000, '{"type": "session.update", "session": {"kame": {"quiet_s": NaN}}}'):
            with pytest.raises(RealtimeError, match="not JSON"):
                await rig.session._on_message({"text": text}, rig.tandem)
        return outcomes, rig

    outcomes, rig = asyncio.run(go())
    assert outcomes == ["invalid_value"] * len(CRASHERS[:-4]) + [
        "invalid_value", "item_truncate_invalid_item_id", "item_retrieve_invalid_item_id", "invalid_value"]
    assert rig.tandem.calls == []  # the bad item never reached the conversation


def test_the_playing_item_can_be_truncated_at_a_barge_in(clock):
    """What Pipecat does on speech_started: truncate the item still being spoken."""
    async def go():
        rig = Rig()
        rig.step(clock, " Paris")
        rig.step(clock, " is", frames=3)
        item_id = next(e for e in rig.events() if e["type"] == "response.output_item.added")["item"]["id"]
        await rig.send({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                        "audio_end_ms": 80})
        closing = rig.events()
        rig.step(clock, " the", frames=2)  # the model goes on a moment: not sent
        return closing, rig.events(), rig.tandem.calls

    closing, after, calls = asyncio.run(go())
    done = next(e for e in closing if e["type"] == "response.done")["response"]
    assert (done["status"], done["status_details"]["reason"]) == ("cancelled", "turn_detected")
    assert closing[-1]["type"] == "conversation.item.truncated"
    assert calls == [("truncate", "Paris is", "Paris is")]  # both pieces came within the first 80 ms
    assert after == []


def test_response_done_has_a_usage_object_and_echoes_metadata(clock):
    async def go():
        rig = Rig()
        await rig.send({"type": "response.create", "response": {"metadata": {"client_event_id": "abc"}}})
        rig.step(clock, " Paris")
        rig.quiet(clock)
        return rig.events()

    events = asyncio.run(go())
    created = events[0]["response"]
    done = next(e for e in events if e["type"] == "response.done")["response"]
    assert created["metadata"] == done["metadata"] == {"client_event_id": "abc"}
    assert created["usage"] is None and done["usage"]["input_tokens"] == 0


def test_push_to_talk_transcripts_keep_one_item_id_and_a_stale_burst_is_not_the_answer(clock):
    async def go():
        rig = Rig()
        await rig.send({"type": "session.update", "session": {"type": "realtime",
                                                             "audio": {"input": {"turn_detection": None}}}})
        rig.step(clock, " mm-hm")  # a backchannel while the user talks, nobody asked for it
        rig.quiet(clock)
        rig.hear("what is", final=False)
        rig.hear("what is the capital", final=True)
        await rig.send({"type": "input_audio_buffer.commit"})
        await rig.send({"type": "response.create"})
        return rig.events()

    events = asyncio.run(go())
    delta = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.delta")
    committed = next(e for e in events if e["type"] == "input_audio_buffer.committed")
    assert delta["item_id"] == committed["item_id"]
    assert types(events)[-1] == "response.created"  # waiting for the answer, not releasing "mm-hm"
    assert "response.output_audio_transcript.delta" not in types(events)


def test_silence_is_fed_only_when_the_clients_audio_falls_behind_the_clock(clock):
    async def go():
        rig = Rig()
        session = rig.session
        clock.now += 0.5  # the grace for configuring the session
        fed = []
        for _ in range(4):  # a client sending 1 s chunks in real time: never padded
            session._pushed_s += 1.0
            for _tick in range(12):
                clock.now += 1 / 12
                fed.append(session._silence_due())
        streaming = sum(fed)
        clock.now += 1.0  # then it stops sending
        waiting = sum(session._silence_due() for _ in range(20))
        return streaming, waiting

    streaming, waiting = asyncio.run(go())
    assert streaming == 0 and waiting >= 8


def test_a_function_output_that_comes_after_its_call_stopped_waiting_is_kept_not_an_error(clock):
    """A call times out (or its attempt is superseded) before the client answers: the late output
    is stored in the conversation, with no error event (some frameworks end their session on one);
    an output for a call never made, or a second one, is still an error."""
    async def go():
        rig = Rig()
        call = asyncio.ensure_future(rig.session.call_client_function("lookup", {"q": "x"}))
        await asyncio.sleep(0)
        sent = rig.events()
        call_id = next(e for e in sent if e["type"] == "response.function_call_arguments.done")["call_id"]
        call.cancel()  # the tool's timeout, or a newer attempt
        await asyncio.gather(call, return_exceptions=True)
        output = {"type": "conversation.item.create",
                  "item": {"type": "function_call_output", "call_id": call_id, "output": "late"}}
        await rig.send(output)
        late = rig.events()
        errors = []
        for event in (output, {"type": "conversation.item.create", "item": {
                "type": "function_call_output", "call_id": "call_never", "output": "x"}}):
            with pytest.raises(RealtimeError) as error:
                await rig.send(event)
            errors.append(error.value)
        return late, errors

    late, errors = asyncio.run(go())
    assert [e["type"] for e in late] == ["conversation.item.added", "conversation.item.done"]
    assert late[0]["item"]["output"] == "late"
    assert all(error.code == "invalid_value" for error in errors)
