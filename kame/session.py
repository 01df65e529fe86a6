"""The tandem session: one conversation of the front-end and its backend, knowing no transport.

    PCM in -> frames -> engine slot (generation-stamped) -> assistant audio and text out
           -> ASR stream -> transcripts -> planner -> LLM streams -> oracle updates -> the slot

A transport (the Moshi websocket, the Realtime API, a replica, an in-process loop) opens one,
pushes the user's PCM, and reads typed events (`kame.session_events`) from `async for`.
Observers (metrics, a recorder) see every event as it happens, whatever the reader's pace.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from typing import Literal

import numpy as np

from kame.asr import NoAsr, hears, open_stream_in
from kame.asr.events import FinalTranscript
from kame.asr.feed import AsrFeed
from kame.backend.language import LanguageError, language_named
from kame.backend.llm import LLMClient
from kame.backend.planner import Planner
from kame.clock import Clock, MonotonicClock
from kame.codec import FrameSplitter
from kame.commands import (
    AddContext,
    AddUserText,
    Configure,
    PushAudio,
    RequestAttempt,
    SessionCommand,
    SetOracleDelay,
    TruncateAssistant,
    UseLLM,
)
from kame.engine_events import FrameEvents
from kame.errors import EngineError, SessionError, SlotsBusy
from kame.frontend.engine import FrameOutput
from kame.frontend.oracle import OracleUpdate
from kame.frontend.persona import persona_prompt
from kame.latency import LatencyTracker
from kame.queues import post
from kame.runtime import Runtime
from kame.session_config import SessionConfig
from kame.session_events import AsrFailed, AssistantText, BackendChanged, SessionEvent, SessionFailed, Transcript
from kame.session_outlet import EventOutlet
from kame.tools.base import Tool
from kame.tools.toolbox import ToolBox

logger = logging.getLogger(__name__)


class TandemSession:
    """One conversation. Open with `await TandemSession.open(...)`, end with `aclose()`."""

    def __init__(self, runtime: Runtime, config: SessionConfig, observers=(), session_id: str | None = None,
                 clock: Clock | None = None) -> None:
        self.runtime, self.config = runtime, config
        self.clock = clock or MonotonicClock()  # timers, latency and the oracle lead read it
        self.id = session_id or uuid.uuid4().hex[:12]
        self.backend = runtime.profile_named(config.backend or runtime.default_profile)
        try:  # the front-end's sampling for this session: the checkpoint's, with what it asked for
            self.sampling = runtime.engine.sampler.default.updated(config.sampling)
        except ValueError as exc:
            raise SessionError(str(exc)) from exc
        try:  # its language: one the planner can think in and the ASR can hear, or no slot is taken
            self.language = language_named(config.language, runtime.language)
        except LanguageError as exc:
            raise SessionError(str(exc)) from exc
        if config.asr and (why := hears(runtime.asr, self.language.code)):
            raise SessionError(why)
        self._loop = asyncio.get_running_loop()
        self._outputs: asyncio.Queue[FrameOutput | BaseException] = asyncio.Queue()
        self._events = EventOutlet(observers, config.output_frames, self.id)
        self._splitter = FrameSplitter()
        self._frames = FrameEvents(runtime.frontend.tokenizer)
        self._timing = LatencyTracker(self.clock)
        self.frames_in = self.frames_out = 0
        self._closed = False
        self.handle = None
        self.planner: Planner | None = None
        self._asr: AsrFeed | None = None
        self._main: asyncio.Task | None = None
        self._group: asyncio.TaskGroup | None = None

    # ---------------------------------------------------------------- lifecycle

    @classmethod
    async def open(cls, runtime: Runtime, config: SessionConfig | None = None, observers=(),
                   session_id: str | None = None, clock: Clock | None = None) -> TandemSession:
        """Take an engine slot (SlotsBusy when none is free) and start listening; `clock`: the
        session's time (the real monotonic one by default, a ManualClock in tests)."""
        config = config or SessionConfig()
        session = cls(runtime, config, observers, session_id, clock)
        if runtime.runner.free_slots <= 0:
            raise SlotsBusy(f"all {runtime.engine.batch_size} session slots are busy; try again later")
        on_output = session._on_output_threadsafe  # a frame's output, or the engine's error on the slot
        prompt = persona_prompt(runtime.frontend, config.persona, config.voice, runtime.voices)
        session.handle = await runtime.runner.acquire_async(on_output, on_output, live=config.realtime,
                                                            sampling=session.sampling, prompt=prompt)
        try:
            session._start()
        except BaseException:
            session.handle.release()
            raise
        return session

    def _start(self) -> None:
        runtime = self.runtime
        stream = open_stream_in(runtime.asr, self.language.code) if self.config.asr else NoAsr().open_stream()
        self._asr = AsrFeed(stream, self.clock, self.config.asr_stall_s, self._asr_failed, enabled=self.config.asr)
        planner_config = dataclasses.replace(runtime.planner, language=self.language.code)
        if self.config.system_prompt is not None:
            planner_config = dataclasses.replace(planner_config, system_prompt=self.config.system_prompt)
        tools = ToolBox.of(runtime.session_tools(), spawn=self._spawn)
        self.planner = Planner(runtime.llm(self.backend), runtime.frontend.tokenizer, self._send_oracle,
                               self._emit, planner_config, self.clock, spawn=self._spawn, tools=tools,
                               knowledge=runtime.knowledge)
        self._main = self._loop.create_task(self._run(), name=f"session-{self.id}")
        logger.info("session %s started (slot %d, generation %d, backend %s)", self.id, self.handle.slot,
                    self.handle.generation, self.backend)

    def _spawn(self, coro, name: str) -> asyncio.Task:
        """Start a task of the planner inside this session's TaskGroup."""
        if self._group is None:
            coro.close()
            raise SessionError("the session is not running")
        return self._group.create_task(coro, name=f"session-{self.id}-{name}")

    async def _run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tasks:
                self._group = tasks
                tasks.create_task(self._engine_events(), name=f"session-{self.id}-engine")
                tasks.create_task(self._asr_events(), name=f"session-{self.id}-asr")
                tasks.create_task(self._asr.watch(), name=f"session-{self.id}-asr-watch")
                if self.config.stats_interval_s:
                    tasks.create_task(self._stats(), name=f"session-{self.id}-stats")
        except* _SlotFailed as group:
            logger.error("session %s: the engine failed on its slot: %s", self.id, group.exceptions[0])
            self._emit(SessionFailed("engine", f"the engine failed: {group.exceptions[0].__cause__}"))
        except* Exception:
            logger.exception("session %s failed", self.id)
            self._emit(SessionFailed("internal", "internal error"))
        finally:
            self._group = None
            self._events.end()

    async def aclose(self) -> None:
        """End the session: LLM streams and ASR first, then the slot goes back, clean."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._main is not None:  # nothing is consumed any more: no transcript reaches the planner
                self._main.cancel()
                await asyncio.gather(self._main, return_exceptions=True)
            if self.planner is not None:
                await self.planner.aclose()
            if self._asr is not None:
                await self._asr.aclose()
        finally:  # even when this close is itself cancelled: the slot must go back
            released = self.handle.release() if self.handle is not None else None
            self._events.end()
        if released is not None:
            with contextlib.suppress(EngineError):  # a runner that stopped has no slot to give back
                await asyncio.wrap_future(released)
        logger.info("session %s ended after %d frames", self.id, self.frames_in)

    async def __aenter__(self) -> TandemSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        return self._closed

    # ---------------------------------------------------------------- inputs

    def push_pcm(self, pcm: np.ndarray) -> None:
        """The user's audio, float32 at 24 kHz, any chunk size; never blocks."""
        if self._closed:
            raise SessionError("the session is closed")
        pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
        if not len(pcm):
            return
        if not np.isfinite(pcm).all():
            raise SessionError("audio holds NaN or infinite samples")
        self._events.heard(pcm)
        self._asr.push_pcm(pcm)
        frames = self._splitter.push(pcm)
        self._timing.audio_in(len(pcm), len(frames))
        for frame in frames:
            self.handle.push_frame(frame)
            self.frames_in += 1

    async def flush(self) -> None:
        """The user stopped sending: complete the last frame with silence, finish the utterance."""
        if self._closed:
            return
        self.push_pcm(self._splitter.padding())
        await self._asr.flush()

    def add_user_text(self, text: str) -> None:
        """A user message typed rather than spoken: the LLM sees it, and answers it through the
        oracle, as if it had been said now."""
        if self._closed:
            raise SessionError("the session is closed")
        text = " ".join(str(text).split())
        if not text:
            raise SessionError("an empty user message")
        audio_s = self._timing.audio_s
        self._timing.user_stopped()  # the oracle lead of its answer counts from now, the end of the user's input
        self.planner.on_transcript(FinalTranscript(text, audio_s, audio_s))

    def truncate_assistant(self, said: str, heard: str) -> bool:
        """Only `heard` of the assistant's words `said` reached the user: the history keeps that."""
        return self.planner.truncate_assistant(said, heard)

    def set_client_tools(self, tools: list[Tool], tool_choice: str | dict | None = None) -> None:
        """The tools a client declared (Realtime functions, GPT-Live function tools), replacing those it
        declared before; the server's own tools stay, and a client tool named like one of them is left out.
        `tool_choice`: how the backend's first round may call tools (None: as the model decides)."""
        self.planner.set_tool_choice(tool_choice)
        clashes = self.planner.tools.set_client_tools(tools)
        if clashes:
            logger.warning("session %s: the client's tools %s are named like the server's own, which stay",
                           self.id, ", ".join(clashes))

    def set_oracle_delay(self, seconds: float) -> None:
        """Hold oracle updates back this long from now on (latency experiments)."""
        if not 0 <= seconds <= 30:
            raise SessionError("the oracle delay must be between 0 and 30 seconds")
        self.config = dataclasses.replace(self.config, oracle_delay_s=float(seconds))

    def configure(self, backend: str | None = None, system_prompt: str | None = None) -> BackendChanged:
        """Switch the LLM backend profile and/or the system prompt; the front-end is untouched."""
        if backend is not None and self.runtime.profile_named(backend) != self.backend:
            self.backend = backend
            self.planner.set_llm(self.runtime.llm(backend))
        if system_prompt is not None:
            self.planner.set_system_prompt(system_prompt)
        event = BackendChanged(self.backend, self.runtime.profiles[self.backend].model, self.planner.system_prompt)
        self._emit(event)
        return event

    def add_context(self, role: Literal["user", "assistant", "context"], text: str) -> None:
        """A line the conversation gains without speech: earlier history (`user`, `assistant`) or the
        application's silent context (`context`), which every later attempt reads."""
        self.planner.add_context(role, text)

    def request_attempt(self) -> None:
        """Start an LLM attempt now (within the rate limit) on the conversation as it is."""
        self.planner.request_attempt()

    def use_llm(self, llm: LLMClient) -> None:
        """The backend becomes `llm` (not a profile: a client answering as the LLM); `configure` with a
        profile switches back."""
        self.planner.set_llm(llm)

    @property
    def system_prompt(self) -> str:
        return self.planner.system_prompt

    @property
    def conversation(self) -> list[str]:
        """The conversation as the LLM reads it, a line per turn."""
        return self.planner.conversation

    @property
    def tools_on(self) -> bool:
        """Tools are offered to the LLM (some are set, and the backend calls tools)."""
        return self.planner.tools_on

    def apply(self, command: SessionCommand) -> None:
        """Carry out a mapping's command (kame/commands.py) through this API."""
        match command:
            case PushAudio(pcm=pcm):
                self.push_pcm(pcm)
            case Configure(backend=backend, system_prompt=prompt):
                self.configure(backend, prompt)
            case SetOracleDelay(seconds=seconds):
                self.set_oracle_delay(seconds)
            case AddUserText(text=text):
                self.add_user_text(text)
            case TruncateAssistant(said=said, heard=heard):
                self.truncate_assistant(said, heard)
            case AddContext(role=role, text=text):
                self.add_context(role, text)
            case RequestAttempt():
                self.request_attempt()
            case UseLLM(llm=llm):
                self.use_llm(llm)
            case _:
                raise TypeError(f"not a session command: {command!r}")

    # ---------------------------------------------------------------- outputs

    def __aiter__(self) -> EventOutlet:
        """The session's events, in order, until it ends (one reader; observers see them all)."""
        return self._events

    def _emit(self, event: SessionEvent) -> None:
        """Pass an event on (the planner's too): observers, the reader, then the timing it settles."""
        self._events.put(event)
        lead = self._timing.on_event(event)
        if lead is not None:
            self._emit(lead)

    @property
    def dropped_events(self) -> int:
        """Audio frames dropped because the reader fell behind."""
        return self._events.dropped

    # ---------------------------------------------------------------- engine thread -> loop

    def _on_output_threadsafe(self, output: FrameOutput | BaseException) -> None:
        if self._closed:
            return  # a frame that was in the engine when the session ended
        post(self._loop, self._outputs.put_nowait, output)

    async def _engine_events(self) -> None:
        while True:
            output = await self._outputs.get()
            if isinstance(output, BaseException):
                raise _SlotFailed from output
            self.frames_out += 1
            latency, skipped = self._timing.frame_out(self.handle.dropped_frames)
            if skipped is not None:
                self._emit(skipped)
            for event in self._frames.of(output, latency):
                if isinstance(event, AssistantText):  # the planner's history first: what was said
                    self.planner.on_assistant_text(event.text)
                self._emit(event)

    async def _asr_events(self) -> None:
        async for event in self._asr.transcripts():
            final = isinstance(event, FinalTranscript)
            lag = self._timing.lag(event.end_s)  # a final's: the answer comes from a stream started from now on
            backchannel = self.planner.is_backchannel(event)
            self._emit(Transcript(final, event.text, round(event.start_s, 3), round(event.end_s, 3), lag, backchannel,
                                  not final and event.settled))
            if not backchannel:
                self.planner.on_transcript(event)

    def _asr_failed(self, message: str) -> None:
        logger.warning("session %s: %s", self.id, message)
        self._emit(AsrFailed(message))

    async def _stats(self) -> None:
        while True:
            await self.clock.sleep(self.config.stats_interval_s)
            self._emit(self._timing.stats(self.frames_in, self.frames_out, self._events.dropped))

    # ---------------------------------------------------------------- planner -> engine

    def _send_oracle(self, update: OracleUpdate) -> None:
        delay = self.config.oracle_delay_s
        if delay > 0 and self._group is not None:
            self._spawn(self._push_late(update, delay), f"oracle-{update.epoch}-delayed")
        else:
            self.handle.push_oracle(update)

    async def _push_late(self, update: OracleUpdate, delay_s: float) -> None:
        await self.clock.sleep(delay_s)  # updates sent in order wake in order: an append never passes its reset
        self.handle.push_oracle(update)  # a released handle refuses it


class _SlotFailed(Exception):
    """The engine failed stepping this session's slot."""


