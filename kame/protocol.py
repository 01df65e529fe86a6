"""The websocket wire protocol: Moshi's binary messages, plus documented KAME extensions.

Every message is binary: one kind byte, then the payload. Moshi's kinds (0 handshake, 1 Ogg/Opus
audio at 24 kHz, 2 UTF-8 text piece, 3 control, 4 metadata, 5 error, 6 ping) are kept byte for
byte. Extensions (sent only to clients that ask with `?events=1` / `?audio=pcm`) are JSON events
(7, server -> client), JSON control messages (8, client -> server) and raw PCM16 audio (9).
See docs/protocol.md.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from kame.audio import FRAME_SIZE, SAMPLE_RATE  # named once in kame.audio; clients take them from here
from kame.session_events import (
    AsrFailed,
    BackendChanged,
    KnowledgeRetrieval,
    LLMAttempt,
    OracleApplied,
    OracleLead,
    SessionEvent,
    SessionFailed,
    ToolCallEvent,
    Transcript,
)


class Kind(enum.IntEnum):
    HANDSHAKE = 0
    AUDIO = 1  # Ogg/Opus pages, 24 kHz mono
    TEXT = 2  # UTF-8 text piece spoken by the assistant
    CONTROL = 3
    METADATA = 4
    ERROR = 5  # UTF-8 error message
    PING = 6
    EVENT = 7  # extension, server -> client: one JSON event
    CLIENT_JSON = 8  # extension, client -> server: one JSON control message
    PCM = 9  # extension, both ways when ?audio=pcm: little-endian int16 PCM, 24 kHz mono


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the text is fit to send back to the client."""


def encode(kind: Kind, payload: bytes = b"") -> bytes:
    return bytes([kind]) + payload


def decode(message: bytes) -> tuple[Kind, bytes]:
    if not message:
        raise ProtocolError("empty message: every message starts with a kind byte")
    try:
        kind = Kind(message[0])
    except ValueError as exc:
        raise ProtocolError(f"unknown message kind {message[0]}") from exc
    return kind, bytes(message[1:])


# ----------------------------------------------------------------- server -> client events


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReadyEvent(_Event):
    type: Literal["ready"] = "ready"
    session_id: str
    frontend: str
    asr: str
    backend: str
    backends: list[str]
    system_prompt: str
    audio: Literal["opus", "pcm"] = "opus"
    sample_rate: int = SAMPLE_RATE
    frame_size: int = FRAME_SIZE
    replica: str | None = None  # behind `kame serve --ray`: the replica (engine) serving the session


TRUE_ONLY = ("backchannel", "settled")  # a transcript's flags, on the wire only when true


class TranscriptEvent(_Event):
    type: Literal["transcript"] = "transcript"
    final: bool
    text: str
    start_s: float  # audio time of the session (seconds of audio the client sent)
    end_s: float
    backchannel: Literal[True] | None = None  # only on a backchannel ("mm-hm" while the assistant spoke)
    settled: Literal[True] | None = None  # only on a partial whose words are settled (the speech paused)

    @field_validator(*TRUE_ONLY, mode="before")
    @classmethod
    def _only_when_true(cls, value: bool | None) -> Literal[True] | None:
        return True if value else None


class OracleEvent(_Event):
    type: Literal["oracle"] = "oracle"
    op: Literal["reset", "append"]
    epoch: int
    text: str
    tokens: int
    frame: int  # the session's frame index at which the update took effect
    accepted: bool = True  # False: a stale append, dropped
    late_tokens: int = 0  # tokens whose frame had already passed


class LLMEvent(_Event):
    type: Literal["llm"] = "llm"
    phase: Literal["started", "first_token", "done", "cancelled", "failed"]
    epoch: int
    backend: str
    trigger: str = ""
    user_text: str = ""
    latency_s: float | None = None  # first token: time since the request
    answer: str = ""
    oracle_tokens: int = 0  # with the last phase: the oracle tokens the attempt sent ...
    took_oracle: bool = False  # ... whether it became the oracle's owner ...
    kept_oracle: bool = False  # ... and, as owner, extended an older stream's agreeing oracle
    error_kind: str | None = None
    error: str | None = None
    retry_in_s: float | None = None


class ToolEvent(_Event):
    """A tool call of an LLM attempt (docs/protocol.md, "Tool calls and retrievals")."""

    type: Literal["tool"] = "tool"
    phase: Literal["started", "done", "failed", "cancelled"]
    epoch: int
    call_id: str
    name: str
    arguments: str
    result: str = ""  # with done/failed: the start of what went back to the LLM
    elapsed_s: float | None = None
    cached: bool = False
    truncated: bool = False
    error: str | None = None


class KnowledgeEvent(_Event):
    """An attempt's retrieval from the knowledge base."""

    type: Literal["knowledge"] = "knowledge"
    epoch: int
    query: str
    passages: int
    sources: list[str]
    tokens: int
    elapsed_s: float


class OracleLeadEvent(_Event):
    """End of the user's speech minus the time the oracle the answer used was applied (s)."""

    type: Literal["oracle_lead"] = "oracle_lead"
    lead_s: float  # positive: the front-end had its guidance before the user stopped
    epoch: int


class BackendEvent(_Event):
    type: Literal["backend"] = "backend"
    name: str
    model: str
    system_prompt: str


class AsrStatusEvent(_Event):
    type: Literal["asr"] = "asr"
    status: Literal["failed"]
    message: str


class StatsEvent(_Event):
    type: Literal["stats"] = "stats"
    frames_in: int
    frames_out: int
    frames_dropped: int
    frame_latency_ms: float | None = None  # median, audio frame in -> audio frame out, server side


class ErrorEvent(_Event):
    type: Literal["error"] = "error"
    code: str
    message: str


ServerEvent = Annotated[
    ReadyEvent | TranscriptEvent | OracleEvent | OracleLeadEvent | LLMEvent | BackendEvent | AsrStatusEvent | StatsEvent
    | ErrorEvent | ToolEvent | KnowledgeEvent,
    Field(discriminator="type"),
]
_server_events = TypeAdapter(ServerEvent)


def encode_event(event: _Event) -> bytes:
    return encode(Kind.EVENT, event.model_dump_json(exclude_none=True).encode())


def parse_event(payload: bytes) -> ServerEvent:
    try:
        return _server_events.validate_json(payload)
    except ValidationError as exc:
        raise ProtocolError(f"bad event: {_first_error(exc)}") from exc


# the JSON event of each session event that has one, and the fields the wire adds; the wire model
# takes the session event's fields that it names (audio, text and stats go out their own way)
_WIRE: dict[type, tuple[type[_Event], dict[str, str]]] = {
    Transcript: (TranscriptEvent, {}),
    OracleApplied: (OracleEvent, {}),
    LLMAttempt: (LLMEvent, {}),
    ToolCallEvent: (ToolEvent, {}),
    KnowledgeRetrieval: (KnowledgeEvent, {}),
    OracleLead: (OracleLeadEvent, {}),
    BackendChanged: (BackendEvent, {}),
    AsrFailed: (AsrStatusEvent, {"status": "failed"}),
    SessionFailed: (ErrorEvent, {}),
}


def wire_event(event: SessionEvent) -> _Event | None:
    """The JSON event a client with ?events=1 gets for a tandem session's `event` (the recorder and
    in-process runs write the same); None: no JSON event (audio, text and stats have their own)."""
    wire = _WIRE.get(type(event))
    if wire is None:
        return None
    model, added = wire
    fields = {f.name: getattr(event, f.name) for f in dataclasses.fields(event) if f.name in model.model_fields}
    return model(**fields, **added)


# what a wire event does not carry of its session event: unknown to a client, never made up
_NOT_ON_WIRE: dict[type, dict[str, object]] = {Transcript: {"lag_s": math.nan}}


def session_event(wire: _Event) -> SessionEvent | None:
    """The session event a wire event reports (`wire_event` read back: a client's conversation in the
    library's types); fields the wire does not carry take their defaults (a transcript's `lag_s`: NaN).
    None for a wire event no session event makes (ready, stats)."""
    for kind, (model, added) in _WIRE.items():
        if isinstance(wire, model):
            names = {f.name for f in dataclasses.fields(kind)}
            fields = {k: v for k, v in wire.model_dump().items() if k in names and k not in added}
            if isinstance(fields.get("sources"), list):
                fields["sources"] = tuple(fields["sources"])
            for flag in TRUE_ONLY:
                if flag in fields:
                    fields[flag] = bool(fields[flag])
            return kind(**(_NOT_ON_WIRE.get(kind, {}) | fields))
    return None


# ----------------------------------------------------------------- client -> server messages


class ConfigureMessage(BaseModel):
    """Choose or switch the LLM backend profile and/or the system prompt, at any time."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    type: Literal["configure"] = "configure"
    backend: str | None = Field(default=None, max_length=64)
    system_prompt: str | None = Field(default=None, max_length=4000)


ClientMessage = Annotated[ConfigureMessage, Field(discriminator="type")]
_client_messages = TypeAdapter(ClientMessage)


def parse_client_message(payload: bytes) -> ConfigureMessage:
    try:
        json.loads(payload)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"control message is not JSON: {exc}") from exc
    try:
        return _client_messages.validate_json(payload)
    except ValidationError as exc:
        raise ProtocolError(f"bad control message: {_first_error(exc)}") from exc


def encode_client_message(message: ConfigureMessage) -> bytes:
    return encode(Kind.CLIENT_JSON, message.model_dump_json(exclude_none=True).encode())


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(p) for p in error.get("loc", ())) or "message"
    return f"{where}: {error.get('msg', 'invalid')}"
