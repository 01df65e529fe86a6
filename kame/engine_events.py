"""One engine frame's output, in the session's vocabulary.

    FrameOutput (engine thread, per slot and frame) -> AssistantAudio, AssistantText?, OracleApplied*

Pure: no loop, no clock (the session measures the frame's latency and passes it in). It keeps
only the text decoder's state, the bytes of a character the front-end has not finished writing.
"""

from __future__ import annotations

from kame.frontend.engine import FrameOutput
from kame.frontend.oracle import PieceDecoder
from kame.session_events import AssistantAudio, AssistantText, OracleApplied, SessionEvent


class FrameEvents:
    """A slot's frame outputs as session events, in the order a reader should see them."""

    def __init__(self, tokenizer) -> None:
        self._pieces = PieceDecoder(tokenizer) if tokenizer else None

    def of(self, output: FrameOutput, latency_s: float | None) -> list[SessionEvent]:
        """The frame's audio, then the text piece it completed (if any), then each oracle update that
        reached the front-end just before the frame (or was dropped as stale)."""
        events: list[SessionEvent] = [AssistantAudio(output.frame, output.pcm, output.audio_ready, latency_s)]
        if output.text_token is not None and self._pieces is not None:
            piece = self._pieces.push(output.text_token)
            if piece:
                events.append(AssistantText(output.frame, piece))
        for applied in output.applied:
            update = applied.update
            events.append(OracleApplied(update.op.value, update.epoch, update.text, len(update.tokens),
                                        applied.frame, applied.accepted, applied.late_tokens))
        return events
