"""Prometheus metrics of the server, in a registry of its own (one per app)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

FRAME_S = 0.08
_MS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_S_BUCKETS = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes
        self.active_sessions = Gauge("kame_active_sessions", "sessions connected now", registry=r)
        self.free_slots = Gauge("kame_free_slots", "engine slots free now", registry=r)
        self.sessions_total = Counter("kame_sessions_total", "sessions started", registry=r)
        self.sessions_refused = Counter("kame_sessions_refused_total", "connections refused (no slot)", registry=r)
        self.frames_stepped = Counter("kame_frames_stepped_total", "session-frames stepped by the engine",
                                      registry=r)
        self.engine_steps = Counter("kame_engine_steps_total", "batched engine steps", registry=r)
        self.step_seconds = Histogram("kame_engine_step_seconds", "duration of one batched engine step",
                                      buckets=_MS_BUCKETS, registry=r)
        self.real_time_factor = Gauge("kame_real_time_factor", "last engine step time / 80 ms frame", registry=r)
        self.frame_latency = Histogram("kame_frame_latency_seconds", "audio frame in -> audio frame out, server side",
                                       buckets=_MS_BUCKETS, registry=r)
        self.frames_dropped = Counter("kame_frames_dropped_total", "frames dropped by bounded queues",
                                      ["direction"], registry=r)
        self.asr_partial_lag = Histogram("kame_asr_partial_lag_seconds",
                                         "wall time from the audio a partial covers to the partial", buckets=_S_BUCKETS,
                                         registry=r)
        self.llm_ttft = Histogram("kame_llm_first_token_seconds", "LLM request -> first token", ["backend"],
                                  buckets=_S_BUCKETS, registry=r)
        self.llm_attempts = Counter("kame_llm_attempts_total", "LLM attempts by outcome",
                                    ["backend", "outcome"], registry=r)
        self.oracle_tokens = Counter("kame_oracle_tokens_total", "oracle tokens by fate", ["fate"], registry=r)
        self.protocol_errors = Counter("kame_protocol_errors_total", "malformed client messages", registry=r)

    def on_step(self, seconds: float, batch: int) -> None:
        """Called from the engine thread after each batched step."""
        self.engine_steps.inc()
        self.frames_stepped.inc(batch)
        self.step_seconds.observe(seconds)
        self.real_time_factor.set(seconds / FRAME_S)

    def render(self) -> bytes:
        return generate_latest(self.registry)
