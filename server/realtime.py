"""The OpenAI Realtime API (`/v1/realtime`, GA event names) as a transport over one TandemSession.

The front-end speaks continuously; the Realtime protocol thinks in responses. A response is a
burst of assistant speech: it opens when the front-end starts producing text (or, with
`[realtime] activity = "text+audio"`, audio energy) after quiet, and closes after `quiet_s`
without it; quiet frames between responses are not sent. The user's side comes from the
session's streaming ASR: its first partial transcript of an utterance is `speech_started`, its
final is `speech_stopped` + `committed` + the user item. Tools the client declares become
function calls the backend LLM may make: each is sent as a response of its own with a
`function_call` item, and the client's `function_call_output` goes back to the LLM, whose stream
goes on. docs/realtime.md has the whole mapping.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import dataclasses
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
from starlette.websockets import WebSocket

from kame.audio import FRAME_S, FRAME_SIZE, SAMPLE_RATE
from kame.codec import pcm16_decode, pcm16_encode
from kame.errors import SessionError
from kame.protocol import ProtocolError, wire_event
from kame.session import TandemSession
from kame.session_events import AssistantAudio, AssistantText, SessionFailed, Transcript
from kame.telephony import TELEPHONE_RATE, Downsampler, Upsampler, alaw_decode, alaw_encode, ulaw_decode, ulaw_encode
from kame.tools.base import TOOL_NAME, ToolLimits, ToolSpec
from server.services import Services
from server.transport import Ended, SocketSession

logger = logging.getLogger(__name__)

# beta clients (header `OpenAI-Beta: realtime=v1`) get the beta names of the server events
BETA_NAMES = {
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
    "conversation.item.added": "conversation.item.created",
}
_BETA_FORMATS = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}
MAX_ITEMS = 200  # conversation items kept for retrieve and truncate


class RealtimeError(ProtocolError):
    """A bad client event: reported as an `error` event; the session goes on."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


# ------------------------------------------------------------------------------------------ audio


@dataclass(frozen=True)
class AudioFormat:
    type: str = "audio/pcm"  # audio/pcm (PCM16 LE, 24 kHz), audio/pcmu, audio/pcma (G.711, 8 kHz)

    @classmethod
    def parse(cls, value: object, param: str) -> AudioFormat:
        """GA's {"type": ..., "rate": ...} or a beta name ("pcm16", "g711_ulaw", "g711_alaw")."""
        if isinstance(value, str) and value in _BETA_FORMATS:
            return cls(_BETA_FORMATS[value])
        if not isinstance(value, dict) or value.get("type") not in ("audio/pcm", "audio/pcmu", "audio/pcma"):
            raise RealtimeError("invalid_value", f"{param} must be audio/pcm, audio/pcmu or audio/pcma", param)
        rate = value.get("rate")
        if value["type"] == "audio/pcm" and rate not in (None, SAMPLE_RATE):
            raise RealtimeError("invalid_value", f"audio/pcm is served at {SAMPLE_RATE} Hz only, not {rate}", param)
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
        decode, upsample = (ulaw_decode if self.type == "audio/pcmu" else alaw_decode), Upsampler()
        return lambda data: upsample(decode(data))

    def encoder(self):
        """float32 at 24 kHz -> bytes, carrying the resampler's state."""
        if self.type == "audio/pcm":
            return pcm16_encode
        encode, downsample = (ulaw_encode if self.type == "audio/pcmu" else alaw_encode), Downsampler()
        return lambda pcm: encode(downsample(pcm))


# ------------------------------------------------------------------------------------------ state


@dataclass
class _Config:
    """The session as the client configured it (session.update)."""

    model: str
    instructions: str
    input_format: AudioFormat = AudioFormat()
    output_format: AudioFormat = AudioFormat()
    turn_detection: dict | None = None
    transcription: dict | None = None
    output_modalities: tuple[str, ...] = ("audio",)
    voice: str = "kame"
    tools: list = field(default_factory=list)
    tool_choice: object = "auto"
    events: bool = False  # kame.* extension events
    quiet_s: float = 0.6
    activity: str = "text"  # what opens a response: "text", or "text+audio" (audio energy too)
    feed_silence: bool = True  # while the client sends no audio, the front-end hears silence in real time

    @property
    def auto_respond(self) -> bool:
        return self.turn_detection is not None and self.turn_detection.get("create_response", True) is not False


@dataclass
class _Response:
    id: str
    item_id: str
    requested: bool  # by the client's response.create (else opened by the model's own speech)
    created_at: float
    modalities: tuple[str, ...] = ("audio",)  # fixed when the response is created
    metadata: dict | None = None  # the client's response.create metadata, echoed
    started: bool = False  # the burst's first speech has come: the output item exists
    previous_item_id: str | None = None
    first_frame: int | None = None
    audio_ms: float = 0.0
    pieces: list[tuple[float, str]] = field(default_factory=list)  # (audio offset ms, text)
    interrupted: bool = False  # the user started speaking meanwhile

    @property
    def transcript(self) -> str:
        return "".join(text for _, text in self.pieces).strip()


@dataclass
class _Burst:
    """Speech the model gave while no response was asked for (turn_detection null or create_response
    false), kept so that a response.create during it, or soon after, releases it."""

    first_frame: int
    frames: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (frame, pcm)
    pieces: list[tuple[int, str]] = field(default_factory=list)  # (frame, text)
    ended_at: float | None = None  # wall time it went quiet; None: the model is still speaking


@dataclass
class _UserItem:
    id: str
    start_ms: int
    heard: str = ""  # the partial transcript so far
    committed: bool = False  # the client committed it (turn_detection null): an item once its final comes
    done: bool = False  # its item was sent


class ClientTool:
    """A function the Realtime client declared: the backend LLM calls it, the client runs it."""

    client = True  # TandemSession.set_client_tools replaces these, the server's tools stay

    def __init__(self, session: RealtimeSession, spec: ToolSpec, limits: ToolLimits) -> None:
        self.session, self.spec, self.limits = session, spec, limits

    async def call(self, arguments: dict) -> str:
        return await self.session.call_client_function(self.spec.name, arguments)


def _client_tools(session: RealtimeSession, tools: list, timeout_s: float) -> list[ClientTool]:
    """The client's `{"type": "function", "name", "description", "parameters"}` tools."""
    parsed = []
    for index, tool in enumerate(tools):
        param = f"session.tools[{index}]"
        if tool.get("type", "function") != "function":
            raise RealtimeError("invalid_value", f"only function tools are served, not {tool.get('type')!r}", param)
        name = tool.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise RealtimeError("invalid_value", "a function's name is 1-64 letters, digits, _ or -", f"{param}.name")
        parameters = tool.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise RealtimeError("invalid_value", "parameters is a JSON schema object", f"{param}.parameters")
        description = tool.get("description") or ""
        if not isinstance(description, str):
            raise RealtimeError("invalid_value", "description is text", f"{param}.description")
        parsed.append(ClientTool(session, ToolSpec(name, description, parameters), ToolLimits(timeout_s, 8000)))
    return parsed


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def _obj(value: object, param: str) -> dict:
    """An optional JSON object: {} when absent."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RealtimeError("invalid_value", f"{param} must be an object", param)
    return value


def _flag(value: object, param: str) -> bool:
    if not isinstance(value, bool):
        raise RealtimeError("invalid_value", f"{param} must be true or false", param)
    return value


def _text(value: object, param: str) -> str:
    if not isinstance(value, str):
        raise RealtimeError("invalid_value", f"{param} must be a string", param)
    return value


def _number(value: object, low: float, high: float, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise RealtimeError("invalid_value", f"{param} must be a number from {low} to {high}", param)
    return float(value)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


ZERO_USAGE = {"total_tokens": 0, "input_tokens": 0, "output_tokens": 0,
              "input_token_details": {"text_tokens": 0, "audio_tokens": 0, "cached_tokens": 0,
                                      "cached_tokens_details": {"text_tokens": 0, "audio_tokens": 0}},
              "output_token_details": {"text_tokens": 0, "audio_tokens": 0}}


# ------------------------------------------------------------------------------------------ session


class RealtimeSession(SocketSession):
    transport = "realtime"

    def __init__(self, ws: WebSocket, services: Services, model: str, beta: bool) -> None:
        super().__init__(ws, services)
        self.beta = beta
        # browsers cannot set headers: OpenAI's browser clients offer the "realtime" subprotocol (and
        # their key as another one, which server/access.py reads)
        if ws is not None and "realtime" in ws.scope.get("subprotocols", []):
            self.subprotocol = "realtime"
        settings = services.settings
        self.options = settings.realtime
        self.config = _Config(model=model or "kame", instructions=settings.system_prompt,
                              turn_detection=self._server_vad(), transcription={"model": services.runtime.asr.name},
                              quiet_s=self.options.quiet_s, activity=self.options.activity)
        self._decode, self._encode = self.config.input_format.decoder(), self.config.output_format.encoder()
        self._response: _Response | None = None
        self._pending: _Response | None = None  # a response.create waiting for the model to speak
        self._muted = False  # a burst nobody asked for (no auto response) or cancelled: not sent
        self._kept: _Burst | None = None  # a burst nobody asked for, kept for a response.create
        # the audio clock: audio pushed (the client's and fed silence) against wall time since the
        # session opened; a client configuring its session first is not fed silence for 0.5 s
        self._clock_start = time.monotonic() + 0.5
        self._pushed_s = 0.0
        self._appended = False  # audio came since the last commit
        self._last_active: float = 0.0  # wall time of the last speech of the current burst
        self._user: _UserItem | None = None
        self._uncommitted: list[tuple[_UserItem, Transcript]] = []  # finals not committed yet (turn_detection null)
        self._tasks: set[asyncio.Task] = set()
        self._items: dict[str, dict] = {}
        self._last_item_id: str | None = None
        self._event_count = 0
        self._energy = 10 ** (self.options.energy_dbfs / 20)
        self._calls: dict[str, asyncio.Future[str]] = {}  # function calls the client has not answered yet
        # calls that stopped waiting (timed out, or their attempt was cancelled): an output that comes
        # for one later is kept in the conversation, not answered with an error (which ends a session
        # in some frameworks)
        self._ended_calls: collections.OrderedDict[str, None] = collections.OrderedDict()

    def _server_vad(self) -> dict:
        """The turn detection the server actually does (the ASR's endpointing), in Realtime's terms."""
        whisper = self.settings.whisper
        return {"type": "server_vad", "threshold": whisper.vad_threshold, "prefix_padding_ms": 300,
                "silence_duration_ms": int(whisper.min_silence_s * 1000), "create_response": True,
                "interrupt_response": True, "idle_timeout_ms": None}

    async def open(self) -> TandemSession:
        config = self.settings.session_config(stats_interval_s=None)
        return await self.open_tandem(config)

    # ---------------------------------------------------------------- output helpers

    def _emit(self, type_: str, droppable: bool = False, **fields) -> None:
        self._event_count += 1
        name = BETA_NAMES.get(type_, type_) if self.beta else type_
        event = {"type": name, "event_id": f"event_{self.id}_{self._event_count}", **fields}
        if self._recorder is not None and not droppable:
            self._recorder.write_event({"realtime": event})
        self._send.put(json.dumps(event), droppable=droppable)

    def _report(self, code: str, message: str, param: str | None = None, event_id: str | None = None,
                kind: str = "invalid_request_error") -> None:
        error = {"type": kind, "code": code, "message": message, "param": param, "event_id": event_id}
        self._emit("error", error=error)

    def _bad_message(self, exc: Exception) -> None:
        code = getattr(exc, "code", "invalid_request")
        self._report(code, str(exc), getattr(exc, "param", None), getattr(exc, "client_event_id", None))

    def _session_object(self, tandem: TandemSession) -> dict:
        c = self.config
        runtime = self.services.runtime
        return {
            "type": "realtime", "object": "realtime.session", "id": f"sess_{self.id}", "model": c.model,
            "output_modalities": list(c.output_modalities), "instructions": c.instructions,
            "audio": {
                "input": {"format": c.input_format.as_dict(), "transcription": c.transcription,
                          "turn_detection": c.turn_detection, "noise_reduction": None},
                "output": {"format": c.output_format.as_dict(), "voice": c.voice, "speed": 1.0},
            },
            "tools": c.tools, "tool_choice": c.tool_choice, "max_output_tokens": "inf",
            "tracing": None, "truncation": "auto", "prompt": None, "include": None,
            "kame": {"frontend": runtime.frontend.source, "asr": runtime.asr.name, "events": c.events,
                     "quiet_s": c.quiet_s, "activity": c.activity, "feed_silence": c.feed_silence,
                     "backend": tandem.backend, "backends": list(runtime.profiles)},
        }

    async def _greet(self, tandem: TandemSession) -> None:
        self.config.instructions = tandem.planner.system_prompt
        self._emit("session.created", session=self._session_object(tandem))

    # ---------------------------------------------------------------- client events

    async def _on_message(self, message: dict, tandem: TandemSession) -> None:
        text = message.get("text")
        if text is None:
            raise RealtimeError("invalid_event", "events are JSON text frames, not binary")
        limit = self.settings.max_message_bytes * 4 // 3 + 4096  # base64 audio of the binary limit
        if len(text) > limit:
            raise RealtimeError("event_too_large", f"an event of {len(text)} bytes exceeds {limit}")
        try:
            event = json.loads(text, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            raise RealtimeError("invalid_json", f"the event is not JSON: {exc}") from exc
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            raise RealtimeError("invalid_event", "an event is a JSON object with a string 'type'")
        event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
        handler = self._handlers().get(event["type"])
        try:
            if handler is None:
                raise RealtimeError("unknown_event", f"unknown or unsupported event type {event['type']!r}", "type")
            await handler(event, tandem)
        except (ProtocolError, SessionError) as exc:
            exc.client_event_id = event_id  # the error names the event it answers
            raise
        except (TypeError, AttributeError, KeyError, ValueError, IndexError) as exc:
            # a shape no check foresaw: this event is refused, the session goes on (and the log says where)
            logger.warning("session %s: %s event refused", self.id, event["type"], exc_info=True)
            error = RealtimeError("invalid_value", f"{event['type']}: a field has the wrong type ({exc})")
            error.client_event_id = event_id
            raise error from exc

    def _handlers(self) -> dict:
        return {
            "session.update": self._session_update,
            "input_audio_buffer.append": self._append,
            "input_audio_buffer.commit": self._commit,
            "input_audio_buffer.clear": self._clear,
            "conversation.item.create": self._item_create,
            "conversation.item.truncate": self._item_truncate,
            "conversation.item.retrieve": self._item_retrieve,
            "conversation.item.delete": self._refuse("conversation.item.delete",
                                                     "the conversation the LLM sees cannot drop a turn"),
            "response.create": self._response_create,
            "response.cancel": self._response_cancel,
            "output_audio_buffer.clear": self._refuse("output_audio_buffer.clear", "it is a WebRTC event"),
        }

    def _refuse(self, name: str, why: str):
        async def refuse(event: dict, tandem: TandemSession) -> None:
            raise RealtimeError("unsupported_event", f"{name} is not supported: {why}", "type")
        return refuse

    async def _append(self, event: dict, tandem: TandemSession) -> None:
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise RealtimeError("invalid_value", "input_audio_buffer.append needs 'audio', base64 text", "audio")
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise RealtimeError("invalid_base64", "'audio' is not valid base64", "audio") from exc
        if self.config.input_format.type == "audio/pcm" and len(data) % 2:
            raise RealtimeError("invalid_audio", "audio/pcm is 16-bit: an even number of bytes", "audio")
        pcm = self._decode(data)
        tandem.push_pcm(pcm)
        self._pushed_s += len(pcm) / SAMPLE_RATE
        self._appended = self._appended or len(pcm) > 0

    async def _silence(self, tandem: TandemSession) -> None:
        """The front-end speaks in step with the audio it hears: when the audio pushed falls behind the
        wall clock (the client waits for an answer, or sends audio only while its user talks), feed it
        silence in real time. Client audio in large chunks or with jitter stays within the slack."""
        silence = np.zeros(FRAME_SIZE, dtype=np.float32)
        while True:
            await asyncio.sleep(FRAME_S)
            if self._silence_due():
                tandem.push_pcm(silence)

    def _silence_due(self, slack_s: float = 0.3) -> bool:
        """One frame of silence is due: the audio pushed is more than `slack_s` behind the wall clock."""
        behind = time.monotonic() - self._clock_start - self._pushed_s
        if not self.config.feed_silence:
            self._pushed_s += max(0.0, behind)  # when it is turned on again, it counts from then
            return False
        if behind <= slack_s:
            return False
        self._pushed_s += FRAME_S
        return True

    async def _commit(self, event: dict, tandem: TandemSession) -> None:
        if self.config.turn_detection is not None:
            raise RealtimeError("invalid_request", "with server_vad the server commits the audio itself; "
                                "set audio.input.turn_detection to null to commit by hand")
        if not self._uncommitted and self._user is None and not self._appended:
            raise RealtimeError("input_audio_buffer_commit_empty", "no audio appended since the last commit")
        self._appended = False
        committed = bool(self._uncommitted)
        if self._uncommitted:
            self._commit_uncommitted()
        if self._user is not None:  # an utterance in progress: its item comes with its final
            self._user.committed, committed = True, True
            self._spawn(self._settle(tandem, self._user))
        if not committed:  # audio without words: an item with an empty transcript
            self._commit_item(_UserItem(_id("item"), int(self._pushed_s * 1000)), [])

    async def _settle(self, tandem: TandemSession, user: _UserItem) -> None:
        """A committed utterance: the ASR finishes it now; a final that never comes (no words after all)
        commits it with an empty transcript."""
        await tandem.flush()
        await asyncio.sleep(1.0)
        if not user.done:
            if self._user is user:
                self._user = None
            self._commit_item(user, [])

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _clear(self, event: dict, tandem: TandemSession) -> None:
        # the full-duplex front-end has heard it already; what is dropped are the finals not committed
        self._uncommitted.clear()
        self._appended = False
        if self.config.turn_detection is None:
            self._user = None
        self._emit("input_audio_buffer.cleared")

    async def _session_update(self, event: dict, tandem: TandemSession) -> None:
        session = event.get("session")
        if not isinstance(session, dict):
            raise RealtimeError("invalid_value", "session.update needs a 'session' object", "session")
        if session.get("type", "realtime") != "realtime":
            raise RealtimeError("invalid_value", "only realtime sessions are served (not transcription)",
                                "session.type")
        new = dataclasses.replace(self.config)
        audio = _obj(session.get("audio"), "session.audio")
        inp, out = _obj(audio.get("input"), "session.audio.input"), _obj(audio.get("output"), "session.audio.output")
        if "format" in inp or "input_audio_format" in session:
            new.input_format = AudioFormat.parse(inp.get("format", session.get("input_audio_format")),
                                                 "session.audio.input.format")
        if "format" in out or "output_audio_format" in session:
            new.output_format = AudioFormat.parse(out.get("format", session.get("output_audio_format")),
                                                  "session.audio.output.format")
        if "turn_detection" in inp or "turn_detection" in session:
            new.turn_detection = self._turn_detection(inp.get("turn_detection", session.get("turn_detection")))
        if "transcription" in inp or "input_audio_transcription" in session:
            value = inp.get("transcription", session.get("input_audio_transcription"))
            if value is not None and not isinstance(value, dict):
                raise RealtimeError("invalid_value", "transcription is an object or null",
                                    "session.audio.input.transcription")
            # the model is the server's ASR, whatever the client names
            new.transcription = None if value is None else {**value, "model": self.services.runtime.asr.name}
        modalities = session.get("output_modalities", session.get("modalities"))
        if modalities is not None:
            wanted = tuple(m for m in modalities if m in ("audio", "text")) if isinstance(modalities, list) else ()
            if not wanted or len(wanted) != len(modalities):
                raise RealtimeError("invalid_value", "output_modalities are ['audio'] or ['text']",
                                    "session.output_modalities")
            new.output_modalities = ("audio",) if "audio" in wanted else ("text",)
        if "voice" in out or "voice" in session:
            new.voice = _text(out.get("voice", session.get("voice")), "session.audio.output.voice")
        kame_options = _obj(session.get("kame"), "session.kame")
        backend = kame_options.get("backend")
        if backend is not None and (not isinstance(backend, str) or backend not in self.services.runtime.profiles):
            raise RealtimeError("invalid_value", f"unknown backend profile {backend!r}; known: "
                                f"{', '.join(self.services.runtime.profiles)}", "session.kame.backend")
        delay = kame_options.get("oracle_delay_s")
        if delay is not None:
            delay = _number(delay, 0, 30, "session.kame.oracle_delay_s")
        if "events" in kame_options:
            new.events = _flag(kame_options["events"], "session.kame.events")
        if "feed_silence" in kame_options:
            new.feed_silence = _flag(kame_options["feed_silence"], "session.kame.feed_silence")
        if "activity" in kame_options:
            if kame_options["activity"] not in ("text", "text+audio"):
                raise RealtimeError("invalid_value", "activity is 'text' or 'text+audio'", "session.kame.activity")
            new.activity = kame_options["activity"]
        if "quiet_s" in kame_options:
            new.quiet_s = _number(kame_options["quiet_s"], 0.16, 5, "session.kame.quiet_s")
        instructions = session.get("instructions")
        if instructions is not None:
            if not isinstance(instructions, str):
                raise RealtimeError("invalid_value", "instructions is text", "session.instructions")
            new.instructions = instructions
        tools = session.get("tools")
        if tools is not None:
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise RealtimeError("invalid_value", "tools is a list of tool objects", "session.tools")
            new.tools = tools
        if "tool_choice" in session:
            choice = session["tool_choice"]
            if choice not in ("auto", "none", "required") and not isinstance(choice, dict):
                raise RealtimeError("invalid_value", "tool_choice is auto, none, required or a tool object",
                                    "session.tool_choice")
            new.tool_choice = choice
        if "model" in session:
            new.model = _text(session["model"], "session.model")
        client_tools = _client_tools(self, new.tools if new.tool_choice != "none" else [],
                                     self.options.tool_timeout_s)
        # everything checked: apply
        if new.input_format != self.config.input_format:
            self._decode = new.input_format.decoder()
        if new.output_format != self.config.output_format:
            self._encode = new.output_format.encoder()
        self.config = new
        if backend is not None or instructions is not None:
            tandem.configure(backend=backend, system_prompt=instructions)
        if delay is not None:
            tandem.set_oracle_delay(delay)
        if "tools" in session or "tool_choice" in session:
            tandem.set_client_tools(client_tools)
            if client_tools and not tandem.planner.tools_on:  # no error event: frameworks end their session on one
                logger.info("session %s: %d tools stored; backend %s calls no tools, so it answers without them",
                            self.id, len(client_tools), tandem.backend)
        self._emit("session.updated", session=self._session_object(tandem))

    def _turn_detection(self, value: object) -> dict | None:
        if value is None:
            return None
        if not isinstance(value, dict) or value.get("type") not in ("server_vad", "semantic_vad"):
            raise RealtimeError("invalid_value", "turn_detection is null, server_vad or semantic_vad",
                                "session.audio.input.turn_detection")
        detection = self._server_vad() | {"type": value["type"]}
        for key in ("create_response", "interrupt_response"):
            if key in value:
                detection[key] = _flag(value[key], f"session.audio.input.turn_detection.{key}")
        if value["type"] == "semantic_vad":
            eagerness = value.get("eagerness", "auto")
            if eagerness not in ("low", "medium", "high", "auto"):
                raise RealtimeError("invalid_value", "eagerness is low, medium, high or auto",
                                    "session.audio.input.turn_detection.eagerness")
            detection = {"type": "semantic_vad", "eagerness": eagerness,
                         "create_response": detection["create_response"],
                         "interrupt_response": detection["interrupt_response"]}
        return detection

    async def _item_create(self, event: dict, tandem: TandemSession) -> None:
        item = event.get("item")
        if not isinstance(item, dict):
            raise RealtimeError("invalid_value", "conversation.item.create needs an 'item' object", "item")
        kind = item.get("type", "message")
        if kind == "function_call_output":
            self._function_output(item)
            return
        if kind == "function_call":
            raise RealtimeError("invalid_value", "function calls are the model's to make: send their "
                                "function_call_output", "item.type")
        if kind != "message" or item.get("role") != "user":
            raise RealtimeError("invalid_value", "only user text messages can be added (the assistant's turns "
                                "are what the front-end says)", "item.role")
        parts = item.get("content") or []
        if not isinstance(parts, list) or not parts or any(
                not isinstance(p, dict) or p.get("type") != "input_text" or not isinstance(p.get("text"), str)
                for p in parts):
            raise RealtimeError("invalid_value", "a user message's content is input_text parts (send audio with "
                                "input_audio_buffer.append)", "item.content")
        item_id = item.get("id")
        if item_id is not None and (not isinstance(item_id, str) or not item_id or item_id in self._items):
            raise RealtimeError("invalid_value", "item.id is a new, non-empty string (or left out)", "item.id")
        tandem.add_user_text(" ".join(p["text"] for p in parts))
        stored = {"id": item_id or _id("item"), "object": "realtime.item", "type": "message",
                  "role": "user", "status": "completed", "content": parts}
        self._add_item(stored)

    # ---------------------------------------------------------------- client functions

    async def call_client_function(self, name: str, arguments: dict) -> str:
        """The backend LLM calls the client's function `name`: send the call as a response of its
        own, wait for the client's function_call_output (the tool's timeout bounds the wait)."""
        call_id, item_id = _id("call"), _id("item")
        text = json.dumps(arguments)
        response = _Response(_id("resp"), item_id, False, time.monotonic(), modalities=self.config.output_modalities)
        self._emit("response.created", response=self._response_object(response, "in_progress"))
        item = {"id": item_id, "object": "realtime.item", "type": "function_call", "status": "in_progress",
                "name": name, "call_id": call_id, "arguments": ""}
        common = {"response_id": response.id, "item_id": item_id, "output_index": 0}
        self._emit("response.output_item.added", response_id=response.id, output_index=0, item=item)
        previous, self._last_item_id = self._last_item_id, item_id
        self._emit("conversation.item.added", previous_item_id=previous, item=item)
        for start in range(0, len(text), 64):
            self._emit("response.function_call_arguments.delta", call_id=call_id, delta=text[start:start + 64],
                       **common)
        self._emit("response.function_call_arguments.done", call_id=call_id, name=name, arguments=text, **common)
        done = item | {"status": "completed", "arguments": text}
        self._emit("response.output_item.done", response_id=response.id, output_index=0, item=done)
        self._emit("conversation.item.done", previous_item_id=previous, item=done)
        self._store(done)
        self._emit("response.done", response=self._response_object(response, "completed", output=[done]))
        waiting = self._calls[call_id] = asyncio.get_running_loop().create_future()
        try:
            return await waiting
        finally:
            self._calls.pop(call_id, None)
            if not waiting.done() or waiting.cancelled():  # stopped waiting unanswered
                self._ended_calls[call_id] = None
                while len(self._ended_calls) > MAX_ITEMS:
                    self._ended_calls.popitem(last=False)

    def _function_output(self, item: dict) -> None:
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or not isinstance(output, str):
            raise RealtimeError("invalid_value", "a function_call_output has a call_id and an output string",
                                "item.call_id")
        waiting = self._calls.get(call_id)
        if (waiting is None or waiting.done()) and call_id in self._ended_calls:
            logger.info("session %s: the output of function call %s came after the call stopped waiting "
                        "(timed out, or its answer was superseded); kept, not used", self.id, call_id)
            del self._ended_calls[call_id]  # a second output for it is an error like any other
        elif waiting is None or waiting.done():
            raise RealtimeError("invalid_value", f"no function call {call_id!r} is waiting for its output "
                                "(answered already, or never made)", "item.call_id")
        else:
            waiting.set_result(output)
        self._add_item({"id": item.get("id") or _id("item"), "object": "realtime.item",
                        "type": "function_call_output", "call_id": call_id, "output": output,
                        "status": "completed"})

    def _store(self, item: dict) -> None:
        self._items[item["id"]] = item
        while len(self._items) > MAX_ITEMS:
            self._items.pop(next(iter(self._items)))

    def _add_item(self, item: dict) -> None:
        previous, self._last_item_id = self._last_item_id, item["id"]
        self._store(item)
        self._emit("conversation.item.added", previous_item_id=previous, item=item)
        self._emit("conversation.item.done", previous_item_id=previous, item=item)

    async def _item_truncate(self, event: dict, tandem: TandemSession) -> None:
        item_id, end_ms = event.get("item_id"), event.get("audio_end_ms")
        if not isinstance(item_id, str):
            raise RealtimeError("item_truncate_invalid_item_id", "item_id must be a string", "item_id")
        live = self._response
        if live is not None and live.started and live.item_id == item_id:
            # the client stopped playing it (a barge-in): the response ends here, the rest of the burst unsent
            self._close_response(live, "cancelled", "turn_detected")
            self._muted = True
        item = self._items.get(item_id)
        if item is None or item.get("role") != "assistant":
            raise RealtimeError("item_truncate_invalid_item_id", f"no assistant item {item_id!r} to truncate",
                                "item_id")
        if isinstance(end_ms, bool) or not isinstance(end_ms, int) or end_ms < 0 or end_ms > item["_audio_ms"] + 1:
            raise RealtimeError("invalid_value", f"audio_end_ms must be within the item's {item['_audio_ms']:.0f} ms "
                                "of audio", "audio_end_ms")
        heard = "".join(text for offset, text in item["_pieces"] if offset <= end_ms).strip()
        content = item["content"][0]
        key = "transcript" if "transcript" in content else "text"
        tandem.truncate_assistant(content[key], heard)
        content[key] = heard
        item["_audio_ms"] = end_ms  # a later truncate can only cut more
        self._emit("conversation.item.truncated", item_id=item_id, content_index=0, audio_end_ms=end_ms)

    async def _item_retrieve(self, event: dict, tandem: TandemSession) -> None:
        item_id = event.get("item_id")
        live = self._response
        if isinstance(item_id, str) and live is not None and live.started and live.item_id == item_id:
            self._emit("conversation.item.retrieved", item=self._assistant_item(live, "in_progress"))
            return
        item = self._items.get(item_id) if isinstance(item_id, str) else None
        if item is None:
            raise RealtimeError("item_retrieve_invalid_item_id", f"no item {item_id!r}", "item_id")
        self._emit("conversation.item.retrieved", item=_public(item))

    async def _response_create(self, event: dict, tandem: TandemSession) -> None:
        if self._response is not None or self._pending is not None:
            raise RealtimeError("conversation_already_has_active_response",
                                "a response is in progress: cancel it or wait for response.done")
        options = _obj(event.get("response"), "response")
        metadata = options.get("metadata")
        if metadata is not None and (not isinstance(metadata, dict)
                                     or not all(isinstance(v, str) for v in metadata.values())):
            raise RealtimeError("invalid_value", "response.metadata maps strings to strings", "response.metadata")
        response = self._new_response(requested=True, metadata=metadata)
        kept, self._kept = self._kept, None
        if kept is None or (kept.ended_at is not None
                            and time.monotonic() - kept.ended_at > self.options.response_timeout_s):
            self._pending = response  # the model's next burst answers it
            return
        # the model has spoken (or is speaking) by itself: what it said is this response, sent now
        self._start_content(response, kept.first_frame)
        pieces = iter(kept.pieces)
        piece = next(pieces, None)
        for frame, pcm in kept.frames:
            while piece is not None and piece[0] <= frame:
                self._send_text(response, *piece)
                piece = next(pieces, None)
            self._send_audio(response, pcm, frame)
        for rest in ([piece] if piece else []) + list(pieces):
            self._send_text(response, *rest)
        if kept.ended_at is None:
            self._response, self._muted = response, False  # the rest streams live
        else:
            self._close_response(response, "completed")

    async def _response_cancel(self, event: dict, tandem: TandemSession) -> None:
        response = self._response or self._pending
        if response is None:
            raise RealtimeError("response_cancel_not_active", "Cancellation failed: no active response found")
        speaking = response is self._response
        self._close_response(response, "cancelled", "client_cancelled")
        self._muted = self._muted or speaking  # the rest of this burst is not sent

    # ---------------------------------------------------------------- session events

    async def _forward(self, tandem: TandemSession) -> None:
        async for event in tandem:
            if isinstance(event, AssistantAudio):
                self._on_audio(event)
                self._count_dropped(tandem)
            elif isinstance(event, AssistantText):
                self._on_text(event)
            elif isinstance(event, Transcript):
                self._on_transcript(event)
                self._extension(event)
            elif isinstance(event, SessionFailed):
                self._report(event.code, event.message, kind="server_error")
                raise Ended("engine failure" if event.code == "engine" else "internal error")
            else:
                self._extension(event)
        raise Ended("the session ended")

    def _extension(self, event) -> None:
        if self.config.events and (wire := wire_event(event)) is not None:
            fields = wire.model_dump(exclude={"type"})
            self._emit(f"kame.{wire.type}", **fields)

    def _on_audio(self, event: AssistantAudio) -> None:
        if self.config.activity == "text+audio" and event.ready and (
                float(np.sqrt(np.mean(event.pcm ** 2))) >= self._energy):
            self._speech(event.frame)
        if self._response is not None and self._response.started:
            self._send_audio(self._response, event.pcm, event.frame)
        elif self._muted and self._kept is not None and self._kept.ended_at is None:
            self._kept.frames.append((event.frame, event.pcm))
        self._check_quiet()

    def _on_text(self, event: AssistantText) -> None:
        self._speech(event.frame)
        if self._response is not None and self._response.started:
            self._send_text(self._response, event.frame, event.text)
        elif self._muted and self._kept is not None and self._kept.ended_at is None:
            self._kept.pieces.append((event.frame, event.text))

    def _send_audio(self, response: _Response, pcm: np.ndarray, frame: int) -> None:
        if "audio" in response.modalities:
            # with kame events on, each delta also names the session's frame it is (latency measurements)
            extra = {"kame_frame": frame} if self.config.events else {}
            self._emit("response.output_audio.delta", droppable=True, response_id=response.id,
                       item_id=response.item_id, output_index=0, content_index=0,
                       delta=base64.b64encode(self._encode(pcm)).decode(), **extra)
        response.audio_ms += FRAME_S * 1000

    def _send_text(self, response: _Response, frame: int, text: str) -> None:
        offset = (frame - (response.first_frame if response.first_frame is not None else frame)) * FRAME_S * 1000
        response.pieces.append((offset, text))
        kind = "response.output_audio_transcript.delta" if "audio" in response.modalities \
            else "response.output_text.delta"
        self._emit(kind, response_id=response.id, item_id=response.item_id, output_index=0, content_index=0,
                   delta=text)

    def _speech(self, frame: int) -> None:
        """The front-end speaks at `frame`: a burst goes on, or a new one starts."""
        self._last_active = time.monotonic()
        if self._muted or self._response is not None:
            return
        if self._pending is not None:
            response, self._pending = self._pending, None
        elif self.config.auto_respond:
            response = self._new_response(requested=False)
        else:
            self._muted = True  # nobody asked for this burst: kept, not sent
            self._kept = _Burst(frame)
            return
        self._response = response
        self._start_content(response, frame)

    def _check_quiet(self) -> None:
        """Close the burst after `quiet_s` without speech; a requested response that never started
        ends empty after `response_timeout_s`."""
        now = time.monotonic()
        if now - self._last_active < self.config.quiet_s:
            return
        if self._response is not None:
            response = self._response
            if response.interrupted:
                self._close_response(response, "cancelled", "turn_detected")
            else:
                self._close_response(response, "completed")
        self._muted = False
        if self._kept is not None and self._kept.ended_at is None:
            self._kept.ended_at = now
        pending = self._pending
        if pending is not None and now - pending.created_at >= self.options.response_timeout_s:
            self._close_response(pending, "completed")

    async def _quiet_timer(self) -> None:
        """Bursts end on time even when no frame comes (the client stopped sending audio)."""
        while True:
            await asyncio.sleep(0.2)
            self._check_quiet()

    def _extra_tasks(self, tandem: TandemSession) -> list:
        return [self._quiet_timer(), self._silence(tandem)]

    # ---------------------------------------------------------------- responses

    def _new_response(self, requested: bool, metadata: dict | None = None) -> _Response:
        response = _Response(_id("resp"), _id("item"), requested, time.monotonic(),
                             modalities=self.config.output_modalities, metadata=metadata)
        self._emit("response.created", response=self._response_object(response, "in_progress"))
        return response

    def _start_content(self, response: _Response, frame: int) -> None:
        response.started, response.first_frame = True, frame
        item = self._assistant_item(response, "in_progress")
        self._emit("response.output_item.added", response_id=response.id, output_index=0, item=item)
        response.previous_item_id, self._last_item_id = self._last_item_id, response.item_id
        self._emit("conversation.item.added", previous_item_id=response.previous_item_id, item=item)
        self._emit("response.content_part.added", response_id=response.id, item_id=response.item_id,
                   output_index=0, content_index=0, part=self._part(response))

    def _close_response(self, response: _Response, status: str, reason: str | None = None) -> None:
        if response is self._response:
            self._response = None
        if response is self._pending:
            self._pending = None
        output = []
        if response.started:
            common = {"response_id": response.id, "item_id": response.item_id, "output_index": 0,
                      "content_index": 0}
            if "audio" in response.modalities:
                self._emit("response.output_audio.done", **common)
                self._emit("response.output_audio_transcript.done", transcript=response.transcript, **common)
            else:
                self._emit("response.output_text.done", text=response.transcript, **common)
            self._emit("response.content_part.done", part=self._part(response), **common)
            item = self._assistant_item(response, "completed" if status == "completed" else "incomplete")
            self._emit("response.output_item.done", response_id=response.id, output_index=0, item=item)
            self._emit("conversation.item.done", previous_item_id=response.previous_item_id, item=item)
            self._store(item | {"_audio_ms": response.audio_ms, "_pieces": response.pieces})
            output = [item]
        self._emit("response.done", response=self._response_object(response, status, reason, output))

    def _part(self, response: _Response) -> dict:
        if "audio" in response.modalities:
            return {"type": "audio", "transcript": response.transcript}
        return {"type": "text", "text": response.transcript}

    def _assistant_item(self, response: _Response, status: str) -> dict:
        content = {"type": "output_audio", "transcript": response.transcript} \
            if "audio" in response.modalities else {"type": "output_text", "text": response.transcript}
        return {"id": response.item_id, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": status, "content": [content]}

    def _response_object(self, response: _Response, status: str, reason: str | None = None,
                         output: list | None = None) -> dict:
        details = None if status == "in_progress" else {"type": status, "reason": reason}
        return {"id": response.id, "object": "realtime.response", "status": status, "status_details": details,
                "output": output or [], "output_modalities": list(response.modalities),
                "conversation_id": f"conv_{self.id}", "max_output_tokens": "inf", "metadata": response.metadata,
                "audio": {"output": {"format": self.config.output_format.as_dict(), "voice": self.config.voice}},
                # no token counts from a speech model: zeros, the shape frameworks read
                "usage": None if status == "in_progress" else ZERO_USAGE}

    # ---------------------------------------------------------------- the user's side

    def _on_transcript(self, event: Transcript) -> None:
        detecting = self.config.turn_detection is not None
        if self._user is None:
            self._user = _UserItem(_id("item"), int(event.start_s * 1000))
            if detecting:
                self._emit("input_audio_buffer.speech_started", audio_start_ms=self._user.start_ms,
                           item_id=self._user.id)
            interrupting = (self.config.turn_detection or {}).get("interrupt_response", True)
            if interrupting and self._response is not None and self._response.started:
                self._response.interrupted = True  # barge-in: it ends as cancelled once the front-end yields
        user = self._user
        if not event.final:
            if self.config.transcription is not None and event.text.startswith(user.heard):
                delta = event.text[len(user.heard):]
                if delta:
                    self._emit("conversation.item.input_audio_transcription.delta", item_id=user.id,
                               content_index=0, delta=delta)
            user.heard = event.text
            return
        self._user = None
        if detecting:
            self._emit("input_audio_buffer.speech_stopped", audio_end_ms=int(event.end_s * 1000), item_id=user.id)
            self._commit_item(user, [event])
        elif user.committed:
            self._commit_item(user, [event])
        else:
            self._uncommitted.append((user, event))  # the client commits by hand (input_audio_buffer.commit)

    def _commit_uncommitted(self) -> None:
        held, self._uncommitted = self._uncommitted, []
        self._commit_item(held[0][0], [final for _, final in held])  # under the first utterance's id

    def _commit_item(self, user: _UserItem, finals: list[Transcript]) -> None:
        user.done = True
        if self._kept is not None and self._kept.ended_at is not None:
            self._kept = None  # what the model said before this turn was committed is not its answer
        transcript = " ".join(f.text for f in finals).strip()
        self._emit("input_audio_buffer.committed", previous_item_id=self._last_item_id, item_id=user.id)
        item = {"id": user.id, "object": "realtime.item", "type": "message", "role": "user",
                "status": "completed", "content": [{"type": "input_audio", "transcript": None}]}
        previous, self._last_item_id = self._last_item_id, user.id
        self._emit("conversation.item.added", previous_item_id=previous, item=item)
        if self.config.transcription is not None:
            seconds = max(0.0, finals[-1].end_s - finals[0].start_s) if finals else 0.0
            self._emit("conversation.item.input_audio_transcription.completed", item_id=user.id, content_index=0,
                       transcript=transcript, usage={"type": "duration", "seconds": round(seconds, 3)})
        done = item | {"content": [{"type": "input_audio", "transcript": transcript}]}
        self._store(done)
        self._emit("conversation.item.done", previous_item_id=previous, item=done)


def _public(item: dict) -> dict:
    return {k: v for k, v in item.items() if not k.startswith("_")}
