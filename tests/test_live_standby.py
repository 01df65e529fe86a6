"""GPT-Live's standby over WebRTC: the mapping pauses an idle session on its clock (no audio pushed,
no silence fed: the engine steps the slot no more), keeps the last of what it hears, and on the wake
pushes that and says `session.resumed`; the usage splits paused seconds from active ones. Silero
tells speech from silence on real audio; and end to end, a real aiortc peer's session pauses after
its idle timeout and wakes on the question, whose first words are transcribed."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from openai.types.live import SessionConfig
from openai.types.live.connect_server_event import ConnectServerEvent
from pydantic import TypeAdapter

from kame.asr.vad import silero_session
from kame.commands import PushAudio
from kame.session_events import AssistantText, Transcript
from server.live.client_events import LiveError
from server.live.standby import PREROLL_S, SpeechDetector
from server.live.webrtc import parse_offer
from tests.test_live_mapping import NOISE, Rig

FRAME_PCM = NOISE  # 80 ms of audio
CONNECT_EVENT = TypeAdapter(ConnectServerEvent)  # the WebRTC connection's events (session.paused is there)


class WebRTCRig(Rig):
    def check(self, event: dict) -> None:
        CONNECT_EVENT.validate_python(event)


def webrtc_rig(idle_timeout_s: int = 5, threshold: float | None = None) -> WebRTCRig:
    rig = WebRTCRig(transport="webrtc", usage_interval_s=100.0)
    rig.mapping.start(SessionConfig(model="gpt-live-1"), rig.now)
    rig.mapping.stand_by(idle_timeout_s, threshold, rig.now)
    rig.events()
    return rig


def pushed(rig: Rig) -> int:
    calls = rig.of(PushAudio)
    rig.calls.clear()
    return sum(len(c.pcm) for c in calls)


def talk(rig: Rig, frames: int) -> None:
    """The client's audio in real time (no silence is fed: it keeps up)."""
    for _ in range(frames):
        rig.mapping.on_audio(FRAME_PCM)
        rig.time(0.08)


def test_an_idle_session_pauses_stops_pushing_and_wakes_with_what_it_kept():
    rig = webrtc_rig(idle_timeout_s=2)
    assert rig.mapping.wake_at() == pytest.approx(rig.now + 0.3)  # silence first, the pause at 2 s
    talk(rig, 24)  # 1.92 s of the user's audio, no words (no activity)
    assert rig.types() == [] and pushed(rig) == 24 * 1920
    talk(rig, 2)
    assert rig.types() == ["session.paused"] and rig.mapping.paused
    assert pushed(rig) == 1920  # the frame before the pause
    paused_at = rig.now - 0.08
    talk(rig, 50)  # 4 s paused: nothing reaches the session, no silence fed
    assert pushed(rig) == 0 and rig.types() == []
    assert rig.mapping.wake_at() == rig.mapping._next_usage  # only the usage report is due
    rig.mapping.wake(rig.now)
    assert rig.types() == ["session.resumed"] and not rig.mapping.paused
    kept_s = pushed(rig) / 24000
    assert kept_s == pytest.approx(PREROLL_S, abs=0.08)  # the last 0.6 s heard, pushed at once
    talk(rig, 5)
    assert pushed(rig) == 5 * 1920  # no silence fed to "catch up" on the pause: the clock stood still
    rig.now += 0.5
    rig.send(type="session.close")
    closed = [e for e in rig.events() if e["type"] == "session.closed"][0]
    usage = closed["usage"]
    assert usage["seconds"] == usage["active_seconds"] + usage["paused_seconds"]
    # woken 0.9 s (talk + 0.5) before the close; what it kept was heard, not paused
    assert usage["paused_seconds"] == int(rig.now - paused_at - 0.9 - kept_s)


def test_the_clock_stays_on_time_across_pauses_and_wakes():
    """The audio kept while paused counts once, as heard (not also as paused time): after three pauses and
    wakes the session's clock is still the wall clock, and a stalled track gets silence after 0.3 s."""
    rig = webrtc_rig(idle_timeout_s=2)
    for _ in range(3):
        talk(rig, 30)  # paused at 2 s
        assert rig.mapping.paused
        talk(rig, 20)
        rig.mapping.wake(rig.now)
        talk(rig, 1)
    assert abs(rig.mapping._clock() - rig.now) < 0.08
    pushed(rig)
    for _ in range(12):  # the track stalls ~1 s
        rig.time(0.08)
    assert pushed(rig) >= 0.6 * 24000


def test_the_usage_counts_paused_time_as_the_clock_does():
    """The usage report's paused seconds are the time the session's audio clock stood still: the wall time
    less the audio heard. The 0.6 s kept before each wake is heard (it was counted paused too: three wakes
    put the report's paused time ~1.9 s over the clock's)."""
    rig = webrtc_rig(idle_timeout_s=2)
    start, heard = rig.now, 0
    for _ in range(3):
        talk(rig, 30)  # paused at 2 s
        talk(rig, 20)
        rig.mapping.wake(rig.now)
        talk(rig, 1)
        heard += pushed(rig)
    rig.send(type="session.close")
    usage = next(e for e in rig.events() if e["type"] == "session.closed")["usage"]
    stood_still = rig.now - start - heard / 24000
    assert stood_still == pytest.approx(3 * (2.0 - PREROLL_S), abs=0.3)
    assert abs(usage["paused_seconds"] - stood_still) < 1  # whole seconds
    assert usage["seconds"] == usage["active_seconds"] + usage["paused_seconds"]


def test_what_a_sideband_reflects_is_the_audio_as_it_came_muted_or_paused():
    """`Heard` (a sideband's session.input_audio.append) is the user's audio before muting and while paused;
    what the session gets is zeros while muted and nothing while paused; fed silence is not heard."""
    from server.live.actions import Heard

    rig = webrtc_rig(idle_timeout_s=2)
    rig.send(type="session.input_audio.mute")
    talk(rig, 1)
    (heard,) = rig.of(Heard)
    assert np.array_equal(heard.pcm, FRAME_PCM)
    (muted,) = rig.of(PushAudio)
    assert len(muted.pcm) == len(FRAME_PCM) and not muted.pcm.any()
    rig.send(type="session.input_audio.unmute")
    talk(rig, 29)  # paused at 2 s
    assert rig.mapping.paused
    rig.of(Heard)
    rig.calls.clear()
    talk(rig, 3)
    assert len(rig.of(Heard)) == 3 and rig.of(PushAudio) == []
    rig.mapping.wake(rig.now)
    rig.of(Heard)
    rig.calls.clear()
    for _ in range(12):  # the track stalls: silence is fed, and not heard
        rig.time(0.08)
    assert rig.of(PushAudio) and rig.of(Heard) == []


def test_words_either_way_and_client_events_keep_it_active():
    rig = webrtc_rig(idle_timeout_s=2)
    talk(rig, 20)
    rig.mapping.on_session(Transcript(False, "hello", 1.0, 1.5, 0.1), rig.now)  # the user's words
    talk(rig, 20)
    rig.mapping.on_session(AssistantText(40, "Hi"), rig.now)  # the assistant speaking
    talk(rig, 20)
    rig.send(type="session.thinking.append", delegation_id=None, content="")
    talk(rig, 20)
    assert "session.paused" not in rig.types()
    talk(rig, 6)
    assert "session.paused" in rig.types()


def test_no_standby_without_a_timeout_and_the_wake_policy_is_checked():
    rig = Rig(transport="webrtc")
    rig.mapping.start(SessionConfig(model="gpt-live-1"), rig.now)
    rig.mapping.stand_by(None, 0.9, rig.now)
    assert rig.mapping.standby is None
    offer = {"transport": {"type": "webrtc", "sdp": "v=0"}, "session": {"model": "gpt-live-1"}}
    with_media = {**offer, "session": {**offer["session"], "idle_timeout_s": 30,
                                       "wake_policy": {"type": "speech", "vad_threshold": 0.7}}}
    assert parse_offer(with_media)[2] == {"idle_timeout_s": 30, "wake_policy": {"type": "speech", "vad_threshold": 0.7}}
    for bad, param in (({"type": "speech", "vad_threshold": 1.5}, "session.wake_policy.vad_threshold"),
                       ({"type": "speech", "vad_threshold": "high"}, "session.wake_policy.vad_threshold"),
                       ({"type": "noise"}, "session.wake_policy.type")):
        with pytest.raises(LiveError) as caught:
            parse_offer({**offer, "session": {**offer["session"], "wake_policy": bad}})
        assert caught.value.param == param


def test_silero_hears_the_question_and_not_silence_or_hum(voices):
    speech = voices["france"]
    session = silero_session()
    quiet = SpeechDetector(session, 0.5)
    hum = 0.05 * np.sin(2 * np.pi * 60 * np.arange(24000) / 24000).astype(np.float32)
    assert not any(quiet(chunk) for chunk in np.split(np.concatenate([np.zeros(24000, np.float32), hum]), 25))
    hearing = SpeechDetector(session, 0.5)
    heard = [hearing(chunk) for chunk in np.array_split(speech[:24000 * 3], 60)]
    assert any(heard)
    first = heard.index(True)
    assert first * 0.05 < PREROLL_S + 0.5  # decided soon enough after the start of the words for the preroll


@pytest.mark.slow
def test_a_webrtc_session_pauses_when_idle_and_the_question_wakes_it(tandem_server, voices):
    """A real peer: silence past idle_timeout_s pauses the session (its slot stepped no more), the
    question resumes it, and the transcript has the question's first words."""
    from client.live_client import LiveWebRTC

    url, services = tandem_server
    speech = voices["france"]
    silence = np.zeros(1920, np.float32)

    async def scenario():
        events: list[dict] = []
        client = await LiveWebRTC.connect(url, session={"model": "gpt-live-1", "idle_timeout_s": 1,
                                                        "wake_policy": {"type": "speech", "vad_threshold": 0.5}})
        client.channel.on("message", lambda message: events.append(json.loads(message)))
        audio = asyncio.create_task(anext(client.audio(), None))
        loop = asyncio.get_running_loop()
        start = loop.time()

        said = 0

        async def say(pcm: np.ndarray) -> None:  # the microphone only (no probes: a client event is activity)
            nonlocal said
            for index in range(len(pcm) // 1920):
                await asyncio.sleep(max(0.0, start + said * 0.08 - loop.time()))
                client.microphone.say(pcm[index * 1920:(index + 1) * 1920])
                said += 1

        await say(np.tile(silence, 30))  # 2.4 s of silence: paused after 1 s
        runner = services.runtime.runner
        types = [e["type"] for e in events]
        stepped_before = runner.stats.frames_stepped
        await say(np.tile(silence, 10))
        stepped_paused = runner.stats.frames_stepped
        await say(speech)
        await say(np.tile(silence, 40))
        await client.close()
        audio.cancel()
        return types, events, stepped_before, stepped_paused

    types_then, events, stepped_before, stepped_paused = asyncio.run(scenario())
    assert "session.paused" in types_then, sorted(set(types_then))
    assert stepped_paused == stepped_before  # 0.8 s paused: not one step of its slot
    kinds = [e["type"] for e in events]
    assert kinds.index("session.resumed") > kinds.index("session.paused")
    words = "".join(e["delta"] for e in events if e["type"] == "session.input_transcript.delta")
    assert "capital" in words.lower(), words  # "What is the capital of France?": the first words kept
