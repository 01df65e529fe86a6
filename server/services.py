"""What the server loads once at start-up and shares between sessions: front-end engine, ASR, LLMs."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kame.asr import AsrEngine, build_asr
from kame.backend import make_llm
from kame.backend.breaker import CircuitBreakerLLM
from kame.backend.llm import LLMClient
from kame.backend.profiles import BackendProfile
from kame.errors import FrontendLoadError
from kame.frontend.engine import FRAME_SIZE, BatchedEngine
from kame.frontend.loader import Frontend, load_frontend, resolve_device
from kame.frontend.runner import EngineRunner
from server.metrics import Metrics
from server.settings import ServerSettings

logger = logging.getLogger(__name__)

OFFLINE_DEMO_HINT = "for the offline CPU demo run: kame serve --frontend tiny-copy"


@dataclass
class Services:
    settings: ServerSettings
    frontend: Frontend
    engine: BatchedEngine
    runner: EngineRunner
    asr: AsrEngine
    profiles: dict[str, BackendProfile]
    metrics: Metrics
    _llms: dict[str, LLMClient] = field(default_factory=dict)

    @classmethod
    def start(cls, settings: ServerSettings, metrics: Metrics | None = None) -> Services:
        """Load and warm every model (blocking: run it off the event loop); one log line per stage."""
        metrics = metrics or Metrics()
        device = resolve_device(settings.device)
        cuda = device.type == "cuda"
        source = settings.resolved_frontend(cuda)
        if settings.frontend is None:
            logger.info("no --frontend given: %s (%s)", source, "a GPU is present" if cuda else
                        "no GPU: the offline demo; real weights: --frontend SakanaAI/kame --device cuda")
        logger.info("[1/4] loading front-end %s on %s", source, device)
        try:
            frontend = load_frontend(source, device)
        except FrontendLoadError as exc:
            hint = f"; {OFFLINE_DEMO_HINT}" if device.type == "cpu" else ""
            raise FrontendLoadError(f"{exc}{hint}") from exc
        if source == "tiny-copy":
            logger.warning("tiny-copy is an untrained demo front-end: its audio is noise, its text repeats the "
                           "oracle. For real speech use --frontend SakanaAI/kame on a GPU.")
        sessions = settings.max_sessions or (32 if device.type == "cuda" else 4)
        logger.info("[2/4] starting the batched engine: %d session slots", sessions)
        try:
            engine = BatchedEngine(frontend, sessions)
            threads = settings.engine_threads or (None if cuda else 1)
            runner = EngineRunner(engine, settings.batch_window_ms / 1000, settings.max_pending_frames,
                                  on_step=metrics.on_step, torch_threads=threads).start()
            _warm_up(runner)
        except torch.OutOfMemoryError as exc:
            raise FrontendLoadError(
                f"out of device memory with {sessions} session slots ({exc}); lower --max-sessions "
                "(max_sessions in the config, KAME_MAX_SESSIONS)") from exc
        asr_name = settings.resolved_asr(cuda)
        logger.info("[3/4] loading ASR %s", asr_name)
        asr = build_asr(asr_name, settings.asr_model, settings.device, max_sessions=sessions)
        profiles = settings.all_profiles()
        default, why = settings.default_profile_and_reason()
        logger.info("[4/4] LLM backend profiles: %s; default %s (%s)", ", ".join(profiles), default, why)
        services = cls(settings, frontend, engine, runner, asr, profiles, metrics)
        if profiles[default].kind == "embedded":
            started = time.perf_counter()
            services.llm(default).wait_ready()
            logger.info("embedded LLM loaded in %.1f s", time.perf_counter() - started)
        metrics.free_slots.set(engine.free_slots)
        return services

    def llm(self, name: str) -> LLMClient:
        """The profile's client, shared by every session, behind the profile's circuit breaker."""
        if name not in self._llms:
            self._llms[name] = CircuitBreakerLLM(make_llm(self.profiles[name]), self.settings.breaker_failures,
                                                 self.settings.breaker_cooldown_s)
        return self._llms[name]

    def health(self) -> dict:
        return {
            "status": "ready", "frontend": self.frontend.source, "device": str(self.frontend.device),
            "asr": self.asr.name, "llm": self.settings.default_profile,
            "llm_profiles": [p.public() for p in self.profiles.values()],
            "max_sessions": self.engine.batch_size, "free_slots": self.runner.free_slots,
        }

    async def aclose(self) -> None:
        for llm in self._llms.values():
            await llm.aclose()
        self.asr.close()
        self.runner.stop()
        self.engine.close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _warm_up(runner: EngineRunner, frames: int = 3) -> None:
    """Step one slot a few frames so first-call costs are paid before any user connects."""
    started = time.perf_counter()
    done = []
    handle = runner.acquire(done.append)
    for _ in range(frames):
        handle.push_frame(np.zeros(FRAME_SIZE, dtype=np.float32))
    deadline = time.monotonic() + 120
    while len(done) < frames and time.monotonic() < deadline:
        time.sleep(0.01)
    handle.release()
    logger.info("engine warm (%d frames in %.2f s)", len(done), time.perf_counter() - started)
