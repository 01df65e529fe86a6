"""A tandem session's events as the websocket's JSON events (kind 7) and the recorder's lines."""

from __future__ import annotations

from dataclasses import asdict

from kame.protocol import (
    AsrStatusEvent,
    BackendEvent,
    ErrorEvent,
    LLMEvent,
    OracleEvent,
    OracleLeadEvent,
    TranscriptEvent,
    _Event,
)
from kame.session_events import (
    AsrFailed,
    BackendChanged,
    LLMAttempt,
    OracleApplied,
    OracleLead,
    SessionEvent,
    SessionFailed,
    Transcript,
)


def wire_event(event: SessionEvent) -> _Event | None:
    """The JSON event a client with ?events=1 gets for `event`; None: no JSON event (audio, text, stats)."""
    if isinstance(event, Transcript):
        return TranscriptEvent(final=event.final, text=event.text, start_s=event.start_s, end_s=event.end_s)
    if isinstance(event, OracleApplied):
        return OracleEvent(op=event.op, epoch=event.epoch, text=event.text, tokens=event.tokens, frame=event.frame,
                           accepted=event.accepted, late_tokens=event.late_tokens)
    if isinstance(event, LLMAttempt):
        return LLMEvent(**asdict(event))
    if isinstance(event, OracleLead):
        return OracleLeadEvent(lead_s=event.lead_s, epoch=event.epoch)
    if isinstance(event, BackendChanged):
        return BackendEvent(name=event.name, model=event.model, system_prompt=event.system_prompt)
    if isinstance(event, AsrFailed):
        return AsrStatusEvent(status="failed", message=event.message)
    if isinstance(event, SessionFailed):
        return ErrorEvent(code=event.code, message=event.message)
    return None
