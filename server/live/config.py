"""A GPT-Live session's configuration: what `session.start` asked for, resolved against this
server (its profiles, its front-end), and the session resource echoed in `session.started`,
`session.updated` and `session.closed`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from openai.types.live import SessionConfig, SessionUpdateConfig

from kame.aec import EchoOptions
from kame.audio import SAMPLE_RATE
from kame.backend.decide import Question
from kame.pcm import Resampler, pcm16_decode, pcm16_encode
from kame.tools.base import TOOL_NAME, ToolSpec
from server.live.client_events import LiveError
from server.realtime.client_events import AudioFormat as RealtimeFormat

DEFAULT_FORMAT = {"type": "audio/pcm", "rate": SAMPLE_RATE}
DEFAULT_VOICE = "kame"  # the front-end's own voice: a checkpoint has one


@dataclass(frozen=True)
class LiveFacts:
    """What the mapping knows of the server and of its session when the connection opens."""

    session_id: str
    profiles: dict[str, str]  # backend profile -> its model: what `delegation.responses.model` may name
    default_profile: str
    system_prompt: str  # the planner's, before the client's instructions
    max_event_bytes: int  # a text frame longer than this is refused unread
    expires_at: int  # unix seconds: the session's length limit
    transport: str = "websocket"  # or "webrtc": audio on a media track, not in events
    events: bool = False  # kame.* extension events (opt-in: `?kame_events=true`)
    usage_interval_s: float = 15.0
    echo: EchoOptions = EchoOptions()  # echo cancellation of telephone (G.711) sessions ([echo], docs/echo.md)
    tool_timeout_s: float = 15.0  # a client function tool's output is awaited this long, then an error event
    zero_silence_s: float = 0.0  # the assistant's audio is zeros after this long without a word (silence.py); 0: off


@dataclass(frozen=True)
class LiveConfig:
    model: str
    delegation: str  # "client" or "responses"
    backend: str  # the LLM profile of responses delegation
    responses: dict  # responses delegation's settings as given (echoed), {} for client delegation
    instructions: str | None  # front-end instructions: the planner's prompt gains them
    appended: tuple[str, ...] = ()  # session.instructions.append, in order
    acknowledgement_delay_ms: int = 0
    audio_format: dict = dataclasses.field(default_factory=lambda: dict(DEFAULT_FORMAT))
    voice: str = DEFAULT_VOICE
    history: tuple[tuple[str, str], ...] = ()  # (role, text) of `session.input`
    substituted: str | None = None  # responses.model named no profile: the one used instead
    tools: tuple[ToolSpec, ...] = ()  # responses.tools: the client's function tools
    tool_choice: str | dict | None = None  # responses.tool_choice, as Chat Completions takes it
    decisions: dict = dataclasses.field(default_factory=dict)  # decisions delegation's settings as given (echoed)
    triggers: tuple[dict, ...] = ()  # session.triggers as given (echoed): at most one per transcript event type

    @classmethod
    def start(cls, session: SessionConfig, facts: LiveFacts, transport: str) -> LiveConfig:
        """The config `session.start` asks for; LiveError for what this server cannot do."""
        delegation = session.delegation
        kind = "client" if delegation is None else delegation.type
        audio_format = dict(DEFAULT_FORMAT)
        if session.audio is not None and session.audio.format is not None:
            if transport != "websocket":
                raise LiveError("invalid_value", "Only WebSocket sessions take audio.format; WebRTC negotiates "
                                "its media format.", "session.audio.format")
            audio_format = session.audio.format.model_dump(exclude_none=True)
            if audio_format["type"] != "audio/pcm" and audio_format.get("rate") != 8000:
                raise LiveError("invalid_value", "G.711 audio uses 8000 Hz.", "session.audio.format.rate")
        voice = session.audio.output.voice if session.audio and session.audio.output else None
        responses = delegation.responses.model_dump(exclude_none=True) if kind == "responses" else {}
        decisions = delegation.decisions.model_dump(exclude_none=True) if kind == "decisions" else {}
        backend, substituted = _profile((responses or decisions).get("model"), facts)
        triggers = _triggers(session.triggers or [])
        ack_default = DECISIONS_ACK_MS if kind == "decisions" else 0
        history = tuple((item.role, " ".join(part.text for part in item.content)) for item in session.input or ())
        tools, tool_choice = client_tools(responses)
        ack = delegation.acknowledgement_delay_ms if delegation is not None else None
        return cls(model=session.model, delegation=kind, backend=backend, responses=responses,
                   instructions=(session.instructions or "").strip() or None,
                   acknowledgement_delay_ms=ack_default if ack is None else ack,
                   audio_format=audio_format, voice=voice if isinstance(voice, str) else DEFAULT_VOICE,
                   history=history, substituted=substituted, tools=tools, tool_choice=tool_choice,
                   decisions=decisions, triggers=triggers)

    def updated(self, update: SessionUpdateConfig, facts: LiveFacts) -> LiveConfig:
        """This config with `session.update` (delegation settings and triggers; the delegation type stays)."""
        new = self
        if update.triggers is not None:  # omitted: kept; a list: replaces them; []: none
            new = dataclasses.replace(new, triggers=_triggers(update.triggers))
        delegation = update.delegation
        if delegation is None:
            return new
        if delegation.type != self.delegation:
            raise LiveError("invalid_value", f"The delegation type cannot change (it is {self.delegation!r}).",
                            "session.delegation.type")
        if delegation.acknowledgement_delay_ms is not None:
            new = dataclasses.replace(new, acknowledgement_delay_ms=delegation.acknowledgement_delay_ms)
        given = getattr(delegation, "responses", None)
        if given is not None:
            responses = {**self.responses, **given.model_dump(exclude_none=True)}
            backend, substituted = _profile(responses.get("model"), facts)
            tools, tool_choice = client_tools(responses)
            new = dataclasses.replace(new, responses=responses, backend=backend, substituted=substituted,
                                      tools=tools, tool_choice=tool_choice)
        given = getattr(delegation, "decisions", None)
        if given is not None:
            decisions = {**self.decisions, **given.model_dump(exclude_none=True)}
            backend, substituted = _profile(decisions.get("model"), facts)
            new = dataclasses.replace(new, decisions=decisions, backend=backend, substituted=substituted)
        return new

    @property
    def delegated_model(self) -> str | None:
        """The model Responses or Decisions delegation names (None for client delegation, or none named)."""
        return (self.responses or self.decisions).get("model")

    def with_instructions(self, text: str) -> LiveConfig:
        return dataclasses.replace(self, appended=(*self.appended, text))

    def system_prompt(self, facts: LiveFacts) -> str:
        """The planner's prompt: the backend's instructions (or the server's), then the front-end's
        instructions and what the client appended."""
        base = self.responses.get("instructions") or facts.system_prompt
        extra = [text for text in (self.instructions, *self.appended) if text]
        return "\n\n".join([base, *extra])

    def resource(self, facts: LiveFacts) -> dict:
        """The session resource (`SessionResource`): the resolved config and the server's metadata."""
        delegation = {"type": self.delegation, "acknowledgement_delay_ms": self.acknowledgement_delay_ms}
        if self.delegation == "responses":
            delegation["responses"] = {**self.responses, "model": self.responses.get("model") or self.backend}
        elif self.delegation == "decisions":
            delegation["decisions"] = {**self.decisions, "model": self.decisions.get("model") or self.backend}
        resource = {"id": facts.session_id, "expires_at": facts.expires_at,
                    "model": self.model, "status": "active", "delegation": delegation,
                    "audio": {"output": {"voice": self.voice}}}
        if facts.transport == "websocket":
            resource["audio"]["format"] = self.audio_format
        if self.instructions is not None:
            resource["instructions"] = self.instructions
        if self.triggers:
            resource["triggers"] = list(self.triggers)
        return resource

    def questions(self) -> tuple[Question, ...]:
        """Decisions delegation's questions, as the backend asks them."""
        return tuple(Question.of(q) for q in self.decisions.get("questions") or ())

    def trigger_questions(self, event_type: str) -> tuple[Question, ...]:
        """The questions of the trigger on `event_type` (a transcript delta's type); () when none is set."""
        for trigger in self.triggers:
            if trigger["event_type"] == event_type:
                return tuple(Question.of(q) for q in trigger["decisions"]["questions"])
        return ()

    def decoder(self):
        """bytes of the client's format -> float32 at 24 kHz, streaming: the Realtime endpoint's codecs
        (PCM16 at 24 kHz, G.711), and 16 kHz PCM16 resampled (kame/pcm.py: each chunk's share at once)."""
        if self._pcm_rate in (None, SAMPLE_RATE):
            return RealtimeFormat(self.audio_format["type"]).decoder()
        resample = Resampler(self._pcm_rate, SAMPLE_RATE)
        return lambda data: resample(pcm16_decode(data))

    def encoder(self):
        """float32 at 24 kHz -> bytes of the client's format, streaming."""
        if self._pcm_rate in (None, SAMPLE_RATE):
            return RealtimeFormat(self.audio_format["type"]).encoder()
        resample = Resampler(SAMPLE_RATE, self._pcm_rate)
        return lambda pcm: pcm16_encode(resample(pcm))

    @property
    def _pcm_rate(self) -> int | None:
        """The rate of PCM16 audio; None for G.711 (8 kHz, the Realtime codecs' own)."""
        return self.audio_format.get("rate", SAMPLE_RATE) if self.audio_format["type"] == "audio/pcm" else None

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self.audio_format["type"] == "audio/pcm" else 1


DECISIONS_ACK_MS = 400  # Decisions delegation's default acknowledgement delay (the protocol's)


def _triggers(triggers: list) -> tuple[dict, ...]:
    """`session.triggers` as given; LiveError for two on one transcript event type."""
    given = tuple(trigger.model_dump(exclude_none=True) for trigger in triggers)
    seen = [trigger["event_type"] for trigger in given]
    for index, event_type in enumerate(seen):
        if event_type in seen[:index]:
            raise LiveError("invalid_value", f"At most one trigger per event type: {event_type!r} has two.",
                            f"session.triggers[{index}].event_type")
    return given


TOOLS_PARAM = "session.delegation.responses.tools"
CHOICES = ("auto", "none", "required")


def client_tools(responses: dict) -> tuple[tuple[ToolSpec, ...], str | dict | None]:
    """Responses delegation's function tools as the planner's specs, and its `tool_choice` as Chat Completions
    takes it. The tools OpenAI hosts (web search, files, code, MCP) do not run here: refused by name."""
    specs = []
    for index, tool in enumerate(responses.get("tools") or ()):
        if tool.get("type") != "function":
            raise LiveError("unsupported_parameter", f"Only function tools run on this server, not "
                            f"{tool.get('type')!r} (a tool OpenAI hosts).", f"{TOOLS_PARAM}[{index}].type")
        name = tool.get("name", "")
        if not TOOL_NAME.fullmatch(name) or any(spec.name == name for spec in specs):
            raise LiveError("invalid_value", f"Invalid or repeated function name {name!r}.",
                            f"{TOOLS_PARAM}[{index}].name")
        specs.append(ToolSpec(name, tool.get("description") or "",
                              tool.get("parameters") or {"type": "object", "properties": {}}))
    return tuple(specs), _tool_choice(responses.get("tool_choice"), specs)


def _tool_choice(choice: object, specs: list[ToolSpec]) -> str | dict | None:
    param = "session.delegation.responses.tool_choice"
    if choice is None or choice in CHOICES:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not any(spec.name == choice.get("name") for spec in specs):
            raise LiveError("invalid_value", f"tool_choice names no function tool: {choice.get('name')!r}.",
                            f"{param}.name")
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise LiveError("unsupported_parameter", f"tool_choice {kind!r} is not supported here: auto, none, required "
                    "or one function.", param)


def serving_profile(model: str | None, profiles: Mapping[str, str]) -> str | None:
    """The backend profile a session's `model` names (`profiles`: profile -> its model): a profile's name, else a
    profile serving that model; None for an unknown or missing one."""
    if model in profiles:
        return model
    return next((name for name, served in profiles.items() if served == model), None)


def _profile(model: str | None, facts: LiveFacts) -> tuple[str, str | None]:
    """The backend profile `responses.model` names; an unknown or missing name gets the server's default (and
    says which, when one was named)."""
    named = serving_profile(model, facts.profiles)
    if named is not None:
        return named, None
    return facts.default_profile, (model and facts.default_profile)
