"""The OpenAI Realtime protocol over one tandem session, as a state machine: no socket, no session,
no clock of its own. Feed it the client's text frames (`on_client`), the session's events
(`on_session`) and the time (`on_time`, when `wake_at` says); take the actions it asks for
(`take`: server events to send, session calls) and carry them out (`adapter.py` does).

The parts: `config.py` (session.update), `responses.py` (the assistant's speech as responses),
`conversation.py` (the items, the user's turns). docs/realtime.md has the whole mapping.
"""

from __future__ import annotations

import base64
import binascii
import collections
import json
import logging
import time

import numpy as np
from pydantic import ValidationError

from kame.audio import FRAME_S, FRAME_SIZE, SAMPLE_RATE
from kame.commands import AddUserText, PushAudio, TruncateAssistant
from kame.protocol import wire_event
from kame.session_events import AssistantAudio, AssistantText, SessionEvent, SessionFailed, Transcript
from server.echo import CallEcho
from server.realtime import client_events as ce
from server.realtime.actions import Action, AnswerCall, End, Flush
from server.realtime.client_events import RealtimeError
from server.realtime.config import RealtimeConfig, SessionFacts
from server.realtime.conversation import MAX_ITEMS, Items, UserItem, UserTurns, public
from server.realtime.outbox import Outbox, new_id
from server.realtime.responses import Speech

logger = logging.getLogger(__name__)

SILENCE = np.zeros(FRAME_SIZE, dtype=np.float32)
SILENCE_SLACK_S = 0.3  # client audio may lag the clock this much (chunks, jitter) before silence is fed
SILENCE_CATCH_UP = 3  # frames of silence fed at once at most when the timer ran late
CONFIGURE_GRACE_S = 0.5  # a client configuring its session first is not fed silence for this long


class RealtimeMapping:
    def __init__(self, facts: SessionFacts, model: str, beta: bool, now: float) -> None:
        self.facts = facts
        self.outbox = Outbox(facts.session_id, beta)
        self.config = RealtimeConfig.initial(model, facts)
        self.items = Items(self.outbox)
        options = facts.options
        self.speech = Speech(self.outbox, self.items, lambda: self.config, facts.session_id,
                             options.response_timeout_s, options.energy_dbfs)
        self.user = UserTurns(self.outbox, self.items, on_commit=self.speech.user_committed)
        # a telephone caller's speakerphone sends our voice back: cancelled between the codecs and the session
        self.echo = CallEcho(facts.echo)
        self._codecs()
        # the audio clock: the audio pushed (the client's and fed silence) against the time since it started
        self._clock_start = now + CONFIGURE_GRACE_S
        self._pushed_s = 0.0
        self._appended = False  # audio came since the last commit
        self._waiting: set[str] = set()  # function calls the client has not answered yet
        # calls that stopped waiting (timed out, or their attempt was cancelled): an output that comes
        # for one later is kept in the conversation, not answered with an error (which ends a session
        # in some frameworks)
        self._ended_calls: collections.OrderedDict[str, None] = collections.OrderedDict()

    def take(self) -> list[Action]:
        """What to do, in order, since the last take."""
        return self.outbox.take()

    def greet(self) -> None:
        self.outbox.emit("session.created", session=self.config.session_object(self.facts))

    def refuse(self, exc: Exception, kind: str = "invalid_request_error") -> None:
        """A bad client event (or a session call it made that failed): the client is told."""
        self.outbox.error(getattr(exc, "code", "invalid_request"), str(exc), getattr(exc, "param", None),
                          getattr(exc, "client_event_id", None), kind)

    # ---------------------------------------------------------------- the clock

    def wake_at(self) -> float | None:
        """When `on_time` has something to do next if nothing else happens before; None: never."""
        deadlines = [self.speech.wake_at(), self.user.wake_at(),
                     self._silence_at() if self.config.feed_silence else None]
        return min((d for d in deadlines if d is not None), default=None)

    def on_time(self, now: float) -> None:
        """Bursts end on time even when no frame comes; an unanswered commit settles; silence is fed
        when the client's audio falls behind the clock (the front-end speaks in step with what it hears)."""
        self.speech.check_quiet(now)
        self.user.on_time(now, self._transcribing)
        if self.config.feed_silence and now >= self._silence_at():
            due = int((now - self._silence_at()) / FRAME_S) + 1
            self._pushed_s += due * FRAME_S
            # after a stall, the silence nobody heard is skipped, as the engine would skip it to stay live
            for _ in range(min(due, SILENCE_CATCH_UP)):
                self.outbox.call(PushAudio(SILENCE))

    def _silence_at(self) -> float:
        return self._clock_start + self._pushed_s + SILENCE_SLACK_S

    # ---------------------------------------------------------------- the session's events

    def on_session(self, event: SessionEvent, now: float) -> None:
        if isinstance(event, AssistantAudio):
            extra = {"kame_frame": event.frame} if self.config.events else {}  # latency measurements
            self.speech.audio(event.frame, event.pcm, event.ready, now, extra)
        elif isinstance(event, AssistantText):
            self.speech.text(event.frame, event.text, now)
        elif isinstance(event, Transcript):
            if event.backchannel and event.final:
                self.user.dropped(event)
            if not event.backchannel:  # "mm-hm" while the assistant speaks: no user turn, no barge-in
                started = self.user.heard(event, self.config.turn_detection is not None, self._transcribing)
                if started is not None and self.config.interrupts:
                    self.speech.barge_in()
            self._extension(event)
        elif isinstance(event, SessionFailed):
            self.outbox.error(event.code, event.message, kind="server_error")
            self.outbox.call(End("engine failure" if event.code == "engine" else "internal error"))
        else:
            self._extension(event)

    def _extension(self, event: SessionEvent) -> None:
        if self.config.events and (wire := wire_event(event)) is not None:
            self.outbox.emit(f"kame.{wire.type}", **wire.model_dump(exclude={"type"}))

    @property
    def _transcribing(self) -> bool:
        return self.config.transcription is not None

    # ---------------------------------------------------------------- the client's events

    def on_client(self, text: str | None, now: float) -> None:
        """One text frame of the client (None for a binary one); RealtimeError for a bad one."""
        event, event_id = ce.parse(text, self.facts.max_event_bytes)
        try:
            self._handle(event, now)
        except RealtimeError as exc:
            exc.client_event_id = event_id  # the error names the event it answers
            raise
        except (TypeError, AttributeError, KeyError, ValueError, IndexError) as exc:
            # a shape no check foresaw: this event is refused, the session goes on (and the log says where)
            logger.warning("session %s: %s event refused", self.facts.session_id, event.type, exc_info=True)
            raise RealtimeError("invalid_value", f"{event.type}: a field has the wrong type ({exc})",
                                client_event_id=event_id) from exc

    def _handle(self, event: ce.ClientEvent, now: float) -> None:
        match event:
            case ce.SessionUpdate():
                self._session_update(event.session, now)
            case ce.AudioAppend():
                self._append(event.audio)
            case ce.AudioCommit():
                self._commit()
            case ce.AudioClear():
                self._clear()
            case ce.ItemCreate():
                self._item_create(event.item)
            case ce.ItemTruncate():
                self._truncate(event.item_id, event.audio_end_ms)
            case ce.ItemRetrieve():
                self._retrieve(event.item_id)
            case ce.ResponseCreate():
                self.speech.create(event.response.metadata, now)
            case ce.ResponseCancel():
                self.speech.cancel()
            case ce.Refused():
                raise RealtimeError("unsupported_event", f"{event.type} is not supported: {event.why}", "type")

    def configure(self, session: dict, now: float) -> None:
        """A session configuration given outside the socket (a SIP call's accept: the body of
        `POST /v1/realtime/calls/{call_id}/accept`), applied as a session.update would be;
        RealtimeError naming the field at fault."""
        try:
            config = ce.SessionConfigIn.model_validate(session)
        except ValidationError as exc:
            raise ce.invalid(exc, prefix=("session",)) from None
        self._session_update(config, now)

    def digit(self, key: str) -> None:
        """A key the caller pressed on a SIP call (RFC 4733 or SIP INFO)."""
        self.outbox.emit("input_audio_buffer.dtmf_event_received", event=key, received_at=int(time.time()))

    def _session_update(self, session: ce.SessionConfigIn, now: float) -> None:
        old = self.config
        self.config, calls = old.updated(session, self.facts)
        if (self.config.input_format, self.config.output_format) != (old.input_format, old.output_format):
            self._codecs()
        if self.config.feed_silence and not old.feed_silence:  # it counts from now
            self._pushed_s = max(self._pushed_s, now - self._clock_start)
        for call in calls:
            self.outbox.call(call)
        self.outbox.emit("session.updated", session=self.config.session_object(self.facts))

    def _codecs(self) -> None:
        """The decoder and encoder of the session's formats (their resamplers start afresh), with the
        echo canceller between them where the session is a telephone one."""
        config = self.config
        self.echo.formats(config.input_format.type, config.output_format.type)
        self._decode = self.echo.decoder(config.input_format.decoder())
        self.speech.encode = self.echo.encoder(config.output_format.encoder())

    def _append(self, audio: str) -> None:
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise RealtimeError("invalid_base64", "'audio' is not valid base64", "audio") from exc
        if self.config.input_format.type == "audio/pcm" and len(data) % 2:
            raise RealtimeError("invalid_audio", "audio/pcm is 16-bit: an even number of bytes", "audio")
        self.hear(self._decode(data))
        self._appended = self._appended or len(data) > 0  # the echo canceller may hold back < 10 ms

    def hear(self, pcm: np.ndarray) -> None:
        """The user's audio, decoded (float32, 24 kHz): from `input_audio_buffer.append`, or a call's media."""
        self.outbox.call(PushAudio(pcm))
        self._pushed_s += len(pcm) / SAMPLE_RATE
        self._appended = self._appended or len(pcm) > 0

    def _commit(self) -> None:
        user = self.user
        if self.config.turn_detection is not None:
            raise RealtimeError("invalid_request", "with server_vad the server commits the audio itself; "
                                "set audio.input.turn_detection to null to commit by hand")
        if not user.uncommitted and user.current is None and not self._appended:
            raise RealtimeError("input_audio_buffer_commit_empty", "no audio appended since the last commit")
        self._appended = False
        committed = bool(user.uncommitted)
        if user.uncommitted:
            user.commit_uncommitted(self._transcribing)
        if user.current is not None:  # an utterance in progress: its item comes with its final
            user.settle(user.current)
            self.outbox.call(Flush(user.current.id))
            committed = True
        if not committed:  # audio without words: an item with an empty transcript
            user.commit(UserItem(new_id("item"), int(self._pushed_s * 1000)), [], self._transcribing)

    def on_flushed(self, token: str, now: float) -> None:
        """The ASR finished what it had (a Flush): a final that does not come within a second commits
        the utterance with an empty transcript."""
        self.user.flushed(token, now)

    def _clear(self) -> None:
        # the full-duplex front-end has heard it already; what is dropped are the finals not committed
        self.user.uncommitted.clear()
        self._appended = False
        if self.config.turn_detection is None:
            self.user.current = None
        self.outbox.emit("input_audio_buffer.cleared")

    def _item_create(self, item: ce.UserMessage | ce.FunctionCallOutput | ce.FunctionCall) -> None:
        if isinstance(item, ce.FunctionCallOutput):
            self._function_output(item)
            return
        if isinstance(item, ce.FunctionCall):
            raise RealtimeError("invalid_value", "function calls are the model's to make: send their "
                                "function_call_output", "item.type")
        if item.id is not None and item.id in self.items:
            raise RealtimeError("invalid_value", "item.id is a new, non-empty string (or left out)", "item.id")
        parts = [part.model_dump() for part in item.content]
        text = " ".join(" ".join(part.text for part in item.content).split())
        if not text:
            raise RealtimeError("invalid_request", "an empty user message", "item.content")
        self.outbox.call(AddUserText(text))
        self.items.add({"id": item.id or new_id("item"), "object": "realtime.item", "type": "message",
                        "role": "user", "status": "completed", "content": parts})

    def _truncate(self, item_id: str, end_ms: int) -> None:
        live = self.speech.playing(item_id)
        self.echo.playback_stopped()
        if live is not None:  # the client stopped playing it (a barge-in): the rest of the burst is unsent
            self.speech.close(live, "cancelled", "turn_detected")
            self.speech.muted = True
        item = self.items.get(item_id)
        if item is None or item.get("role") != "assistant":
            raise RealtimeError("item_truncate_invalid_item_id", f"no assistant item {item_id!r} to truncate",
                                "item_id")
        if end_ms > item["_audio_ms"] + 1:
            raise RealtimeError("invalid_value", f"audio_end_ms must be within the item's {item['_audio_ms']:.0f} ms "
                                "of audio", "audio_end_ms")
        heard = "".join(text for offset, text in item["_pieces"] if offset <= end_ms).strip()
        content = item["content"][0]
        key = "transcript" if "transcript" in content else "text"
        self.outbox.call(TruncateAssistant(content[key], heard))
        content[key] = heard
        item["_audio_ms"] = end_ms  # a later truncate can only cut more
        self.outbox.emit("conversation.item.truncated", item_id=item_id, content_index=0, audio_end_ms=end_ms)

    def _retrieve(self, item_id: str) -> None:
        live = self.speech.playing(item_id)
        if live is not None:
            self.outbox.emit("conversation.item.retrieved", item=self.speech.live_item(live))
            return
        item = self.items.get(item_id)
        if item is None:
            raise RealtimeError("item_retrieve_invalid_item_id", f"no item {item_id!r}", "item_id")
        self.outbox.emit("conversation.item.retrieved", item=public(item))

    # ---------------------------------------------------------------- client functions

    def function_call(self, name: str, arguments: dict, now: float) -> str:
        """The backend LLM calls the client's function `name`: the call is sent as a response of its
        own; returns its call_id, whose output comes as an AnswerCall."""
        call_id = new_id("call")
        self.speech.function_call(name, json.dumps(arguments), call_id, now)
        self._waiting.add(call_id)
        return call_id

    def call_ended(self, call_id: str, answered: bool) -> None:
        """The LLM stopped waiting for `call_id`, answered or not (timed out, cancelled)."""
        self._waiting.discard(call_id)
        if not answered:
            self._ended_calls[call_id] = None
            while len(self._ended_calls) > MAX_ITEMS:
                self._ended_calls.popitem(last=False)

    def _function_output(self, item: ce.FunctionCallOutput) -> None:
        call_id = item.call_id
        if call_id in self._waiting:
            self._waiting.discard(call_id)
            self.outbox.call(AnswerCall(call_id, item.output))
        elif call_id in self._ended_calls:
            logger.info("session %s: the output of function call %s came after the call stopped waiting "
                        "(timed out, or its answer was superseded); kept, not used", self.facts.session_id, call_id)
            del self._ended_calls[call_id]  # a second output for it is an error like any other
        else:
            raise RealtimeError("invalid_value", f"no function call {call_id!r} is waiting for its output "
                                "(answered already, or never made)", "item.call_id")
        self.items.add({"id": item.id or new_id("item"), "object": "realtime.item",
                        "type": "function_call_output", "call_id": call_id, "output": item.output,
                        "status": "completed"})
