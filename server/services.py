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

    def health(self) -> dict:
        health = self.runtime.health()
        if self.settings.replica:
            health["replica"] = self.settings.replica
        return health
