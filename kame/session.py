"""The tandem session: one conversation of the front-end and its backend, knowing no transport.

    PCM in -> frames -> engine slot (generation-stamped) -> assistant audio and text out
           -> ASR stream -> transcripts -> planner -> LLM streams -> oracle updates -> the slot

A transport (the Moshi websocket, the Realtime API, a replica, an in-process loop) opens one,
pushes the user's PCM, and reads typed events (`kame.session_events`) from `async for`.
Observers (metrics, a recorder) see every event as it happens, whatever the reader's pace.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import logging
import statistics
import time
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kame.asr import NoAsr
from kame.asr.events import AsrFailure, FinalTranscript
from kame.audio import FRAME_SIZE, SAMPLE_RATE
from kame.backend.planner import Planner, PlannerEvent
from kame.codec import FrameSplitter
from kame.errors import EngineError, SessionError, SlotsBusy
from kame.frontend.engine import FrameOutput
from kame.frontend.oracle import OracleOp, OracleUpdate, PieceDecoder
from kame.queues import DropOldestQueue, post
from kame.runtime import Runtime
from kame.session_events import (
    AsrFailed,
    AssistantAudio,
    AssistantText,
    BackendChanged,
    FramesSkipped,
    LLMAttempt,
    OracleApplied,
    OracleLead,
    SessionEvent,
    SessionFailed,
    SessionStats,
    Transcript,
)
from kame.tools.base import Tool
from kame.tools.toolbox import ToolBox

logger = logging.getLogger(__name__)

_END = object()


@dataclass(frozen=True)
class SessionConfig:
    """How one session runs; the runtime's `session` settings are the defaults."""

    backend: str | None = None  # LLM backend profile; None: the runtime's default
    system_prompt: str | None = None  # None: the planner's configured prompt
    asr: bool = True  # False: no transcripts, no oracle: the front-end alone (plain Moshi)
    oracle_delay_s: float = 0.0  # hold every oracle update back this long (latency experiments)
    realtime: bool = True  # False: audio comes faster than real time on purpose (files): never skipped to live
    output_frames: int = 64  # events buffered for a slow reader; beyond it the oldest audio frame goes
    stats_interval_s: float | None = None  # a SessionStats event this often; None: never
    asr_stall_s: float = 10.0  # the ASR this far behind: go on without it
    sampling: Mapping[str, float | int | str] = dataclasses.field(default_factory=dict)  # over the checkpoint's


class SessionObserver(Protocol):
    """Sees the user's audio and every event when it happens (metrics, recording)."""

    def on_input(self, pcm: np.ndarray) -> None: ...

    def on_event(self, event: SessionEvent) -> None: ...


class TandemSession:
    """One conversation. Open with `await TandemSession.open(...)`, end with `aclose()`."""

    def __init__(self, runtime: Runtime, config: SessionConfig, observers=(), session_id: str | None = None) -> None:
        self.runtime, self.config = runtime, config
        self.id = session_id or uuid.uuid4().hex[:12]
        self.backend = config.backend or runtime.default_profile
        if self.backend not in runtime.profiles:
            raise SessionError(f"unknown backend profile {self.backend!r}; known: {', '.join(runtime.profiles)}")
        try:  # the front-end's sampling for this session: the checkpoint's, with what it asked for
            self.sampling = runtime.engine.sampler.default.updated(config.sampling)
        except ValueError as exc:
            raise SessionError(str(exc)) from exc
        self._observers = list(observers)
        self._loop = asyncio.get_running_loop()
        self._outputs: asyncio.Queue[FrameOutput | BaseException] = asyncio.Queue()
        self._events: DropOldestQueue = DropOldestQueue(config.output_frames)
        self._splitter = FrameSplitter()
        self._pieces = PieceDecoder(runtime.frontend.tokenizer) if runtime.frontend.tokenizer else None
        self._pushed_at: deque[float] = deque()
        self._latencies: deque[float] = deque(maxlen=100)
        self._audio_wall: deque[tuple[float, float]] = deque(maxlen=4000)  # (audio end s, wall time received)
        self._samples_in = 0
        self.frames_in = self.frames_out = self._dropped_seen = 0
        self._reset_applied_at: dict[int, float] = {}
        self._speech_end: float | None = None  # wall time the last final's audio arrived
        self._lead_pending: int | None = None  # the oracle epoch whose application gives the lead
        self._answer_after_epoch: int | None = None  # after a final: streams newer than this answer it
        self._timers: set[asyncio.TimerHandle] = set()
        self._asr_ok = config.asr
        self._closed = False
        self.handle = None
        self.planner: Planner | None = None
        self._asr = None
        self._main: asyncio.Task | None = None
        self._group: asyncio.TaskGroup | None = None

    # ---------------------------------------------------------------- lifecycle

    @classmethod
    async def open(cls, runtime: Runtime, config: SessionConfig | None = None, observers=(),
                   session_id: str | None = None) -> TandemSession:
        """Take an engine slot (SlotsBusy when none is free) and start listening."""
        config = config or SessionConfig()
        session = cls(runtime, config, observers, session_id)
        if runtime.runner.free_slots <= 0:
            raise SlotsBusy(f"all {runtime.engine.batch_size} session slots are busy; try again later")
        session.handle = await runtime.runner.acquire_async(session._on_output_threadsafe,
                                                            session._on_error_threadsafe, live=config.realtime,
                                                            sampling=session.sampling)
        try:
            session._start()
        except BaseException:
            session.handle.release()
            raise
        return session

    def _start(self) -> None:
        runtime = self.runtime
        self._asr = runtime.asr.open_stream() if self.config.asr else NoAsr().open_stream()
        planner_config = runtime.planner
        if self.config.system_prompt is not None:
            planner_config = dataclasses.replace(planner_config, system_prompt=self.config.system_prompt)
        tools = ToolBox.of(runtime.session_tools(), spawn=self._spawn)
        self.planner = Planner(runtime.llm(self.backend), runtime.frontend.tokenizer, self._send_oracle,
                               self._on_planner_event, planner_config, spawn=self._spawn, tools=tools,
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
                tasks.create_task(self._watch_asr(), name=f"session-{self.id}-asr-watch")
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
            self._events.put(_END)

    async def aclose(self) -> None:
        """End the session: LLM streams and ASR first, then the slot goes back, clean."""
        if self._closed:
            return
        self._closed = True
        for timer in self._timers:
            timer.cancel()
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
            self._events.put(_END)
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
        now = time.monotonic()
        self._samples_in += len(pcm)
        self._audio_wall.append((self._samples_in / SAMPLE_RATE, now))
        self._observe("on_input", pcm)
        if self._asr_ok:
            self._asr.push_pcm(pcm)
        for frame in self._splitter.push(pcm):
            self._pushed_at.append(now)
            self.handle.push_frame(frame)
            self.frames_in += 1

    async def flush(self) -> None:
        """The user stopped sending: complete the last frame with silence, finish the utterance."""
        if self._closed:
            return
        rest = len(self._splitter._buffer)
        if rest:
            self.push_pcm(np.zeros(FRAME_SIZE - rest, dtype=np.float32))
        if self._asr_ok:
            await self._asr.flush()

    def add_user_text(self, text: str) -> None:
        """A user message typed rather than spoken: the LLM sees it, and answers it through the
        oracle, as if it had been said now."""
        if self._closed:
            raise SessionError("the session is closed")
        text = " ".join(str(text).split())
        if not text:
            raise SessionError("an empty user message")
        audio_s = self._samples_in / SAMPLE_RATE
        # the oracle lead of its answer counts from now, the end of the user's input
        self._speech_end, self._answer_after_epoch = time.monotonic(), self.planner.epoch
        self.planner.on_transcript(FinalTranscript(text, audio_s, audio_s))

    def truncate_assistant(self, said: str, heard: str) -> bool:
        """Only `heard` of the assistant's words `said` reached the user: the history keeps that."""
        return self.planner.truncate_assistant(said, heard)

    def set_client_tools(self, tools: list[Tool]) -> None:
        """The tools a client declared (Realtime functions), replacing those it declared before;
        the server's own tools stay, and a client tool named like one of them is left out."""
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
        profiles = self.runtime.profiles
        if backend is not None and backend not in profiles:
            raise SessionError(f"unknown backend profile {backend!r}; known: {', '.join(profiles)}")
        if backend is not None and backend != self.backend:
            self.backend = backend
            self.planner.set_llm(self.runtime.llm(backend))
        if system_prompt is not None:
            self.planner.set_system_prompt(system_prompt)
        event = BackendChanged(self.backend, profiles[self.backend].model, self.planner.system_prompt)
        self._emit(event)
        return event

    # ---------------------------------------------------------------- outputs

    def __aiter__(self) -> TandemSession:
        return self

    async def __anext__(self) -> SessionEvent:
        event = await self._events.get()
        if event is _END:
            self._events.put(_END)  # every later reader ends too
            raise StopAsyncIteration
        return event

    def _emit(self, event: SessionEvent) -> None:
        self._observe("on_event", event)
        self._events.put(event, droppable=isinstance(event, AssistantAudio))

    def _observe(self, method: str, value: object) -> None:
        """Tell every observer; a failing one (metrics, a recorder) is logged and dropped, the
        conversation goes on."""
        for observer in list(self._observers):
            try:
                getattr(observer, method)(value)
            except Exception:
                logger.exception("session %s: observer %r failed; it is dropped", self.id, observer)
                self._observers.remove(observer)

    @property
    def dropped_events(self) -> int:
        """Audio frames dropped because the reader fell behind."""
        return self._events.dropped

    # ---------------------------------------------------------------- engine thread -> loop

    def _on_output_threadsafe(self, output: FrameOutput | BaseException) -> None:
        if self._closed:
            return  # a frame that was in the engine when the session ended
        post(self._loop, self._outputs.put_nowait, output)

    _on_error_threadsafe = _on_output_threadsafe

    async def _engine_events(self) -> None:
        while True:
            output = await self._outputs.get()
            if isinstance(output, BaseException):
                raise _SlotFailed from output
            self.frames_out += 1
            self._emit(AssistantAudio(output.frame, output.pcm, output.audio_ready, self._latency()))
            if output.text_token is not None and self._pieces is not None:
                piece = self._pieces.push(output.text_token)
                if piece:
                    self.planner.on_assistant_text(piece)
                    self._emit(AssistantText(output.frame, piece))
            for applied in output.applied:
                self._on_applied(applied)

    def _latency(self) -> float | None:
        dropped = self.handle.dropped_frames
        if dropped > self._dropped_seen:
            for _ in range(dropped - self._dropped_seen):  # frames skipped to stay live never come out
                if self._pushed_at:
                    self._pushed_at.popleft()
            self._emit(FramesSkipped(dropped - self._dropped_seen))
            self._dropped_seen = dropped
        if not self._pushed_at:
            return None
        latency = time.monotonic() - self._pushed_at.popleft()
        self._latencies.append(latency)
        return latency

    def _on_applied(self, applied) -> None:
        update = applied.update
        if update.op is OracleOp.RESET:
            self._reset_applied_at[update.epoch] = time.monotonic()
            if len(self._reset_applied_at) > 64:  # only recent oracles can be an answer's
                del self._reset_applied_at[min(self._reset_applied_at)]
        self._emit(OracleApplied(update.op.value, update.epoch, update.text,
                                 len(update.tokens), applied.frame, applied.accepted, applied.late_tokens))
        if update.op is OracleOp.RESET and update.epoch == self._lead_pending:
            self._emit_lead(update.epoch)

    async def _asr_events(self) -> None:
        async for event in self._asr:
            if not self._asr_ok:
                return  # given up on (stalled): its late transcripts would only mislead the planner
            if isinstance(event, AsrFailure):
                self._asr_failed(f"the ASR failed ({event.message}); going on without oracle updates")
                return
            final = isinstance(event, FinalTranscript)
            lag = self._lag(event.end_s)
            if final:  # the answer to this utterance comes from a stream started from now on
                self._speech_end, self._answer_after_epoch = time.monotonic() - lag, self.planner.epoch
            self._emit(Transcript(final, event.text, round(event.start_s, 3), round(event.end_s, 3), lag))
            self.planner.on_transcript(event)

    def _asr_failed(self, message: str) -> None:
        if self._asr_ok:
            self._asr_ok = False
            logger.warning("session %s: %s", self.id, message)
            self._emit(AsrFailed(message))

    async def _watch_asr(self) -> None:
        while self._asr_ok:
            await asyncio.sleep(1.0)
            lag = getattr(self._asr, "stalled_for_s", lambda: 0.0)()
            if lag > self.config.asr_stall_s:
                self._asr_failed(f"the ASR is {lag:.0f} s behind; going on without transcripts (plain Moshi)")
                await self._asr.aclose()  # its backlog is not worked through on a shared CPU

    def _lag(self, audio_s: float) -> float:
        """Wall time since the audio up to `audio_s` was received."""
        index = bisect.bisect_left(self._audio_wall, (audio_s, 0.0))
        received = self._audio_wall[min(index, len(self._audio_wall) - 1)][1] if self._audio_wall else time.monotonic()
        return max(0.0, time.monotonic() - received)

    async def _stats(self) -> None:
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            latency = statistics.median(self._latencies) * 1000 if self._latencies else None
            self._emit(SessionStats(self.frames_in, self.frames_out, self._dropped_seen + self._events.dropped,
                                    None if latency is None else round(latency, 2)))

    # ---------------------------------------------------------------- planner -> engine

    def _send_oracle(self, update: OracleUpdate) -> None:
        if self.config.oracle_delay_s > 0:
            timer = self._loop.call_later(self.config.oracle_delay_s, self._push_late, update)
            self._timers.add(timer)
        else:
            self.handle.push_oracle(update)

    def _push_late(self, update: OracleUpdate) -> None:
        self._timers = {t for t in self._timers if not t.cancelled() and t.when() > self._loop.time()}
        self.handle.push_oracle(update)  # a released handle refuses it

    def _on_planner_event(self, event: PlannerEvent) -> None:
        self._emit(event)
        if (isinstance(event, LLMAttempt) and event.phase == "done"
                and self._answer_after_epoch is not None and event.epoch > self._answer_after_epoch):
            self._answer_after_epoch = None  # once per utterance (a final may be deferred by the rate limit)
            self._answer_settled()

    def _answer_settled(self) -> None:
        """The final transcript's stream has answered: the oracle now in place is the answer's."""
        epoch = self.planner.oracle_epoch
        if not epoch or self._speech_end is None:
            return
        if epoch in self._reset_applied_at:
            self._emit_lead(epoch)
        else:
            self._lead_pending = epoch  # its reset is still on the way to the engine

    def _emit_lead(self, epoch: int) -> None:
        self._lead_pending = None
        if self._speech_end is not None:
            self._emit(OracleLead(round(self._speech_end - self._reset_applied_at[epoch], 3), epoch))


class _SlotFailed(Exception):
    """The engine failed stepping this session's slot."""


