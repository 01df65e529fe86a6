"""Moshi's protocol as a mapping: the client's binary messages and the session's events in; messages
for the client, audio to decode or encode, and commands for the tandem session out (`take()`), in
order. No socket, no codec, no session: the carrier (`carrier.py`) carries the actions out."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from kame.backend.language import LanguageError, language_named
from kame.commands import Configure, PushAudio, SessionCommand
from kame.frontend.sampling import SAMPLING_PARAMETERS, Sampling
from kame.pcm import pcm16_decode, pcm16_encode
from kame.protocol import (
    ErrorEvent,
    Kind,
    ProtocolError,
    ReadyEvent,
    StatsEvent,
    decode,
    encode,
    encode_event,
    parse_client_message,
    wire_event,
)
from kame.session_events import AssistantAudio, AssistantText, SessionEvent, SessionFailed, SessionStats

# Per-session seeds cannot hold in a batch: every slot draws from the one generator of the device.
_IGNORED = ("text_seed", "audio_seed", "seed")


@dataclass(frozen=True)
class SessionOptions:
    """The connection's query parameters."""

    events: bool = False  # send JSON events (kind 7)
    audio: str = "opus"  # "opus" (Moshi's) or "pcm" (raw PCM16, kind 9)
    backend: str | None = None
    asr: bool = True  # False (?asr=off): no transcripts, no oracle: the front-end alone (plain Moshi)
    oracle_delay_s: float = 0.0  # hold every oracle update back this long (latency experiments)
    realtime: bool = True  # False (?realtime=0): the client sends faster than real time; no frame is skipped
    sampling: dict[str, float | int] = field(default_factory=dict)  # Moshi's sampling query parameters
    ignored: tuple[str, ...] = ()  # parameters Moshi's clients send that this server cannot honour
    persona: str | None = None  # PersonaPlex's `text_prompt`: the role text a PersonaPlex-layout front-end takes
    language: str | None = None  # ?language=ja: the language the backend thinks in (None: the server's)
    voice: str | None = None  # PersonaPlex's `voice_prompt`: a voice by name (NATF2.pt)

    @classmethod
    def from_query(cls, params) -> SessionOptions:
        audio = params.get("audio", "opus")
        if audio not in ("opus", "pcm"):
            raise ProtocolError(f"audio must be 'opus' or 'pcm', not {audio!r}")
        try:
            delay = float(params.get("oracle_delay", "0"))
        except ValueError as exc:
            raise ProtocolError("oracle_delay must be a number of seconds") from exc
        if not 0 <= delay <= 30:
            raise ProtocolError("oracle_delay must be between 0 and 30 seconds")
        asked = {name: params[name] for name in SAMPLING_PARAMETERS if name in params}
        try:
            sampling = {name: getattr(Sampling().updated(asked), name) for name in asked}
        except ValueError as exc:
            raise ProtocolError(str(exc)) from exc
        return cls(_flag(params, "events", False), audio, params.get("backend"), _flag(params, "asr", True), delay,
                   _flag(params, "realtime", True), sampling, tuple(name for name in _IGNORED if name in params),
                   params.get("text_prompt") or None, _language(params.get("language")),
                   params.get("voice_prompt") or None)


def _language(value: str | None) -> str | None:
    if value is None or not value.strip():  # unset or empty: the server's
        return None
    try:
        return language_named(value).code
    except LanguageError as exc:
        raise ProtocolError(f"language: {exc}") from exc


def _flag(params, name: str, default: bool) -> bool:
    value = params.get(name)
    if value is None:
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off", "none"):
        return False
    raise ProtocolError(f"{name} must be 1 or 0, not {value!r}")


# ------------------------------------------------------------------------ what the mapping asks for


@dataclass(frozen=True)
class Send:
    """A message for the client; droppable ones (audio) go first for a slow reader."""

    message: bytes
    droppable: bool = False


@dataclass(frozen=True)
class Record:
    """A line for the session's recording (what the client would read with ?events=1)."""

    event: dict


@dataclass(frozen=True)
class DecodeOpus:
    """The client's Ogg/Opus pages: decoded, they go to the session as a PushAudio."""

    payload: bytes


@dataclass(frozen=True)
class EncodeOpus:
    """A frame of the assistant's audio: encoded, it goes to the client as a kind-1 message."""

    pcm: np.ndarray


@dataclass(frozen=True)
class End:
    reason: str  # the session cannot go on (after the error message before this)


Action = Send | Record | DecodeOpus | EncodeOpus | End | SessionCommand


@dataclass(frozen=True)
class MoshiFacts:
    """What the greeting tells the client of this server and this session."""

    session_id: str
    frontend: str
    asr: str  # the server's ASR ("none" where this session has none)
    backend: str
    backends: tuple[str, ...]
    system_prompt: str
    metadata: dict  # the kind-4 message's other facts (sampling, version, device, slots)
    replica: str | None = None


class MoshiMapping:
    def __init__(self, options: SessionOptions, max_message_bytes: int) -> None:
        self.options, self.max_message_bytes = options, max_message_bytes
        self._actions: list[Action] = []

    def take(self) -> list[Action]:
        actions, self._actions = self._actions, []
        return actions

    def greet(self, facts: MoshiFacts) -> None:
        """The handshake, the metadata (Moshi's web client shows it) and KAME's ready event."""
        self._actions += [Send(encode(Kind.HANDSHAKE)),
                          Send(encode(Kind.METADATA, json.dumps(facts.metadata).encode()))]
        self._event(ReadyEvent(session_id=facts.session_id, frontend=facts.frontend, asr=facts.asr,
                               backend=facts.backend, backends=list(facts.backends),
                               system_prompt=facts.system_prompt, audio=self.options.audio, replica=facts.replica))

    def on_client(self, data: bytes | str) -> None:
        """One client message; ProtocolError for a bad one (nothing is queued for it)."""
        if not isinstance(data, bytes):
            raise ProtocolError("text frames are not part of the protocol: send binary messages")
        if len(data) > self.max_message_bytes:
            raise ProtocolError(f"message of {len(data)} bytes exceeds {self.max_message_bytes}")
        kind, payload = decode(data)
        if kind is Kind.AUDIO:
            self._actions.append(DecodeOpus(payload))
        elif kind is Kind.PCM:
            self._actions.append(PushAudio(pcm16_decode(payload)))
        elif kind is Kind.CLIENT_JSON:
            message = parse_client_message(payload)
            self._actions.append(Configure(backend=message.backend, system_prompt=message.system_prompt))
        elif kind is not Kind.PING:
            raise ProtocolError(f"a client may not send message kind {int(kind)} ({kind.name.lower()})")

    def on_session(self, event: SessionEvent, queue_dropped: int = 0) -> None:
        """One event of the tandem session; `queue_dropped`: audio messages the client's queue dropped."""
        if isinstance(event, AssistantAudio):
            if self.options.audio == "pcm":
                self._actions.append(Send(encode(Kind.PCM, pcm16_encode(event.pcm)), droppable=True))
            else:
                self._actions.append(EncodeOpus(event.pcm))
        elif isinstance(event, AssistantText):
            self._actions.append(Send(encode(Kind.TEXT, event.text.encode())))
        elif isinstance(event, SessionStats):
            self._event(StatsEvent(frames_in=event.frames_in, frames_out=event.frames_out,
                                   frames_dropped=event.frames_dropped + queue_dropped,
                                   frame_latency_ms=event.frame_latency_ms), record=False)
        elif isinstance(event, SessionFailed):
            self.error(event.code, event.message, record=False)
            self._actions.append(End("engine failure" if event.code == "engine" else "internal error"))
        elif self.options.events and (wire := wire_event(event)) is not None:
            self._actions.append(Send(encode_event(wire)))

    def encoded(self, opus: bytes) -> None:
        """The carrier's Ogg/Opus for an EncodeOpus (nothing where the encoder had no page yet)."""
        if opus:
            self._actions.append(Send(encode(Kind.AUDIO, opus), droppable=True))

    def error(self, code: str, message: str, record: bool = True) -> None:
        """An error the client must be told about: an error event with ?events=1, else Moshi's kind 5."""
        if self.options.events:
            self._event(ErrorEvent(code=code, message=message), record)
        else:
            if record:
                self._actions.append(Record({"type": "error", "code": code, "message": message}))
            self._actions.append(Send(encode(Kind.ERROR, message.encode())))

    def _event(self, event, record: bool = True) -> None:
        if record:
            self._actions.append(Record(event.model_dump(exclude_none=True)))
        if self.options.events:
            self._actions.append(Send(encode_event(event)))
