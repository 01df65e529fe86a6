"""What a process loads once and shares between its sessions: the front-end and its batched engine
on the engine thread, the ASR engine, the LLM clients of the backend profiles (each behind a
circuit breaker), the configured tools (MCP servers connected) and the knowledge base (indexed).
Built from a plain `RuntimeSettings`, where the defaults are; transports build that from their config.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from kame.asr import AsrEngine, build_asr, hears
from kame.backend import breaker, make_llm
from kame.backend.breaker import CircuitBreakerLLM
from kame.backend.llm import LLMClient
from kame.backend.planner import PlannerConfig
from kame.backend.profiles import DEFAULT_PROFILES, BackendProfile
from kame.errors import FrontendLoadError, SessionError
from kame.frontend.engine import BatchedEngine, NullEngine
from kame.frontend.kv_cache import choose_kv_cache
from kame.frontend.loader import Frontend, check_quantize, load_frontend, resolve_device
from kame.frontend.remote import RemoteEngine
from kame.frontend.runner import BATCH_WINDOW_S, JITTER_FRAMES, MAX_PENDING_FRAMES, EngineRunner
from kame.frontend.step_policy import EngineClock
from kame.frontend.voices import VoiceLibrary, frontend_voices
from kame.tools.base import Tool
from kame.tools.config import ToolConfig
from kame.tools.knowledge_tool import KnowledgeTool
from kame.tools.registry import ToolRegistry

logger = logging.getLogger(__name__)

OFFLINE_DEMO_HINT = "for the offline CPU demo run: kame serve --frontend tiny-copy"


@dataclass(frozen=True)
class KnowledgeOptions:
    dir: Path  # the documents (.txt, .md, .html, .pdf), indexed at start-up
    index_path: Path | None = None  # None: the index is kept in memory (rebuilt at each start)
    watch_interval_s: float | None = 5.0  # re-index changed files this often; None: only on SIGHUP
    tool: bool = True  # offer `search_knowledge` to models that call tools


@dataclass(frozen=True)
class RuntimeSettings:
    frontend: str | None = None  # preset, directory or HF repo; None: SakanaAI/kame with a GPU, else tiny-copy
    device: str = "auto"  # auto | cpu | cuda
    quantize: str | None = None  # "int8": the front-end LM's linear layers in int8 (CUDA only)
    max_sessions: int | None = None  # engine slots; None: 32 on a GPU, 4 on a CPU
    asr: str | None = None  # whisper | kyutai-stt | none; None: kyutai-stt with a GPU, else whisper
    asr_model: str | None = None
    asr_realtime: bool = True  # False: audio arrives faster than real time (files), whisper decodes each interval
    asr_options: Mapping[str, Mapping] = field(default_factory=dict)  # engine name -> its options' overrides
    profiles: Mapping[str, BackendProfile] = field(default_factory=lambda: dict(DEFAULT_PROFILES))
    default_profile: str = "embedded"
    planner: PlannerConfig = PlannerConfig()
    # auto: eager on a CPU, tick on a GPU (docs/benchmarks.md, "The frame clock"); tick: one batched step
    # per 80 ms for every session; eager: a step as soon as a frame arrives
    engine_clock: Literal["auto", "tick", "eager"] = "auto"
    jitter_frames: int = JITTER_FRAMES  # input frames a live session may hold at a step before skipping to live
    batch_window_s: float = BATCH_WINDOW_S  # eager clock: how long a ready session waits for the others
    max_pending_frames: int = MAX_PENDING_FRAMES  # hard cap of a session's input queue
    engine_threads: int | None = None  # torch threads of the engine thread; None: 1 on a CPU
    # True: a step runs the sessions' rows only (kame/frontend/rows.py); False: every slot, as moshi alone does
    engine_compact: bool = True
    # the LM's KV cache: auto (the model's dtype where max_sessions of it fit on the GPU, else int8), model, int8
    kv_cache: Literal["auto", "model", "int8"] = "auto"
    breaker_failures: int = breaker.THRESHOLD  # LLM failures in a row (per profile) that open its circuit ...
    breaker_cooldown_s: float = breaker.COOLDOWN_S  # ... for this long
    tools: Mapping[str, ToolConfig] = field(default_factory=dict)  # [tools.NAME]; empty: no tools
    knowledge: KnowledgeOptions | None = None  # None: no knowledge base
    # PersonaPlex's voices (`.pt`) by name: this folder; None: the checkpoint's voices/ or voices.tgz
    voices_dir: Path | None = None

    def resolved_frontend(self, cuda: bool) -> str:
        return self.frontend or ("SakanaAI/kame" if cuda else "tiny-copy")

    def resolved_asr(self, cuda: bool) -> str:
        return self.asr or ("kyutai-stt" if cuda else "whisper")

    def resolved_max_sessions(self, cuda: bool) -> int:
        return default_max_sessions(self.max_sessions, cuda)

    def resolved_engine_clock(self, cuda: bool) -> EngineClock:
        return default_engine_clock(self.engine_clock, cuda)


def default_engine_clock(clock: str, cuda: bool) -> EngineClock:
    """The frame clock: as set, else (auto) eager on a CPU and tick on a GPU. Measured on the whole
    server on this project's 2-core CPU (docs/benchmarks.md, "The frame clock"): the tick gives the
    same p50 round trip (0.85-1.05x eager's) at one step per frame and 0.6x the CPU, but a longer
    tail (p99 1.3-1.6x: a frame that just missed the step waits for the next); a CPU serves few
    sessions and has steps to spare, so eager. On a GPU the steps are what runs out (a step costs the
    whole batch): the tick, unmeasured there so far (scripts/gpu_bench.sh compares them)."""
    if clock == "auto":
        return "tick" if cuda else "eager"
    return clock  # type: ignore[return-value]


def default_max_sessions(max_sessions: int | None, cuda: bool) -> int:
    """Engine slots: as set, else 32 on a GPU and 4 on a CPU."""
    return max_sessions or (32 if cuda else 4)


@dataclass
class Runtime:
    settings: RuntimeSettings
    frontend: Frontend
    engine: BatchedEngine
    runner: EngineRunner
    asr: AsrEngine
    tools: ToolRegistry = field(default_factory=ToolRegistry)
    knowledge: Any = None  # kame.knowledge.KnowledgeBase, or None
    remote: RemoteEngine | None = None  # a front process's connection to the engine process
    voices: VoiceLibrary = field(default_factory=lambda: VoiceLibrary(None))  # PersonaPlex's voices, by name
    _llms: dict[str, LLMClient] = field(default_factory=dict)

    @classmethod
    def start(cls, settings: RuntimeSettings, on_step: Callable[[float, int], None] | None = None) -> Runtime:
        """Load and warm every model (blocking: run it off the event loop); one log line per stage."""
        frontend, engine, runner, cuda = load_engine(settings, on_step)
        try:
            asr = load_asr(settings, cuda, engine.batch_size)
        except BaseException:
            runner.stop()
            engine.close()
            raise
        return cls(settings, frontend, engine, runner, asr)._finish()

    @classmethod
    def connect(cls, settings: RuntimeSettings, remote: RemoteEngine,
                on_step: Callable[[float, int], None] | None = None) -> Runtime:
        """A front process's runtime: the engine (and a GPU speech-to-text batch) are the engine process's,
        reached through `remote` (kame/frontend/remote.py); the ASR runs here unless the host serves it."""
        runner = remote.runner("engine")
        runner.on_step = on_step
        frontend = RemoteFrontend.of(remote.info.extra)
        if "asr" in remote.runners:
            from kame.asr.kyutai_stt import RemoteKyutaiStt

            asr = RemoteKyutaiStt(remote.runner("asr"), remote.info.extra["asr"])
            logger.info("[3/4] ASR %s, served by the engine process", asr.name)
        else:
            asr = load_asr(settings, frontend.device.type == "cuda", runner.engine.batch_size)
        return cls(settings, frontend, runner.engine, runner, asr, remote=remote)._finish()

    def _finish(self) -> Runtime:
        settings = self.settings
        logger.info("[4/4] LLM backend profiles: %s; default %s", ", ".join(settings.profiles),
                    settings.default_profile)
        try:
            self.tools = ToolRegistry.from_config(settings.tools)
            self.knowledge = open_knowledge(settings.knowledge)
            self.voices = VoiceLibrary(frontend_voices(settings.voices_dir, self.frontend))
            if why := hears(self.asr, self.language):
                logger.warning("sessions think in %s by default, but %s: every such session will be refused",
                               self.language, why)
            if self.voices.folder is not None:
                logger.info("voices: %d in %s", len(self.voices.names()), self.voices.folder)
        except BaseException:
            self.close()
            raise
        if settings.profiles[settings.default_profile].kind == "embedded":
            started = time.perf_counter()
            self.llm(settings.default_profile).wait_ready()
            logger.info("embedded LLM loaded in %.1f s", time.perf_counter() - started)
        return self

    @property
    def language(self) -> str:
        """The sessions' default language: the configured one, else the front-end's (ja for J-Moshi)."""
        return self.settings.planner.language or getattr(self.frontend, "language", "en")

    @property
    def profiles(self) -> Mapping[str, BackendProfile]:
        return self.settings.profiles

    @property
    def default_profile(self) -> str:
        return self.settings.default_profile

    def profile_named(self, name: str) -> str:
        """`name`, once it is known to be a backend profile here (a session asked for it)."""
        if name not in self.profiles:
            raise SessionError(f"unknown backend profile {name!r}; known: {', '.join(self.profiles)}")
        return name

    @property
    def planner(self) -> PlannerConfig:
        return self.settings.planner

    def llm(self, name: str) -> LLMClient:
        """The profile's client, shared by every session, behind the profile's circuit breaker."""
        if name not in self._llms:
            self._llms[name] = CircuitBreakerLLM(make_llm(self.profiles[name]), self.settings.breaker_failures,
                                                 self.settings.breaker_cooldown_s)
        return self._llms[name]

    def session_tools(self) -> list[Tool]:
        """The tools every session starts with: the configured ones, and `search_knowledge`."""
        tools = list(self.tools.tools.values())
        if self.knowledge is not None and self.settings.knowledge.tool:
            tools.append(KnowledgeTool(self.knowledge, self.planner.knowledge_limit))
        return tools

    def refresh_knowledge(self, why: str) -> None:
        """Re-index the knowledge base now (blocking: run it off the event loop)."""
        if self.knowledge is not None:
            log_index_stats(self.knowledge.refresh(), why)

    def health(self) -> dict:
        return {
            "status": "ready", "frontend": self.frontend.source, "device": str(self.frontend.device),
            "asr": self.asr.name, "llm": self.default_profile,
            "llm_profiles": [p.public() for p in self.profiles.values()],
            "max_sessions": self.engine.batch_size, "free_slots": self.runner.free_slots,
            "tools": [tool.spec.name for tool in self.session_tools()],
            "knowledge": str(self.settings.knowledge.dir) if self.knowledge is not None else None,
            "voices": self.voices.names(),  # PersonaPlex's voice_prompt names
            "language": self.language,
        }

    async def aclose_llms(self) -> None:
        """Close the LLM clients: on the event loop that used them."""
        llms, self._llms = list(self._llms.values()), {}
        for llm in llms:
            await llm.aclose()

    def close(self) -> None:
        """Stop the engine thread and release the models (after `aclose_llms`)."""
        self.tools.close()
        if self.knowledge is not None:
            self.knowledge.close()
        self.asr.close()
        self.runner.stop()
        if self.remote is not None:
            self.remote.close()
            return
        self.engine.close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    async def aclose(self) -> None:
        await self.aclose_llms()
        self.close()


def load_engine(settings: RuntimeSettings, on_step: Callable[[float, int], None] | None = None
                ) -> tuple[Frontend, BatchedEngine, EngineRunner, bool]:
    """The front-end and its engine on a started, warm engine thread (stages 1 and 2); and whether on CUDA."""
    device = resolve_device(settings.device)
    cuda = device.type == "cuda"
    check_quantize(settings.quantize, device)  # before any download
    source = settings.frontend or log_default_frontend(cuda)
    logger.info("[1/4] loading front-end %s on %s", source, device)
    try:
        frontend = load_frontend(source, device, quantize=settings.quantize)
    except FrontendLoadError as exc:
        hint = f"; {OFFLINE_DEMO_HINT}" if device.type == "cpu" else ""
        raise FrontendLoadError(f"{exc}{hint}") from exc
    if source == "tiny-copy":
        logger.warning("tiny-copy is an untrained demo front-end: its audio is noise, its text repeats the "
                       "oracle. For real speech use --frontend SakanaAI/kame on a GPU.")
    engine, runner = _start_engine(settings, frontend, cuda, on_step)
    return frontend, engine, runner, cuda


def load_asr(settings: RuntimeSettings, cuda: bool, sessions: int) -> AsrEngine:
    """Stage 3: the ASR engine, warm."""
    asr_name = settings.resolved_asr(cuda)
    logger.info("[3/4] loading ASR %s", asr_name)
    asr = build_asr(asr_name, settings.asr_model, settings.device, max_sessions=sessions,
                    realtime=settings.asr_realtime, options=settings.asr_options.get(asr_name, {}))
    if asr_name != "none":
        started = time.perf_counter()
        asr.warm_up()
        logger.info("ASR warm (%.2f s)", time.perf_counter() - started)
    return asr


@dataclass(frozen=True)
class RemoteFrontend:
    """What a front process knows of the front-end the engine process loaded: its name, device and tokenizer."""

    source: str
    device: torch.device
    dtype: torch.dtype
    tokenizer: Any  # sentencepiece.SentencePieceProcessor, or None
    language: str = "en"  # its text stream's (ja for J-Moshi): the sessions' default language

    @classmethod
    def of(cls, extra: Mapping) -> RemoteFrontend:
        import sentencepiece

        proto = extra.get("tokenizer")
        tokenizer = sentencepiece.SentencePieceProcessor(model_proto=proto) if proto else None
        return cls(extra["source"], torch.device(extra["device"]), getattr(torch, extra["dtype"]), tokenizer,
                   extra.get("language", "en"))

    @staticmethod
    def describe(frontend: Frontend) -> dict:
        """What the engine process tells its fronts (`HostInfo.extra`) of the front-end it loaded."""
        tokenizer = frontend.tokenizer
        return {"source": frontend.source, "device": str(frontend.device),
                "dtype": str(frontend.dtype).removeprefix("torch."),
                "tokenizer": tokenizer.serialized_model_proto() if tokenizer is not None else None,
                "language": getattr(frontend, "language", "en")}


def open_knowledge(options: KnowledgeOptions | None):
    """The knowledge base of `options`, indexed (blocking), or None."""
    if options is None:
        return None
    from kame.knowledge import KnowledgeBase

    knowledge = KnowledgeBase(options.dir, index_path=options.index_path)
    try:
        log_index_stats(knowledge.refresh(), f"knowledge base {options.dir}")
    except BaseException:
        knowledge.close()
        raise
    return knowledge


def log_index_stats(stats, why: str) -> None:
    logger.info("%s: %d documents, %d passages (%d added, %d updated, %d removed) in %.2f s", why,
                stats.documents, stats.passages, stats.added, stats.updated, stats.removed, stats.elapsed_s)
    for failure in stats.failed:
        logger.warning("knowledge base: cannot index %s", failure)


def default_frontend_and_reason(frontend: str | None, cuda: bool) -> tuple[str, str]:
    """The front-end `kame serve` loads, and why (for its log line and `kame doctor`)."""
    if frontend:
        return frontend, "chosen in the settings"
    why = ("a GPU is present" if cuda
           else "no GPU: the offline demo; real weights: --frontend SakanaAI/kame --device cuda")
    return RuntimeSettings().resolved_frontend(cuda), f"no --frontend given: {why}"


def default_asr_and_reason(asr: str | None, cuda: bool) -> tuple[str, str]:
    """The ASR engine `kame serve` starts, and why."""
    if asr:
        return asr, "chosen in the settings"
    return RuntimeSettings().resolved_asr(cuda), f"no --asr given: {'a GPU is present' if cuda else 'no GPU'}"


def log_default_frontend(cuda: bool) -> str:
    """No front-end was named: SakanaAI/kame with a GPU, the offline demo without; say which and why."""
    source, why = default_frontend_and_reason(None, cuda)
    logger.info("%s (%s)", source, why)
    return source


def _start_engine(settings: RuntimeSettings, frontend: Frontend, cuda: bool, on_step) -> tuple:
    sessions = settings.resolved_max_sessions(cuda)
    clock = settings.resolved_engine_clock(cuda)
    logger.info("[2/4] starting the batched engine: %d session slots, %s clock%s", sessions, clock,
                " (auto)" if settings.engine_clock == "auto" else "")
    try:
        kv_cache, why = choose_kv_cache(settings.kv_cache, frontend.lm, sessions)
        logger.info("KV cache: %s (%s)", frontend.dtype if kv_cache == "model" else kv_cache, why)
        engine = (NullEngine if settings.frontend == "null" else BatchedEngine)(
            frontend, sessions, compact=settings.engine_compact, kv_cache=kv_cache)
        threads = settings.engine_threads or (None if cuda else 1)
        runner = EngineRunner(engine, clock=clock, jitter_frames=settings.jitter_frames,
                              batch_window_s=settings.batch_window_s, max_pending_frames=settings.max_pending_frames,
                              on_step=on_step, torch_threads=threads).start()
        _warm_up(runner)
    except torch.OutOfMemoryError as exc:
        raise FrontendLoadError(
            f"out of device memory with {sessions} session slots ({exc}); lower --max-sessions "
            "(max_sessions in the config, KAME_MAX_SESSIONS)") from exc
    return engine, runner


def _warm_up(runner: EngineRunner) -> None:
    started = time.perf_counter()
    done = runner.warm_up()
    logger.info("engine warm (%d frames in %.2f s)", done, time.perf_counter() - started)
