"""The session as the client configured it (`session.update`), and the session object the server
echoes in `session.created` / `session.updated`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pydantic import ValidationError

from kame.aec import EchoOptions
from kame.commands import Configure, SetOracleDelay
from kame.tools.base import ToolSpec
from server.realtime.actions import Action, SetClientTools
from server.realtime.client_events import (
    FUNCTION_TOOLS,
    AudioFormat,
    RealtimeError,
    SessionConfigIn,
    TurnDetection,
    invalid,
)
from server.settings import RealtimeSettings


@dataclass(frozen=True)
class SessionFacts:
    """What the mapping knows of the server and of its tandem session when it opens."""

    session_id: str
    frontend: str  # the front-end's source
    asr: str  # the ASR's name: the transcription model, whatever the client names
    profiles: tuple[str, ...]  # the backend profiles a client may pick
    backend: str  # the session's backend profile
    system_prompt: str
    server_vad: dict  # the turn detection the server actually does (the ASR's endpointing)
    options: RealtimeSettings
    max_event_bytes: int  # a text frame longer than this is refused unread
    echo: EchoOptions = EchoOptions()  # echo cancellation of telephone input ([echo], docs/echo.md)


@dataclass(frozen=True)
class RealtimeConfig:
    model: str
    instructions: str
    backend: str
    turn_detection: dict | None
    transcription: dict | None
    quiet_s: float
    activity: str  # what opens a response: "text", or "text+audio" (audio energy too)
    input_format: AudioFormat = AudioFormat()
    output_format: AudioFormat = AudioFormat()
    output_modalities: tuple[str, ...] = ("audio",)
    voice: str = "kame"
    tools: tuple[dict, ...] = ()
    tool_choice: object = "auto"
    events: bool = False  # kame.* extension events
    feed_silence: bool = True  # while the client sends no audio, the front-end hears silence in real time

    @classmethod
    def initial(cls, model: str, facts: SessionFacts) -> RealtimeConfig:
        return cls(model=model or "kame", instructions=facts.system_prompt, backend=facts.backend,
                   turn_detection=facts.server_vad, transcription={"model": facts.asr},
                   quiet_s=facts.options.quiet_s, activity=facts.options.activity)

    @property
    def auto_respond(self) -> bool:
        return self.turn_detection is not None and self.turn_detection.get("create_response", True) is not False

    @property
    def interrupts(self) -> bool:
        return (self.turn_detection or {}).get("interrupt_response", True) is not False

    def updated(self, session: SessionConfigIn, facts: SessionFacts) -> tuple[RealtimeConfig, list[Action]]:
        """This config with the client's update, and the session calls it takes; RealtimeError for a
        bad one, before anything changed."""
        inp, out, kame = session.audio.input, session.audio.output, session.kame
        new: dict = {}
        for field, given in (("input_format", (inp, "format", session, "input_audio_format")),
                             ("output_format", (out, "format", session, "output_audio_format"))):
            value = _either(*given)
            if value is not None:
                new[field] = value
        if inp.given("turn_detection") or session.given("turn_detection"):
            new["turn_detection"] = _turn_detection(inp.turn_detection if inp.given("turn_detection")
                                                    else session.turn_detection, facts.server_vad)
        if inp.given("transcription") or session.given("input_audio_transcription"):
            value = inp.transcription if inp.given("transcription") else session.input_audio_transcription
            new["transcription"] = None if value is None else {**value, "model": facts.asr}
        modalities = session.output_modalities or session.modalities
        if modalities is not None:
            new["output_modalities"] = ("audio",) if "audio" in modalities else ("text",)
        voice = out.voice or session.voice
        if voice is not None:
            new["voice"] = voice
        if kame.backend is not None and kame.backend not in facts.profiles:
            raise RealtimeError("invalid_value", f"unknown backend profile {kame.backend!r}; known: "
                                f"{', '.join(facts.profiles)}", "session.kame.backend")
        for field in ("events", "feed_silence", "activity", "quiet_s"):
            if getattr(kame, field) is not None:
                new[field] = getattr(kame, field)
        if session.instructions is not None:
            new["instructions"] = session.instructions
        if session.tools is not None:
            new["tools"] = tuple(session.tools)
        if session.given("tool_choice"):
            new["tool_choice"] = session.tool_choice
        if session.model is not None:
            new["model"] = session.model
        if kame.backend is not None:
            new["backend"] = kame.backend
        config = dataclasses.replace(self, **new)
        specs = _function_specs(list(config.tools) if config.tool_choice != "none" else [])
        # everything checked: the calls that apply it
        calls: list[Action] = []
        if kame.backend is not None or session.instructions is not None:
            calls.append(Configure(kame.backend, session.instructions))
        if kame.oracle_delay_s is not None:
            calls.append(SetOracleDelay(kame.oracle_delay_s))
        if session.tools is not None or session.given("tool_choice"):
            calls.append(SetClientTools(specs, facts.options.tool_timeout_s))
        return config, calls

    def session_object(self, facts: SessionFacts) -> dict:
        return {
            "type": "realtime", "object": "realtime.session", "id": f"sess_{facts.session_id}", "model": self.model,
            "output_modalities": list(self.output_modalities), "instructions": self.instructions,
            "audio": {
                "input": {"format": self.input_format.as_dict(), "transcription": self.transcription,
                          "turn_detection": self.turn_detection, "noise_reduction": None},
                "output": {"format": self.output_format.as_dict(), "voice": self.voice, "speed": 1.0},
            },
            "tools": list(self.tools), "tool_choice": self.tool_choice, "max_output_tokens": "inf",
            "tracing": None, "truncation": "auto", "prompt": None, "include": None,
            "kame": {"frontend": facts.frontend, "asr": facts.asr, "events": self.events,
                     "quiet_s": self.quiet_s, "activity": self.activity, "feed_silence": self.feed_silence,
                     "backend": self.backend, "backends": list(facts.profiles)},
        }


def _either(ga, ga_field: str, beta, beta_field: str):
    return getattr(ga, ga_field) if ga.given(ga_field) else getattr(beta, beta_field)


def _turn_detection(value: TurnDetection | None, server_vad: dict) -> dict | None:
    if value is None:
        return None
    detection = server_vad | {"type": value.type}
    for key in ("create_response", "interrupt_response"):
        if getattr(value, key) is not None:
            detection[key] = getattr(value, key)
    if value.type == "semantic_vad":
        detection = {"type": "semantic_vad", "eagerness": value.eagerness,
                     "create_response": detection["create_response"],
                     "interrupt_response": detection["interrupt_response"]}
    return detection


def _function_specs(tools: list[dict]) -> tuple[ToolSpec, ...]:
    """The client's `{"type": "function", "name", "description", "parameters"}` tools."""
    try:
        functions = FUNCTION_TOOLS.validate_python(tools)
    except ValidationError as exc:
        raise invalid(exc, prefix=("session", "tools")) from None
    return tuple(ToolSpec(f.name, f.description or "", f.parameters or {"type": "object", "properties": {}})
                 for f in functions)
