"""The tandem session in-process, without a server: events in order, failures visible, bounded output."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kame.asr.events import FinalTranscript, PartialTranscript
from kame.backend.profiles import BackendProfile
from kame.errors import SessionError
from kame.frontend.engine import BatchedEngine, GenerationConfig
from kame.frontend.runner import EngineRunner
from kame.runtime import Runtime, RuntimeSettings
from kame.session import SessionConfig, TandemSession
from kame.session_events import (
    AssistantAudio,
    AssistantText,
    BackendChanged,
    LLMAttempt,
    OracleApplied,
    SessionFailed,
    Transcript,
)
from kame.testing.fakes import FakeLLM, FakeReply, ScriptedAsr

from .conftest import words

SCRIPT = [(0.5, PartialTranscript("what is the capital", 0.0, 0.5)),
          (1.0, FinalTranscript("what is the capital of France", 0.0, 1.0))]


class _BrokenLLM:
    """An LLM client with a bug: it raises something that is not an LLMError."""

    name = "broken"

    async def stream_chat(self, messages):
        raise RuntimeError("a bug in the backend")
        yield  # an async generator

    async def aclose(self) -> None:
        pass


@pytest.fixture
def runtime(tiny_copy):
    profiles = {name: BackendProfile(name, None, f"{name}-model", None) for name in ("fake", "other", "broken")}
    engine = BatchedEngine(tiny_copy, batch_size=2, gen=GenerationConfig(use_sampling=False))
    runner = EngineRunner(engine, clock="eager", batch_window_s=0.0).start()
    rt = Runtime(RuntimeSettings(profiles=profiles, default_profile="fake"), tiny_copy, engine, runner,
                 ScriptedAsr(SCRIPT))
    rt._llms.update(fake=FakeLLM([FakeReply(("Paris is", " the capital", " of France."))]), other=FakeLLM(),
                    broken=_BrokenLLM())
    yield rt
    runner.stop()
    engine.close()


async def _speak(session: TandemSession, seconds: float) -> None:
    """Push `seconds` of audio a frame at a time, faster than real time but not faster than the
    engine steps (beyond `max_pending_frames` queued, a session loses its oldest frames)."""
    for _ in range(int(seconds / 0.08)):
        session.push_pcm(np.zeros(1920, np.float32))
        await asyncio.sleep(0.03)


async def _collect(session: TandemSession, until, limit_s: float = 10.0) -> list:
    got = []
    async with asyncio.timeout(limit_s):
        async for event in session:
            got.append(event)
            if until(got):
                break
    return got


def test_a_session_hears_asks_and_speaks_the_answer(runtime):
    async def scenario():
        async with await TandemSession.open(runtime, SessionConfig(realtime=False)) as session:
            speaking = asyncio.ensure_future(_speak(session, 3.0))
            got = await _collect(session, lambda g: sum(isinstance(e, AssistantAudio) for e in g) >= 37)
            await speaking
        return got, session

    got, session = asyncio.run(scenario())
    transcripts = [e for e in got if isinstance(e, Transcript)]
    assert [(t.final, t.text) for t in transcripts] == [(False, "what is the capital"),
                                                        (True, "what is the capital of France")]
    phases = [(e.epoch, e.phase) for e in got if isinstance(e, LLMAttempt)]
    assert (1, "started") in phases and any(phase == "done" for _, phase in phases)
    resets = [e for e in got if isinstance(e, OracleApplied) and e.op == "reset"]
    assert resets and resets[0].accepted and words(resets[0].text) == ["paris"]  # whole words only
    finished = [e for e in got if isinstance(e, LLMAttempt) and e.phase in ("done", "cancelled")]
    assert any(e.took_oracle and e.oracle_tokens > 0 for e in finished)  # the owner says what it sent
    assert all(e.oracle_tokens == 0 for e in finished if not e.took_oracle)  # only owners send
    said = "".join(e.text for e in got if isinstance(e, AssistantText))
    assert words(said)[:6] == words("Paris is the capital of France")  # tiny-copy repeats its oracle
    frames = [e.frame for e in got if isinstance(e, AssistantAudio)]
    assert frames == list(range(len(frames)))  # one frame out per frame in, in order
    assert session.closed and session.handle.closed
    assert runtime.runner.free_slots == 2  # the slot went back


def test_configure_switches_the_backend_and_refuses_unknown_ones(runtime):
    async def scenario():
        async with await TandemSession.open(runtime) as session:
            reply = session.configure(backend="other", system_prompt="Be brief.")
            with pytest.raises(SessionError, match="unknown backend profile 'nope'"):
                session.configure(backend="nope")
            first = await _collect(session, lambda g: True)
        with pytest.raises(SessionError, match="closed"):
            session.push_pcm(np.zeros(1920, np.float32))
        return reply, first, session

    reply, first, session = asyncio.run(scenario())
    assert reply == BackendChanged("other", "other-model", "Be brief.") and first == [reply]
    assert session.planner.llm is runtime.llm("other")
    with pytest.raises(SessionError, match="unknown backend"):
        asyncio.run(TandemSession.open(runtime, SessionConfig(backend="nope")))


def test_a_bug_in_an_llm_stream_fails_the_session_visibly(runtime):
    """A stream task lives in the session's TaskGroup: a bug there is reported, never lost."""
    async def scenario():
        async with await TandemSession.open(runtime, SessionConfig(backend="broken", realtime=False)) as session:
            speaking = asyncio.ensure_future(_speak(session, 1.5))
            got = await _collect(session, lambda g: False)  # the session ends by itself
            speaking.cancel()
        return got

    got = asyncio.run(scenario())
    assert isinstance(got[-1], SessionFailed) and got[-1].code == "internal"
    assert runtime.runner.free_slots == 2


def test_a_reader_that_falls_behind_loses_audio_frames_only(runtime):
    async def scenario():
        config = SessionConfig(realtime=False, output_frames=8)
        async with await TandemSession.open(runtime, config) as session:
            await _speak(session, 3.0)  # nobody reads meanwhile
            for _ in range(500):  # every frame has come back
                if session.frames_out == session.frames_in:
                    break
                await asyncio.sleep(0.02)
            queued = len(session._events)
            got = await _collect(session, lambda g: len(g) == queued)
        return got, queued, session

    got, queued, session = asyncio.run(scenario())
    kept = [e for e in got if not isinstance(e, AssistantAudio)]
    assert queued <= 8 + len(kept)  # bounded: beyond 8, only what may not be lost is kept
    assert session.dropped_events >= session.frames_out - 8
    assert [e.final for e in kept if isinstance(e, Transcript)] == [False, True]  # transcripts all kept
    assert any(isinstance(e, OracleApplied) for e in kept)


def test_a_close_cut_short_still_gives_the_slot_back(runtime):
    """aclose() cancelled while the ASR stream closes (slow): the slot must not be lost."""
    class _SlowClose(ScriptedAsr):
        def open_stream(self):
            stream = super().open_stream()

            async def slow_close() -> None:
                await asyncio.sleep(5)

            stream.aclose = slow_close
            return stream

    runtime.asr = _SlowClose()

    async def scenario():
        session = await TandemSession.open(runtime)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await session.aclose()
        await session.aclose()  # a second close returns at once
        for _ in range(100):  # the engine thread frees the slot
            if runtime.runner.free_slots == 2:
                break
            await asyncio.sleep(0.02)
        return session

    session = asyncio.run(scenario())
    assert session.handle.closed and runtime.runner.free_slots == 2


def test_a_session_in_a_language_the_asr_cannot_hear_is_refused_before_its_slot(runtime, monkeypatch):
    """A Japanese session on an English-only ASR: a clear error and no slot taken; on one that hears any
    language its planner thinks in Japanese; an unknown language is named; with no language asked, a session
    on a Japanese front-end (J-Moshi) thinks in Japanese, on an English one in English."""
    class _EnglishOnly(ScriptedAsr):
        languages = ("en",)

    async def scenario():
        runtime.asr = _EnglishOnly(SCRIPT)
        with pytest.raises(SessionError, match="hears English only, not Japanese"):
            await TandemSession.open(runtime, SessionConfig(language="ja"))
        assert runtime.runner.free_slots == 2
        with pytest.raises(SessionError, match="'de' is not supported"):
            await TandemSession.open(runtime, SessionConfig(language="de"))
        no_asr = await TandemSession.open(runtime, SessionConfig(language="ja", asr=False))  # nothing to hear
        await no_asr.aclose()
        runtime.asr = ScriptedAsr(SCRIPT)
        languages = []
        for config in (SessionConfig(language="ja"), SessionConfig(), "j-moshi", SessionConfig(language="en")):
            if config == "j-moshi":
                monkeypatch.setattr(runtime.frontend, "language", "ja")
                config = SessionConfig()
            session = await TandemSession.open(runtime, config)
            languages.append((session.planner.language.code, session.planner.system_prompt[:8]))
            await session.aclose()
        return languages

    assert asyncio.run(scenario()) == [("ja", "あなたは音声アシ"), ("en", "You are "), ("ja", "あなたは音声アシ"),
                                       ("en", "You are ")]
    assert runtime.runner.free_slots == 2
