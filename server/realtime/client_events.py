"""The client's Realtime events as one pydantic union: `parse(text)` turns a JSON text frame into a
typed, frozen event or raises `RealtimeError` with the protocol's code and the parameter at fault.

GA field names and the beta ones (`input_audio_format`, top-level `turn_detection`, `modalities`,
...) are both read; fields this server does not use are ignored, as OpenAI's server ignores them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PlainValidator,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
    TypeAdapter,
    ValidationError,
)

from kame.audio import SAMPLE_RATE
from kame.pcm import (
    TELEPHONE_RATE,
    Resampler,
    alaw_decode,
    alaw_encode,
    pcm16_decode,
    pcm16_encode,
    ulaw_decode,
    ulaw_encode,
)
from kame.protocol import ProtocolError

_BETA_FORMATS = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}


class RealtimeError(ProtocolError):
    """A bad client event: reported as an `error` event; the session goes on."""

    def __init__(self, code: str, message: str, param: str | None = None, client_event_id: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param, self.client_event_id = code, param, client_event_id


@dataclass(frozen=True)
class AudioFormat:
    type: str = "audio/pcm"  # audio/pcm (PCM16 LE, 24 kHz), audio/pcmu, audio/pcma (G.711, 8 kHz)

    @classmethod
    def parse(cls, value: object) -> AudioFormat:
        """GA's {"type": ..., "rate": ...} or a beta name ("pcm16", "g711_ulaw", "g711_alaw")."""
        if isinstance(value, AudioFormat):
            return value
        if isinstance(value, str) and value in _BETA_FORMATS:
            return cls(_BETA_FORMATS[value])
        if not isinstance(value, dict) or value.get("type") not in ("audio/pcm", "audio/pcmu", "audio/pcma"):
            raise ValueError("the format is audio/pcm, audio/pcmu or audio/pcma")
        rate = value.get("rate")
        if value["type"] == "audio/pcm" and rate not in (None, SAMPLE_RATE):
            raise ValueError(f"audio/pcm is served at {SAMPLE_RATE} Hz only, not {rate}")
        return cls(value["type"])

    def as_dict(self) -> dict:
        return {"type": self.type, **({"rate": SAMPLE_RATE} if self.type == "audio/pcm" else {})}

    @property
    def rate(self) -> int:
        return SAMPLE_RATE if self.type == "audio/pcm" else TELEPHONE_RATE

    def decoder(self):
        """bytes -> float32 at 24 kHz, carrying the resampler's state."""
        if self.type == "audio/pcm":
            return pcm16_decode
        decode = ulaw_decode if self.type == "audio/pcmu" else alaw_decode
        upsample = Resampler(TELEPHONE_RATE, SAMPLE_RATE)
        return lambda data: upsample(decode(data))

    def encoder(self):
        """float32 at 24 kHz -> bytes, carrying the resampler's state."""
        if self.type == "audio/pcm":
            return pcm16_encode
        encode = ulaw_encode if self.type == "audio/pcmu" else alaw_encode
        downsample = Resampler(SAMPLE_RATE, TELEPHONE_RATE)
        return lambda pcm: encode(downsample(pcm))


def _number(low: float, high: float):
    """A JSON number from `low` to `high` (true/false are not numbers)."""
    def check(value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
            raise ValueError(f"a number from {low} to {high}")
        return float(value)
    return Annotated[float, PlainValidator(check)]


Format = Annotated[AudioFormat, PlainValidator(AudioFormat.parse)]
Modalities = Annotated[list[Literal["audio", "text"]], Field(min_length=1)]


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    def given(self, name: str) -> bool:
        """The client sent this field (null included)."""
        return name in self.model_fields_set


class TurnDetection(_In):
    type: Literal["server_vad", "semantic_vad"]
    create_response: StrictBool | None = None
    interrupt_response: StrictBool | None = None
    eagerness: Literal["low", "medium", "high", "auto"] = "auto"


class AudioInput(_In):
    format: Format | None = None
    turn_detection: TurnDetection | None = None
    transcription: dict[str, Any] | None = None


class AudioOutput(_In):
    format: Format | None = None
    voice: StrictStr | None = None


class Audio(_In):
    input: AudioInput = AudioInput()
    output: AudioOutput = AudioOutput()


class KameOptions(_In):
    """`session.kame`: this server's own settings (docs/realtime.md)."""

    backend: StrictStr | None = None
    oracle_delay_s: _number(0, 30) | None = None
    events: StrictBool | None = None
    feed_silence: StrictBool | None = None
    activity: Literal["text", "text+audio"] | None = None
    quiet_s: _number(0.16, 5) | None = None


class SessionConfigIn(_In):
    type: Literal["realtime"] = "realtime"  # a transcription session is not served
    audio: Audio = Audio()
    input_audio_format: Format | None = None  # beta
    output_audio_format: Format | None = None  # beta
    turn_detection: TurnDetection | None = None  # beta
    input_audio_transcription: dict[str, Any] | None = None  # beta
    output_modalities: Modalities | None = None
    modalities: Modalities | None = None  # beta
    voice: StrictStr | None = None  # beta
    kame: KameOptions = KameOptions()
    instructions: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None  # kept as sent (echoed in session.updated); functions below
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] = "auto"
    model: StrictStr | None = None


class FunctionTool(_In):
    """A function the client declares: the backend LLM may call it; the client runs it."""

    type: Literal["function"] = "function"
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


FUNCTION_TOOLS = TypeAdapter(list[FunctionTool])


class SessionUpdate(_In):
    type: Literal["session.update"]
    session: SessionConfigIn


class AudioAppend(_In):
    type: Literal["input_audio_buffer.append"]
    audio: StrictStr  # base64


class AudioCommit(_In):
    type: Literal["input_audio_buffer.commit"]


class AudioClear(_In):
    type: Literal["input_audio_buffer.clear"]


class InputText(_In):
    type: Literal["input_text"]
    text: StrictStr


class UserMessage(_In):
    type: Literal["message"] = "message"
    role: Literal["user"]  # the assistant's turns are what the front-end says
    content: Annotated[list[InputText], Field(min_length=1)]  # audio comes with input_audio_buffer.append
    id: Annotated[StrictStr, Field(min_length=1)] | None = None


class FunctionCallOutput(_In):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr
    id: StrictStr | None = None


class FunctionCall(_In):
    type: Literal["function_call"]  # the model's to make: refused


def _item_kind(value: object) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else "message"
    return kind if kind in ("function_call_output", "function_call") else "message"


class ItemCreate(_In):
    type: Literal["conversation.item.create"]
    item: Annotated[Annotated[UserMessage, Tag("message")] | Annotated[FunctionCallOutput, Tag("function_call_output")]
                    | Annotated[FunctionCall, Tag("function_call")], Discriminator(_item_kind)]


class ItemTruncate(_In):
    codes: ClassVar[dict[str, str]] = {"item_id": "item_truncate_invalid_item_id"}
    type: Literal["conversation.item.truncate"]
    item_id: StrictStr
    content_index: StrictInt = 0
    audio_end_ms: Annotated[StrictInt, Field(ge=0)]


class ItemRetrieve(_In):
    codes: ClassVar[dict[str, str]] = {"item_id": "item_retrieve_invalid_item_id"}
    type: Literal["conversation.item.retrieve"]
    item_id: StrictStr


class ResponseOptions(_In):
    metadata: dict[str, StrictStr] | None = None


class ResponseCreate(_In):
    type: Literal["response.create"]
    response: ResponseOptions = ResponseOptions()


class ResponseCancel(_In):
    type: Literal["response.cancel"]


class Refused(_In):
    """A client event of the protocol that this server cannot serve."""

    type: Literal["conversation.item.delete", "output_audio_buffer.clear"]

    @property
    def why(self) -> str:
        return {"conversation.item.delete": "the conversation the LLM sees cannot drop a turn",
                "output_audio_buffer.clear": "it is a WebRTC event"}[self.type]


ClientEvent = (SessionUpdate | AudioAppend | AudioCommit | AudioClear | ItemCreate | ItemTruncate | ItemRetrieve
               | ResponseCreate | ResponseCancel | Refused)
_MODELS: dict[str, type[_In]] = {name: model for model in ClientEvent.__args__
                                 for name in model.model_fields["type"].annotation.__args__}
_EVENTS = TypeAdapter(Annotated[ClientEvent, Field(discriminator="type")])


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def decode_frame(text: str | None, limit_bytes: int, error: type[ProtocolError]) -> tuple[dict, str | None]:
    """A client's text frame -> (the JSON object, its event_id), or `error(code, message)` for a frame
    that is binary, too long, not JSON or not an object with a string `type` (Realtime and GPT-Live)."""
    if text is None:
        raise error("invalid_event", "events are JSON text frames, not binary")
    if len(text) > limit_bytes:
        raise error("event_too_large", f"an event of {len(text)} bytes exceeds {limit_bytes}")
    try:
        raw = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise error("invalid_json", f"the event is not JSON: {exc}") from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise error("invalid_event", "an event is a JSON object with a string 'type'")
    return raw, raw.get("event_id") if isinstance(raw.get("event_id"), str) else None


def parse(text: str | None, limit_bytes: int) -> tuple[ClientEvent, str | None]:
    """A client's text frame -> (event, its event_id)."""
    raw, event_id = decode_frame(text, limit_bytes, RealtimeError)
    model = _MODELS.get(raw["type"])
    if model is None:
        raise RealtimeError("unknown_event", f"unknown or unsupported event type {raw['type']!r}", "type", event_id)
    try:
        return _EVENTS.validate_python(raw), event_id
    except ValidationError as exc:
        raise invalid(exc, getattr(model, "codes", {}), event_id=event_id, tag=raw["type"]) from None


def invalid(exc: ValidationError, codes: dict[str, str] | None = None, prefix: tuple = (),
            event_id: str | None = None, tag: str | None = None) -> RealtimeError:
    """pydantic's first complaint as the protocol's error, naming the parameter at fault."""
    error = exc.errors(include_url=False)[0]
    loc = error["loc"][1:] if tag is not None and error["loc"][:1] == (tag,) else error["loc"]
    loc = prefix + tuple(part for part in loc if not _is_tag(part))
    param = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".") or None
    message = error["msg"].removeprefix("Value error, ")
    code = (codes or {}).get(str(loc[0]) if loc else "", "invalid_value")
    return RealtimeError(code, f"{param}: {message}" if param else message, param, event_id)


def _is_tag(part: object) -> bool:
    """The union's own steps in a location (`function_call_output`, `literal['...']`), not fields."""
    return isinstance(part, str) and (part in ("message", "function_call_output", "function_call")
                                      or part.startswith(("literal[", "function-", "lax-", "strict-")))
