"""Prometheus metrics of the server, in a registry of its own (one per app); `SessionMetrics`
observes a tandem session's events, the engine's counters are read at each scrape."""

from __future__ import annotations

import asyncio

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kame.audio import FRAME_S
from kame.session_events import (
    AssistantAudio,
    FramesSkipped,
    KnowledgeRetrieval,
    LLMAttempt,
    OracleApplied,
    OracleLead,
    SessionEvent,
    ToolCallEvent,
    Transcript,
)

_MS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_S_BUCKETS = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4)
LOOP_PROBE_S = 0.1  # how often the event loop's lag is sampled
_LEAD_BUCKETS = (-3.2, -1.6, -0.8, -0.4, -0.2, 0.0, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes
        self.active_sessions = Gauge("kame_active_sessions", "sessions connected now", registry=r)
        self.free_slots = Gauge("kame_free_slots", "engine slots free now", registry=r)
        self.sessions_total = Counter("kame_sessions_total", "sessions started", registry=r)
        self.transport_sessions = Counter("kame_transport_sessions_total", "sessions started by transport (moshi, "
                                          "realtime, live, live-webrtc)", ["transport"], registry=r)
        self.delegations = Counter("kame_live_delegations_total", "GPT-Live delegations by target (responses, "
                                   "client)", ["target"], registry=r)
        self.webrtc_peer_packets = Counter("kame_webrtc_peer_packet_sessions_total", "WebRTC sessions ended, by how "
                                           "long the peer's Opus packets lasted (ms)", ["ms"], registry=r)
        self.sessions_refused = Counter("kame_sessions_refused_total", "connections refused (no slot)", registry=r)
        self.frames_stepped = Counter("kame_frames_stepped_total", "session-frames stepped by the engine",
                                      registry=r)
        self.engine_steps = Counter("kame_engine_steps_total", "batched engine steps", registry=r)
        self.step_seconds = Histogram("kame_engine_step_seconds", "duration of one batched engine step",
                                      buckets=_MS_BUCKETS, registry=r)
        self.real_time_factor = Gauge("kame_real_time_factor", "last engine step time / 80 ms frame", registry=r)
        self.frame_latency = Histogram("kame_frame_latency_seconds", "audio frame in -> audio frame out, server side",
                                       buckets=_MS_BUCKETS, registry=r)
        self.frames_dropped = Counter("kame_frames_dropped_total", "frames dropped to stay live: in (the engine "
                                      "skipped input), out (a client read too slowly)", ["direction"], registry=r)
        self.asr_partial_lag = Histogram("kame_asr_partial_lag_seconds",
                                         "wall time from the audio a partial covers to the partial", buckets=_S_BUCKETS,
                                         registry=r)
        self.llm_ttft = Histogram("kame_llm_first_token_seconds", "LLM request -> first token", ["backend"],
                                  buckets=_S_BUCKETS, registry=r)
        self.llm_attempts = Counter("kame_llm_attempts_total", "LLM attempts by outcome",
                                    ["backend", "outcome"], registry=r)
        self.oracle_tokens = Counter("kame_oracle_tokens_total", "oracle tokens by fate", ["fate"], registry=r)
        self.protocol_errors = Counter("kame_protocol_errors_total", "malformed client messages", registry=r)
        self.oracle_lead = Histogram("kame_oracle_lead_seconds", "end of the user's speech - the time the oracle "
                                     "the answer used was applied (positive: speak while thinking)",
                                     buckets=_LEAD_BUCKETS, registry=r)
        self.tool_calls = Counter("kame_tool_calls_total", "tool calls by tool and outcome (done, failed, "
                                  "cancelled, cached)", ["tool", "outcome"], registry=r)
        self.tool_seconds = Histogram("kame_tool_call_seconds", "tool call latency (calls really run)", ["tool"],
                                      buckets=_S_BUCKETS, registry=r)
        self.knowledge_seconds = Histogram("kame_knowledge_retrieval_seconds", "knowledge retrieval per attempt",
                                           buckets=_MS_BUCKETS, registry=r)
        self.loop_lag = Histogram("kame_event_loop_lag_seconds", "how late the event loop ran a task due every "
                                  f"{LOOP_PROBE_S * 1000:.0f} ms (a busy or blocked loop delays every session)",
                                  buckets=_MS_BUCKETS, registry=r)

    def watch_runtime(self, runtime, engine: bool = True) -> None:
        """Read the engine's slot count and counters at each scrape (`engine=False`: a front process other
        than the first, whose merged metrics must count the one engine once)."""
        if engine:
            self.free_slots.set_function(lambda: runtime.runner.free_slots)
            self.registry.register(_RunnerCollector(runtime.runner))

    def on_step(self, seconds: float, batch: int) -> None:
        """Called from the engine thread after each batched step."""
        self.engine_steps.inc()
        self.frames_stepped.inc(batch)
        self.step_seconds.observe(seconds)
        self.real_time_factor.set(seconds / FRAME_S)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def probe_loop(self, every_s: float = LOOP_PROBE_S) -> None:
        """Forever: sleep `every_s` on the loop and record how much later than that it woke."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + every_s
            await asyncio.sleep(every_s)
            self.loop_lag.observe(max(0.0, loop.time() - due))


class _RunnerCollector:
    """The engine thread's own counters (kame.frontend.runner.RunnerStats), as Prometheus counters."""

    _help = {
        "stale_dropped": "frames and oracle updates of a slot's previous occupant, dropped",
        "skipped_frames": "input frames dropped to skip a session to live after a stall",
        "overruns": "engine steps that ended after the next frame tick was due",
    }

    def __init__(self, runner) -> None:
        self.runner = runner

    def collect(self):
        stats = self.runner.stats
        for name, text in self._help.items():
            yield CounterMetricFamily(f"kame_engine_{name}", text, value=getattr(stats, name))


class SessionMetrics:
    """An observer of one tandem session: its events become the server's metrics."""

    def __init__(self, metrics: Metrics, tool_names: frozenset[str] = frozenset()) -> None:
        self.metrics = metrics
        # the server's tools by name; any other name (one a model made up, a client's function) is
        # counted as "other", so that the label's values stay bounded
        self.tool_names = tool_names

    def on_input(self, pcm) -> None:
        pass

    def on_event(self, event: SessionEvent) -> None:
        m = self.metrics
        if isinstance(event, AssistantAudio) and event.latency_s is not None:
            m.frame_latency.observe(event.latency_s)
        elif isinstance(event, Transcript) and not event.final:
            m.asr_partial_lag.observe(event.lag_s)
        elif isinstance(event, OracleApplied):
            seen = event.tokens - event.late_tokens
            m.oracle_tokens.labels("applied" if event.accepted else "dropped").inc(
                seen if event.accepted else event.tokens)
            m.oracle_tokens.labels("late").inc(event.late_tokens)
        elif isinstance(event, LLMAttempt):
            if event.phase == "first_token":
                m.llm_ttft.labels(event.backend).observe(event.latency_s or 0.0)
            elif event.phase in ("done", "cancelled", "failed"):
                m.llm_attempts.labels(event.backend, event.phase).inc()
        elif isinstance(event, FramesSkipped):
            m.frames_dropped.labels("in").inc(event.count)
        elif isinstance(event, OracleLead):
            m.oracle_lead.observe(event.lead_s)
        elif isinstance(event, ToolCallEvent) and event.phase != "started":
            tool = event.name if event.name in self.tool_names else "other"
            m.tool_calls.labels(tool, "cached" if event.cached else event.phase).inc()
            if event.elapsed_s is not None and not event.cached:
                m.tool_seconds.labels(tool).observe(event.elapsed_s)
        elif isinstance(event, KnowledgeRetrieval):
            m.knowledge_seconds.observe(event.elapsed_s)


def merge_metrics(families: dict[str, list], label: str = "replica") -> bytes:
    """Several processes' metric families (prometheus_client's, as their registries collect them) as one
    exposition: each family once, with every process's samples, each labelled `label` with its name (Ray's
    replicas, the front processes). prometheus_client writes the text."""
    merged: dict[str, Metric] = {}
    for name, metrics in sorted(families.items()):
        for family in metrics:
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            into.samples += [sample._replace(labels={label: name, **sample.labels}) for sample in family.samples]
    return generate_latest(_Collected(list(merged.values())))


def parse_metrics(text: str) -> list:
    """An exposition's text back into metric families (what `merge_metrics` takes)."""
    return list(text_string_to_metric_families(text))


class _Collected:
    """Metric families already collected, as prometheus_client's writer reads a registry."""

    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self) -> list:
        return self.families
