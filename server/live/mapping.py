"""OpenAI's GPT-Live protocol over one tandem session, as a state machine: no socket, no session,
no clock of its own. Feed it the client's text frames (`on_client`), audio from a media track
(`on_audio`, WebRTC), the session's events (`on_session`) and the time (`on_time`, when `wake_at`
says); take the actions it asks for (`take`) and carry them out (`adapter.py`, `webrtc.py`).

Delegation is the oracle: `responses` delegation is the planner with its LLM (each attempt a
delegation, its progress as `response.event`); `client` delegation is the planner with the client
as its LLM (`delegation.py`). docs/live.md has every event.
"""

from __future__ import annotations

import base64
import binascii
import collections
import logging

import numpy as np

from kame.audio import FRAME_S, FRAME_SIZE, SAMPLE_RATE
from kame.commands import AddContext, Configure, PushAudio
from kame.protocol import wire_event
from kame.session_events import (
    AssistantAudio,
    AssistantText,
    LLMAttempt,
    SessionEvent,
    SessionFailed,
    ToolRound,
    Transcript,
)
from server.echo import CallEcho
from server.live import client_events as ce
from server.live.actions import (
    Action,
    ClientTools,
    Commentary,
    Delegate,
    Finish,
    Heard,
    Play,
)
from server.live.client_events import LiveError
from server.live.config import LiveConfig, LiveFacts
from server.live.decisions import Decisions
from server.live.outbox import LiveOutbox
from server.live.responses import ResponsesEvents
from server.live.silence import SilenceGate
from server.live.standby import DEFAULT_VAD_THRESHOLD, Standby
from server.stable_text import Keepalive, StableWords

logger = logging.getLogger(__name__)

SILENCE = np.zeros(FRAME_SIZE, dtype=np.float32)
SILENCE_SLACK_S = 0.3  # the client's audio may lag the clock this much before silence is fed
SILENCE_CATCH_UP = 3  # frames of silence fed at once at most after a stall
MAX_CONTENT_TOKENS = 500  # of each commentary, thinking or instructions append
MAX_DELEGATIONS = 256  # delegations remembered (their ids, their attempts)
UNSUPPORTED = {
    "session.output_audio.fixture.play": "audio fixtures are not supported by this server",
}
CLIENT_WORDS = ("client", "decisions")  # delegations whose words are the client's commentary
# what the voice says for a delegation the client has not answered within acknowledgement_delay_ms (> 0: Decisions
# delegation's default is 400; the model may still speak before it, and any commentary or thinking cancels it)
ACKNOWLEDGEMENT = "One moment."
RESPONSES_ONLY = ("response.item.create", "response.create")  # the client's side of its function tools


SIDEBAND_REFUSED = ("session.start", "session.input_audio.append")  # the primary connection's alone


def estimated_tokens(text: str) -> int:
    """About how many tokens `text` is (English: ~4 characters or ~0.75 words a token)."""
    return max(len(text) // 4, int(len(text.split()) / 0.75))


class LiveMapping:
    def __init__(self, facts: LiveFacts) -> None:
        self.facts = facts
        self.outbox = LiveOutbox(facts.session_id)
        self.config: LiveConfig | None = None  # None until session.start
        self.closed = False
        self.muted = False
        self._started_at = 0.0
        self._pushed_s = 0.0  # the audio clock: the user's audio heard (the client's and fed silence)
        self._decode = self._encode = None
        self.echo = CallEcho(facts.echo)  # a telephone caller's speakerphone sends our voice back
        self._words, self._keepalive = StableWords(), Keepalive()
        self._transcript_ms = 0  # where the last input transcript delta ended
        self._next_usage: float | None = None
        self._delegations: collections.OrderedDict[str, None] = collections.OrderedDict()  # ids announced
        self._acks: dict[str, float] = {}  # delegation -> when its automatic acknowledgement is due
        self.responses = ResponsesEvents(self.outbox, self.delegated, facts.tool_timeout_s)
        self.decisions = Decisions(self.outbox)
        self.standby: Standby | None = None  # WebRTC's idle pause, where the POST asked for one
        self._gate = SilenceGate(facts.zero_silence_s) if facts.zero_silence_s else None

    def take(self) -> list[Action]:
        return self.outbox.take()

    @property
    def started(self) -> bool:
        return self.config is not None

    def audio_ms(self) -> int:
        """Now on the session's timeline: the user's audio heard so far, in ms."""
        return int(self._pushed_s * 1000)

    def refuse(self, exc: Exception) -> None:
        """A bad client event: the client is told; the session goes on."""
        if not isinstance(exc, LiveError):
            exc = LiveError(getattr(exc, "code", "invalid_request"), str(exc))
        self.outbox.error(exc)

    # ---------------------------------------------------------------- start and close

    def start(self, session, now: float, event_id: str | None = None) -> None:
        """`session.start` (WebSocket) or the WebRTC POST: the session begins (LiveError before
        anything changed when the config cannot be served)."""
        config = LiveConfig.start(session, self.facts, self.facts.transport)
        self.config, self._started_at = config, now
        if self.facts.transport == "websocket":  # over WebRTC, the browser cancels its own echo
            self.echo.formats(config.audio_format["type"], config.audio_format["type"])
        self._decode, self._encode = self.echo.decoder(config.decoder()), self.echo.encoder(config.encoder())
        self._next_usage = now + self.facts.usage_interval_s
        self.outbox.call(Configure(config.backend, config.system_prompt(self.facts)))
        if config.delegation in CLIENT_WORDS:
            self.outbox.call(Delegate())
        elif config.tools or config.tool_choice:
            self.outbox.call(ClientTools(config.tools, config.tool_choice))
        for role, text in config.history:
            self.outbox.call(AddContext("context" if role == "developer" else role, text))
        self.outbox.emit("session.started", client_event_id=event_id, session=config.resource(self.facts))
        if config.substituted:
            self._substituted(config)

    def _substituted(self, config: LiveConfig) -> None:
        self.outbox.emit("info", code="delegation_model_substituted",
                         message=f"No backend profile serves {config.delegated_model!r}; delegated "
                                 f"work goes to the server's profile {config.substituted!r}.")

    def close(self, reason: str, now: float, event_id: str | None = None) -> None:
        """The session ends: `session.closed` with the reason, the final snapshot and the usage."""
        if self.closed:
            return
        self.closed = True
        if self.started:
            self.outbox.emit("session.closed", client_event_id=event_id, reason=reason,
                             session=self.config.resource(self.facts), usage=self._usage(now))
        self.outbox.call(Finish(1000, reason))

    def _usage(self, now: float) -> dict:
        seconds = int(max(0.0, now - self._started_at))
        breakdown = self.standby.usage(seconds, now) if self.standby is not None else {}
        return {"seconds": float(seconds), **breakdown}

    # ---------------------------------------------------------------- standby (WebRTC)

    def stand_by(self, idle_timeout_s: int | None, vad_threshold: float | None, now: float) -> None:
        """The POST's `idle_timeout_s` and `wake_policy`: past that long without words either way, a
        delegation or a client event, the session pauses; speech wakes it. No timeout: never."""
        if idle_timeout_s is not None:
            threshold = DEFAULT_VAD_THRESHOLD if vad_threshold is None else vad_threshold
            self.standby = Standby(idle_timeout_s, threshold, now)

    @property
    def paused(self) -> bool:
        return self.standby is not None and self.standby.paused

    def wake(self, now: float) -> None:
        """The user spoke while paused: `session.resumed`, and the audio kept while the detector listened
        goes to the session (the front-end and the ASR hear the first words)."""
        if not self.paused or self.closed:
            return
        kept = self.standby.resume(now)  # pushed now, it counts as heard, not as paused time
        self.outbox.emit("session.resumed")
        if len(kept):
            self._push(kept)

    def _active(self, now: float) -> None:
        if self.standby is not None:
            self.standby.active(now)

    # ---------------------------------------------------------------- the clock

    def wake_at(self) -> float | None:
        if not self.started or self.closed:
            return None
        if self.paused:  # no silence fed, no acknowledgement due: the clock stands still
            return self._next_usage
        pause = () if self.standby is None else (self.standby.due(),)
        return min(self._silence_at(), self._next_usage, *self._acks.values(), *pause, *self._keepalive.due())

    def on_time(self, now: float) -> None:
        """Silence is fed when the client's audio falls behind the clock (the front-end hears time
        pass, as a full-duplex model does); cumulative usage every `usage_interval_s`."""
        if not self.started or self.closed:
            return
        if self.standby is not None and not self.standby.paused and now >= self.standby.due():
            self.standby.pause(now)
            self.outbox.emit("session.paused")
        if not self.paused and now >= self._silence_at():
            due = int((now - self._silence_at()) / FRAME_S) + 1
            self._pushed_s += due * FRAME_S
            for _ in range(min(due, SILENCE_CATCH_UP)):  # silence nobody heard after a stall is skipped
                self.outbox.call(PushAudio(SILENCE))
        if now >= self._next_usage:
            self._next_usage = now + self.facts.usage_interval_s
            self.outbox.emit("session.usage.updated", usage=self._usage(now))
        if self._keepalive.fire(now, self._words.open):  # no words for a while in an open user turn
            self._emit_words(self._words.space(), self._transcript_ms, self._transcript_ms, now)
        for delegation_id, at in list(self._acks.items()):
            if now >= at:  # nothing came from the client yet: the voice acknowledges the request
                del self._acks[delegation_id]
                self.outbox.call(Commentary(delegation_id, ACKNOWLEDGEMENT))

    def _clock(self) -> float:
        """When the audio heard so far ends, on the wall clock (the start, the pauses, the audio): the pauses
        as the usage report counts them (`Standby.paused_s`), while the audio clock stood still."""
        paused = self.standby.paused_s if self.standby is not None else 0.0
        return self._started_at + paused + self._pushed_s

    def _silence_at(self) -> float:
        return self._clock() + SILENCE_SLACK_S

    # ---------------------------------------------------------------- the user's audio

    def on_audio(self, pcm: np.ndarray) -> None:
        """The user's audio, float32 at 24 kHz (decoded from an append, or from the media track)."""
        if not self.started or self.closed or not len(pcm):
            return
        self.outbox.call(Heard(pcm))
        if self.paused:
            self.standby.hear(pcm)
            return
        self._push(pcm)

    def _push(self, pcm: np.ndarray) -> None:
        self.outbox.call(PushAudio(np.zeros_like(pcm) if self.muted else pcm))
        self._pushed_s += len(pcm) / SAMPLE_RATE

    def _append(self, audio: str) -> None:
        if self.facts.transport != "websocket":
            raise LiveError("invalid_request", "Audio goes on the media track in a WebRTC session.", "type")
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise LiveError("invalid_audio", "'audio' is not valid base64.", "audio") from exc
        if len(data) % self.config.bytes_per_sample:
            raise LiveError("invalid_audio", "PCM16 audio is an even number of bytes.", "audio")
        self.on_audio(self._decode(data))

    # ---------------------------------------------------------------- the session's events

    def on_session(self, event: SessionEvent, now: float) -> None:
        if isinstance(event, SessionFailed):
            self.outbox.error(LiveError(event.code, event.message, kind="server_error"))
            self.close("connection_lost", now)
            return
        if not self.started or self.closed:
            return
        if isinstance(event, AssistantAudio):
            pcm = event.pcm if self._gate is None else self._gate(event.frame, event.pcm)
            if self.facts.transport == "websocket":
                delta = base64.b64encode(self._encode(pcm)).decode()
                self.outbox.emit("session.output_audio.delta", droppable=True, delta=delta)
            else:
                self.outbox.call(Play(pcm, event.frame))
        elif isinstance(event, AssistantText):
            if self._gate is not None:
                self._gate.word(event.frame)
            self._active(now)
            start = round(event.frame * FRAME_S * 1000)
            sent = self.outbox.emit("session.output_transcript.delta", delta=event.text, start_ms=start,
                                    end_ms=start + round(FRAME_S * 1000))
            if event.text.strip():  # a space or a line break: no words to judge
                self._triggered(sent)
        elif isinstance(event, Transcript):
            self._active(now)
            self._transcript(event, now)
        elif isinstance(event, LLMAttempt | ToolRound) and self.config.delegation == "responses":
            self.responses.on_session(event, self.config)
        self._extension(event)

    def _transcript(self, event: Transcript, now: float) -> None:
        if event.backchannel:  # "mm-hm" while the assistant speaks: no words a client would make a user turn of
            if event.final:  # (a first word of it may have gone out, settled: "I" of "I see")
                self._words.drop()
                self._keepalive.sent(now, False, False)
            return
        delta = self._words.final(event.text) if event.final else self._words.partial(event.text, event.settled)
        if delta:
            start = max(self._transcript_ms, round(event.start_s * 1000))
            self._emit_words(delta, start, max(start, round(event.end_s * 1000)), now)
        elif event.final:
            self._keepalive.sent(now, False, False)  # the turn ended: no more spaces

    def _emit_words(self, delta: str, start: int, end: int, now: float) -> None:
        self._transcript_ms = end
        sent = self.outbox.emit("session.input_transcript.delta", delta=delta, start_ms=start, end_ms=end)
        self._keepalive.sent(now, bool(delta.strip()), self._words.open)
        if delta.strip():  # a space only keeps the client's user turn open (stable_text.py): no words to judge
            self._triggered(sent)

    def _triggered(self, delta_event: dict) -> None:
        """A transcript delta went out: the trigger on its type, if any, fires for it."""
        if self.config.triggers:
            self.decisions.transcript(self.config.trigger_questions(delta_event["type"]), delta_event,
                                      self.config.backend)

    def decided(self, action, decision: dict | None, error: str | None = None) -> None:
        """A decision the carrier evaluated (`Decide`): its event, or an error (nothing once the session closed)."""
        if not self.closed:
            self.decisions.decided(action, decision, error)

    def call_ended(self, call_id: str, outcome: str) -> None:
        """The backend stopped waiting for a client function call (`ResponsesEvents.call_ended`)."""
        self.responses.call_ended(call_id, outcome, self.config)

    def delegated(self, delegation_id: str, target: str | None = None, response_id: str | None = None
                  ) -> None:
        """A delegation begins (a planner attempt): the client is told where on the timeline (`target`: the
        session's delegation type by default); Decisions delegation's questions are evaluated for it."""
        target = target or self.config.delegation
        if target == "decisions":
            self.decisions.delegated(self.config.questions(), delegation_id, self.config.backend)
        if target in CLIENT_WORDS and self.config.acknowledgement_delay_ms > 0:
            # on the session's clock (the audio heard, fed silence included: it follows the time)
            self._acks[delegation_id] = self._clock() + self.config.acknowledgement_delay_ms / 1000
        self._active(self._clock())
        self._delegations[delegation_id] = None
        while len(self._delegations) > MAX_DELEGATIONS:
            self._delegations.popitem(last=False)
        delegation = {"id": delegation_id, "type": "delegation", "target": target}
        if response_id is not None:
            delegation["response_id"] = response_id
        self.outbox.emit("session.delegation.created", offset_ms=self.audio_ms(), delegation=delegation)

    def _extension(self, event: SessionEvent) -> None:
        if self.facts.events and (wire := wire_event(event)) is not None:
            self.outbox.emit(f"kame.{wire.type}", **wire.model_dump(exclude={"type"}))

    # ---------------------------------------------------------------- the client's events

    def on_client(self, text: str | None, now: float, sideband: bool = False) -> None:
        """One text frame of the client (or of a sideband connection, which steers a started session
        but sends no audio); LiveError for a bad one."""
        event, event_id = ce.parse(text, self.facts.max_event_bytes)
        try:
            if sideband and (event.type in SIDEBAND_REFUSED or not self.started):
                raise LiveError("invalid_request", f"A sideband connection cannot send {event.type}.", "type")
            self._handle(event, event_id, now)
        except LiveError as exc:
            exc.client_event_id = event_id
            raise

    def _handle(self, event, event_id: str | None, now: float) -> None:
        kind = event.type
        if self.closed:
            raise LiveError("session_closed", "The session is closing.")
        if not self.started:
            if kind != "session.start" or self.facts.transport != "websocket":
                raise LiveError("session_not_started", "Send session.start first and wait for session.started.",
                                "type")
            self.start(event.session, now, event_id)
            return
        self._active(now)
        if kind in UNSUPPORTED:
            raise LiveError("unsupported_event", f"{kind}: {UNSUPPORTED[kind]}.", "type")
        if kind in RESPONSES_ONLY and self.config.delegation != "responses":
            raise LiveError("invalid_request", f"{kind} requires Responses delegation.", "type")
        match kind:
            case "session.start":
                raise LiveError("session_already_started", "The session has started already.", "type")
            case "session.input_audio.append":
                self._append(event.audio)
            case "session.input_audio.mute" | "session.input_audio.unmute":
                self.muted = kind.endswith(".mute")
                self.outbox.emit(f"session.input_audio.{'muted' if self.muted else 'unmuted'}",
                                 client_event_id=event_id)
            case "session.update":
                self._update(event.session, event_id)
            case "session.commentary.append" | "session.thinking.append" | "session.instructions.append":
                self._context(kind.split(".")[1], event.content, event.delegation_id, event_id)
            case "response.item.create":
                self.responses.item_create(event.item)
            case "response.create":
                self.responses.response_create(self.config)
            case "decision.create":
                self.decisions.create(self.config.questions(), event_id, self.config.backend)
            case "decision.item.create":
                self.decisions.item_create(event.item, event_id)
            case "decision.item.delete":
                self.decisions.item_delete(event.item_id, event_id)
            case "session.close":
                self.close("close_requested", now, event_id)

    def _update(self, update, event_id: str | None) -> None:
        old = self.config
        self.config = old.updated(update, self.facts)
        if self.config.delegation not in CLIENT_WORDS and (
                (self.config.backend, self.config.responses) != (old.backend, old.responses)):
            # (client and Decisions delegation: the planner's LLM stays the client's stand-in; Decisions'
            # model is the profile its `Decide`s name)
            self.outbox.call(Configure(self.config.backend, self.config.system_prompt(self.facts)))
        if self.config.triggers != old.triggers:
            self.decisions.triggers_changed()
        if (self.config.tools, self.config.tool_choice) != (old.tools, old.tool_choice):
            self.outbox.call(ClientTools(self.config.tools, self.config.tool_choice))
        self.outbox.emit("session.updated", client_event_id=event_id, session=self.config.resource(self.facts))
        if self.config.substituted and self.config.delegated_model != old.delegated_model:
            self._substituted(self.config)

    def _context(self, kind: str, content: str, delegation_id: str | None, event_id: str | None) -> None:
        """commentary (speakable), thinking (silent) or instructions, for a delegation or the session."""
        if estimated_tokens(content) > MAX_CONTENT_TOKENS:
            raise LiveError("string_above_max_length", f"content is limited to {MAX_CONTENT_TOKENS} tokens.",
                            "content")
        if delegation_id is not None:
            if self.config.delegation == "responses":
                raise LiveError("invalid_value", "delegation_id must be null with Responses delegation.",
                                "delegation_id")
            if delegation_id not in self._delegations:
                raise LiveError("invalid_value", f"No delegation {delegation_id!r} in this session.",
                                "delegation_id")
        text = " ".join(content.split())
        if kind in ("commentary", "thinking"):
            self._acks.clear()  # the protocol: any commentary or thinking cancels every pending acknowledgement
        if kind == "instructions":
            self.config = self.config.with_instructions(text)
            self.outbox.call(Configure(None, self.config.system_prompt(self.facts)))
        elif kind == "commentary" and self.config.delegation in CLIENT_WORDS and text:
            self.outbox.call(Commentary(delegation_id, text))
        elif text:  # silent context; in responses delegation a commentary too: the LLM reads it
            self.outbox.call(AddContext("context", text))
        at = self.audio_ms()
        self.outbox.emit(f"session.{kind}.appended", client_event_id=event_id, start_ms=at, end_ms=at)
