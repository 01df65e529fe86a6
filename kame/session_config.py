"""How one tandem session runs: the options a transport (or a test) chooses when it opens one."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass


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
    # a PersonaPlex-layout front-end's role text (prefilled, as its reference does, before the session talks)
    persona: str | None = None
    voice: str | None = None  # ... and its voice, by name (PersonaPlex's voice_prompt: NATF2.pt)
    # the language the backend thinks in (en, ja; kame/backend/language.py); None: the planner's configured one
    language: str | None = None
