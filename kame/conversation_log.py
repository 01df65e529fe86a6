"""A spoken conversation's events in the library's types, timed: what the evaluations, `kame infer` and
`kame replay` read, whether the session ran in this process (`kame.converse`) or behind a websocket
(`client.conversation.Conversation.log`, the wire's events read back with `kame.protocol.session_event`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kame.session_events import (
    AssistantAudio,
    AssistantText,
    LLMAttempt,
    OracleApplied,
    SessionEvent,
    SessionFailed,
    Transcript,
)


@dataclass
class ConversationLog:
    """Every event of a spoken conversation, with times in seconds since it opened: a session in this
    process, or one over the websocket read back into the session's event types."""

    events: list[tuple[float, SessionEvent]] = field(default_factory=list)  # (seconds since start, event)
    speech_end_s: float = 0.0  # when the question's last sample was pushed (or sent)
    frames_sent: int = 0  # the question's frames and the tail's

    def of(self, kind: type) -> list:
        return [e for _, e in self.events if isinstance(e, kind)]

    @property
    def assistant_text(self) -> str:
        return "".join(e.text for e in self.of(AssistantText)).strip()

    @property
    def assistant_audio(self) -> np.ndarray:
        frames = [e.pcm for e in self.of(AssistantAudio)]
        return np.concatenate(frames) if frames else np.zeros(0, np.float32)

    def lines(self) -> list[str]:
        """What happened, one readable line per transcript, oracle update and LLM phase."""
        out = []
        for t, event in self.events:
            if isinstance(event, Transcript):
                out.append(f"{t:6.2f}s  {'final  ' if event.final else 'partial'} {event.text}")
            elif isinstance(event, OracleApplied) and event.accepted:
                out.append(f"{t:6.2f}s  oracle  {event.op:6} {event.text}")
            elif isinstance(event, SessionFailed):
                out.append(f"{t:6.2f}s  error   {event.message}")
            elif isinstance(event, LLMAttempt) and event.phase in ("started", "done", "failed"):
                detail = event.user_text if event.phase == "started" else (event.answer or event.error or "")
                out.append(f"{t:6.2f}s  llm {event.epoch:<3} {event.phase:7} {detail}")
        return out
