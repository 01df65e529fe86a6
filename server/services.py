"""What the server holds for its whole life: its settings, the library runtime and the metrics."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kame.runtime import Runtime
from server.metrics import Metrics
from server.settings import ServerSettings

logger = logging.getLogger(__name__)


@dataclass
class Services:
    settings: ServerSettings
    runtime: Runtime
    metrics: Metrics

    @classmethod
    def start(cls, settings: ServerSettings, metrics: Metrics | None = None) -> Services:
        """Load and warm every model (blocking: run it off the event loop)."""
        metrics = metrics or Metrics()
        default, why = settings.default_profile_and_reason()
        logger.info("default LLM backend profile: %s (%s)", default, why)
        runtime = Runtime.start(settings.runtime_settings(), on_step=metrics.on_step)
        metrics.watch_runtime(runtime)
        return cls(settings, runtime, metrics)

    @classmethod
    def connect(cls, settings: ServerSettings, remote, engine_metrics: bool = True) -> Services:
        """A front process's services (server/fronts.py): the engine is the engine process's, through
        `remote`; `engine_metrics`: this front reports the engine's figures (one front of them does)."""
        metrics = Metrics()
        default, why = settings.default_profile_and_reason()
        logger.info("default LLM backend profile: %s (%s)", default, why)
        runtime = Runtime.connect(settings.runtime_settings(), remote,
                                  on_step=metrics.on_step if engine_metrics else None)
        metrics.watch_runtime(runtime, engine=engine_metrics)
        return cls(settings, runtime, metrics)

    def health(self) -> dict:
        health = self.runtime.health()
        if self.settings.replica:
            health["replica"] = self.settings.replica
        return health
