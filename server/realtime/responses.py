"""The assistant's side: the front-end's continuous speech cut into Realtime responses.

A response is a burst of speech: it opens when the front-end speaks after quiet and closes after
`quiet_s` without speech. A burst nobody asked for (no automatic responses) is kept, not sent,
so that a `response.create` during it or soon after releases it. All times are the caller's `now`.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kame.audio import FRAME_S
from server.realtime.client_events import RealtimeError
from server.realtime.config import RealtimeConfig
from server.realtime.conversation import Items
from server.realtime.outbox import Outbox, new_id

ZERO_USAGE = {"total_tokens": 0, "input_tokens": 0, "output_tokens": 0,
              "input_token_details": {"text_tokens": 0, "audio_tokens": 0, "cached_tokens": 0,
                                      "cached_tokens_details": {"text_tokens": 0, "audio_tokens": 0}},
              "output_token_details": {"text_tokens": 0, "audio_tokens": 0}}


@dataclass
class Response:
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
class Burst:
    """Speech the model gave while no response was asked for."""

    first_frame: int
    frames: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (frame, pcm)
    pieces: list[tuple[int, str]] = field(default_factory=list)  # (frame, text)
    ended_at: float | None = None  # when it went quiet; None: the model is still speaking


class Speech:
    def __init__(self, outbox: Outbox, items: Items, config: Callable[[], RealtimeConfig], session_id: str,
                 response_timeout_s: float, energy_dbfs: float) -> None:
        self.outbox, self.items, self.config, self.session_id = outbox, items, config, session_id
        self.response_timeout_s = response_timeout_s
        self._energy = 10 ** (energy_dbfs / 20)
        self.response: Response | None = None
        self.pending: Response | None = None  # a response.create waiting for the model to speak
        self.muted = False  # a burst nobody asked for (no auto response) or cancelled: not sent
        self.kept: Burst | None = None  # a burst nobody asked for, kept for a response.create
        self.last_active = 0.0  # when the current burst last spoke
        self.encode = config().output_format.encoder()  # float32 -> the output format's bytes (a resampler's state)
        # where a media path carries the audio (a SIP call): the response's frames go there, not as deltas
        self.play: Callable[[np.ndarray, int], None] | None = None

    # ---------------------------------------------------------------- the front-end's output

    def audio(self, frame: int, pcm: np.ndarray, ready: bool, now: float, extra: dict) -> None:
        if self.config().activity == "text+audio" and ready and float(np.sqrt(np.mean(pcm ** 2))) >= self._energy:
            self._speaks(frame, now)
        played = False
        if self.response is not None and self.response.started:
            played = self._send_audio(self.response, frame, pcm, extra)
        elif self.muted and self.kept is not None and self.kept.ended_at is None:
            self.kept.frames.append((frame, pcm))
        if self.play is not None and not played:  # a call's line goes on, quiet, between responses
            self.play(np.zeros_like(pcm), frame)
        self.check_quiet(now)

    def text(self, frame: int, text: str, now: float) -> None:
        self._speaks(frame, now)
        if self.response is not None and self.response.started:
            self._send_text(self.response, frame, text)
        elif self.muted and self.kept is not None and self.kept.ended_at is None:
            self.kept.pieces.append((frame, text))

    def _speaks(self, frame: int, now: float) -> None:
        """The front-end speaks at `frame`: a burst goes on, or a new one starts."""
        self.last_active = now
        if self.muted or self.response is not None:
            return
        if self.pending is not None:
            response, self.pending = self.pending, None
        elif self.config().auto_respond:
            response = self._new(False, now)
        else:
            self.muted, self.kept = True, Burst(frame)  # nobody asked for this burst: kept, not sent
            return
        self.response = response
        self._start(response, frame)

    def check_quiet(self, now: float) -> None:
        """Close the burst after `quiet_s` without speech; a requested response that never started
        ends empty after `response_timeout_s`."""
        if now < self.last_active + self.config().quiet_s:  # the very sum wake_at gives: no spin at the edge
            return
        if self.response is not None:
            response = self.response
            if response.interrupted:
                self.close(response, "cancelled", "turn_detected")
            else:
                self.close(response, "completed")
        self.muted = False
        if self.kept is not None and self.kept.ended_at is None:
            self.kept.ended_at = now
        if self.pending is not None and now >= self.pending.created_at + self.response_timeout_s:
            self.close(self.pending, "completed")

    def wake_at(self) -> float | None:
        """When `check_quiet` has something to do next, if no speech comes before."""
        quiet_at = self.last_active + self.config().quiet_s
        deadlines = []
        if self.response is not None or self.muted or (self.kept is not None and self.kept.ended_at is None):
            deadlines.append(quiet_at)
        if self.pending is not None:
            deadlines.append(max(quiet_at, self.pending.created_at + self.response_timeout_s))
        return min(deadlines, default=None)

    # ---------------------------------------------------------------- what the client asks

    def create(self, metadata: dict | None, now: float) -> None:
        if self.response is not None or self.pending is not None:
            raise RealtimeError("conversation_already_has_active_response",
                                "a response is in progress: cancel it or wait for response.done")
        response = self._new(True, now, metadata)
        kept, self.kept = self.kept, None
        if kept is None or (kept.ended_at is not None and now - kept.ended_at > self.response_timeout_s):
            self.pending = response  # the model's next burst answers it
            return
        # the model has spoken (or is speaking) by itself: what it said is this response, sent now
        self._start(response, kept.first_frame)
        pieces = iter(kept.pieces)
        piece = next(pieces, None)
        for frame, pcm in kept.frames:
            while piece is not None and piece[0] <= frame:
                self._send_text(response, *piece)
                piece = next(pieces, None)
            self._send_audio(response, frame, pcm, {"kame_frame": frame} if self.config().events else {}, late=True)
        for rest in ([piece] if piece else []) + list(pieces):
            self._send_text(response, *rest)
        if kept.ended_at is None:
            self.response, self.muted = response, False  # the rest streams live
        else:
            self.close(response, "completed")

    def cancel(self) -> None:
        response = self.response or self.pending
        if response is None:
            raise RealtimeError("response_cancel_not_active", "Cancellation failed: no active response found")
        speaking = response is self.response
        self.close(response, "cancelled", "client_cancelled")
        self.muted = self.muted or speaking  # the rest of this burst is not sent

    def playing(self, item_id: str) -> Response | None:
        """The response whose item is being spoken now, if it is `item_id`."""
        live = self.response
        return live if live is not None and live.started and live.item_id == item_id else None

    def barge_in(self) -> None:
        """The user started speaking: the response ends as cancelled once the front-end yields."""
        if self.response is not None and self.response.started:
            self.response.interrupted = True

    def user_committed(self) -> None:
        if self.kept is not None and self.kept.ended_at is not None:
            self.kept = None  # what the model said before this turn was committed is not its answer

    def function_call(self, name: str, arguments: str, call_id: str, now: float) -> None:
        """The backend LLM calls the client's function: the call goes out as a response of its own."""
        item_id = new_id("item")
        response = Response(new_id("resp"), item_id, False, now, modalities=self.config().output_modalities)
        emit = self.outbox.emit
        emit("response.created", response=self._object(response, "in_progress"))
        item = {"id": item_id, "object": "realtime.item", "type": "function_call", "status": "in_progress",
                "name": name, "call_id": call_id, "arguments": ""}
        common = {"response_id": response.id, "item_id": item_id, "output_index": 0}
        emit("response.output_item.added", response_id=response.id, output_index=0, item=item)
        previous = self.items.link(item_id)
        emit("conversation.item.added", previous_item_id=previous, item=item)
        for start in range(0, len(arguments), 64):
            emit("response.function_call_arguments.delta", call_id=call_id, delta=arguments[start:start + 64],
                 **common)
        emit("response.function_call_arguments.done", call_id=call_id, name=name, arguments=arguments, **common)
        done = item | {"status": "completed", "arguments": arguments}
        emit("response.output_item.done", response_id=response.id, output_index=0, item=done)
        emit("conversation.item.done", previous_item_id=previous, item=done)
        self.items.store(done)
        emit("response.done", response=self._object(response, "completed", output=[done]))

    # ---------------------------------------------------------------- responses

    def _new(self, requested: bool, now: float, metadata: dict | None = None) -> Response:
        response = Response(new_id("resp"), new_id("item"), requested, now,
                            modalities=self.config().output_modalities, metadata=metadata)
        self.outbox.emit("response.created", response=self._object(response, "in_progress"))
        return response

    def _start(self, response: Response, frame: int) -> None:
        response.started, response.first_frame = True, frame
        item = self._item(response, "in_progress")
        self.outbox.emit("response.output_item.added", response_id=response.id, output_index=0, item=item)
        response.previous_item_id = self.items.link(response.item_id)
        self.outbox.emit("conversation.item.added", previous_item_id=response.previous_item_id, item=item)
        self.outbox.emit("response.content_part.added", response_id=response.id, item_id=response.item_id,
                         output_index=0, content_index=0, part=_part(response))

    def _send_audio(self, response: Response, frame: int, pcm: np.ndarray, extra: dict, late: bool = False) -> bool:
        """The response's frame to the client (True: played on a call's line). A call plays only the present:
        a kept burst's frames (`late`) were its silence when they were made."""
        response.audio_ms += FRAME_S * 1000
        if "audio" not in response.modalities:
            return False
        if self.play is not None:
            if not late:
                self.play(pcm, frame)
            return not late
        self.outbox.emit("response.output_audio.delta", droppable=True, response_id=response.id,
                         item_id=response.item_id, output_index=0, content_index=0,
                         delta=base64.b64encode(self.encode(pcm)).decode(), **extra)
        return False

    def _send_text(self, response: Response, frame: int, text: str) -> None:
        offset = (frame - (response.first_frame if response.first_frame is not None else frame)) * FRAME_S * 1000
        response.pieces.append((offset, text))
        kind = "response.output_audio_transcript.delta" if "audio" in response.modalities \
            else "response.output_text.delta"
        self.outbox.emit(kind, response_id=response.id, item_id=response.item_id, output_index=0, content_index=0,
                         delta=text)

    def close(self, response: Response, status: str, reason: str | None = None) -> None:
        if response is self.response:
            self.response = None
        if response is self.pending:
            self.pending = None
        output = []
        if response.started:
            common = {"response_id": response.id, "item_id": response.item_id, "output_index": 0,
                      "content_index": 0}
            if "audio" in response.modalities:
                self.outbox.emit("response.output_audio.done", **common)
                self.outbox.emit("response.output_audio_transcript.done", transcript=response.transcript, **common)
            else:
                self.outbox.emit("response.output_text.done", text=response.transcript, **common)
            self.outbox.emit("response.content_part.done", part=_part(response), **common)
            item = self._item(response, "completed" if status == "completed" else "incomplete")
            self.outbox.emit("response.output_item.done", response_id=response.id, output_index=0, item=item)
            self.outbox.emit("conversation.item.done", previous_item_id=response.previous_item_id, item=item)
            self.items.store(item | {"_audio_ms": response.audio_ms, "_pieces": response.pieces})
            output = [item]
        self.outbox.emit("response.done", response=self._object(response, status, reason, output))

    def live_item(self, response: Response) -> dict:
        return self._item(response, "in_progress")

    def _item(self, response: Response, status: str) -> dict:
        content = {"type": "output_audio", "transcript": response.transcript} \
            if "audio" in response.modalities else {"type": "output_text", "text": response.transcript}
        return {"id": response.item_id, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": status, "content": [content]}

    def _object(self, response: Response, status: str, reason: str | None = None, output: list | None = None) -> dict:
        config = self.config()
        details = None if status == "in_progress" else {"type": status, "reason": reason}
        return {"id": response.id, "object": "realtime.response", "status": status, "status_details": details,
                "output": output or [], "output_modalities": list(response.modalities),
                "conversation_id": f"conv_{self.session_id}", "max_output_tokens": "inf",
                "metadata": response.metadata,
                "audio": {"output": {"format": config.output_format.as_dict(), "voice": config.voice}},
                # no token counts from a speech model: zeros, the shape frameworks read
                "usage": None if status == "in_progress" else ZERO_USAGE}


def _part(response: Response) -> dict:
    if "audio" in response.modalities:
        return {"type": "audio", "transcript": response.transcript}
    return {"type": "text", "text": response.transcript}
