"""The conversation's items as the client sees them (kept for retrieve and truncate), and the
user's side of it: the ASR's transcripts as user turns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kame.session_events import Transcript
from server.realtime.outbox import Outbox, new_id
from server.stable_text import StableWords

MAX_ITEMS = 200  # conversation items kept for retrieve and truncate


class Items:
    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self._items: dict[str, dict] = {}
        self.last_id: str | None = None

    def __contains__(self, item_id: str) -> bool:
        return item_id in self._items

    def get(self, item_id: str) -> dict | None:
        return self._items.get(item_id)

    def link(self, item_id: str) -> str | None:
        """`item_id` goes last in the conversation: the id before it."""
        previous, self.last_id = self.last_id, item_id
        return previous

    def store(self, item: dict) -> None:
        self._items[item["id"]] = item
        while len(self._items) > MAX_ITEMS:
            self._items.pop(next(iter(self._items)))

    def add(self, item: dict) -> None:
        """A finished item, added and done at once."""
        previous = self.link(item["id"])
        self.store(item)
        self.outbox.emit("conversation.item.added", previous_item_id=previous, item=item)
        self.outbox.emit("conversation.item.done", previous_item_id=previous, item=item)


def public(item: dict) -> dict:
    """A stored item without the server's own fields (`_audio_ms`, `_pieces`)."""
    return {k: v for k, v in item.items() if not k.startswith("_")}


@dataclass
class UserItem:
    id: str
    start_ms: int
    words: StableWords = field(default_factory=StableWords)  # its transcription deltas: words that will not change
    committed: bool = False  # the client committed it (turn_detection null): an item once its final comes
    announced: bool = False  # speech_started named it: speech_stopped will, whatever comes of it
    done: bool = False  # its item was sent


class UserTurns:
    """The user's utterances, from the ASR: with server VAD each final is a committed user item;
    with turn_detection null the finals wait for the client's commit."""

    def __init__(self, outbox: Outbox, items: Items, on_commit: Callable[[], None]) -> None:
        self.outbox, self.items, self.on_commit = outbox, items, on_commit
        self.current: UserItem | None = None
        self.uncommitted: list[tuple[UserItem, Transcript]] = []  # finals not committed yet
        self.settling: dict[str, tuple[UserItem, float | None]] = {}  # committed in progress: (item, deadline)

    def heard(self, event: Transcript, detecting: bool, transcribing: bool) -> UserItem | None:
        """A transcript; returns the utterance it started, if it started one. Its transcription deltas are the
        words the ASR will not revise (`StableWords`), so that they add up to the transcript: a partial may
        change its last words or punctuation ("What's the..." then "What's the weather"), which a delta
        cannot take back."""
        started = None
        if self.current is None and not detecting and self.uncommitted:  # one item until the client commits
            started = self.current = self.uncommitted[0][0]
        elif self.current is None:
            started = self.current = UserItem(new_id("item"), int(event.start_s * 1000))
            if detecting:
                started.announced = True
                self.outbox.emit("input_audio_buffer.speech_started", audio_start_ms=started.start_ms,
                                 item_id=started.id)
        user = self.current
        if not event.final:
            self._delta(user, user.words.partial(event.text, event.settled), transcribing)
            return started
        self._delta(user, user.words.final(event.text), transcribing)
        self.current = None
        if detecting:
            self.outbox.emit("input_audio_buffer.speech_stopped", audio_end_ms=int(event.end_s * 1000),
                             item_id=user.id)
            self.commit(user, [event], transcribing)
        elif user.committed:
            self.commit(user, [event], transcribing)
        else:
            self.uncommitted.append((user, event))  # the client commits by hand (input_audio_buffer.commit)
        return started

    def dropped(self, final: Transcript) -> None:
        """The utterance in progress ended as a backchannel (`final`): no item of it (its first words may have
        gone out as deltas, settled before the rest showed it was one); the next utterance starts a new one.
        An item speech_started announced is closed as the protocol closes one: speech_stopped, then
        `conversation.item.deleted` for the item that will not come (deltas under its id go with it)."""
        user = self.current
        if user is None or user.committed:
            return
        user.words.drop()
        self.current = None
        if user.announced:
            self.outbox.emit("input_audio_buffer.speech_stopped", audio_end_ms=int(final.end_s * 1000),
                             item_id=user.id)
            self.outbox.emit("conversation.item.deleted", item_id=user.id)

    def _delta(self, user: UserItem, delta: str, transcribing: bool) -> None:
        if delta and transcribing:
            self.outbox.emit("conversation.item.input_audio_transcription.delta", item_id=user.id, content_index=0,
                             delta=delta)

    def commit_uncommitted(self, transcribing: bool) -> None:
        held, self.uncommitted = self.uncommitted, []
        self.commit(held[0][0], [final for _, final in held], transcribing)  # under the first utterance's id

    def commit(self, user: UserItem, finals: list[Transcript], transcribing: bool) -> None:
        user.done = True
        self.settling.pop(user.id, None)
        self.on_commit()
        transcript = " ".join(f.text for f in finals).strip()
        self.outbox.emit("input_audio_buffer.committed", previous_item_id=self.items.last_id, item_id=user.id)
        item = {"id": user.id, "object": "realtime.item", "type": "message", "role": "user",
                "status": "completed", "content": [{"type": "input_audio", "transcript": None}]}
        previous = self.items.link(user.id)
        self.outbox.emit("conversation.item.added", previous_item_id=previous, item=item)
        if transcribing:
            seconds = max(0.0, finals[-1].end_s - finals[0].start_s) if finals else 0.0
            self.outbox.emit("conversation.item.input_audio_transcription.completed", item_id=user.id,
                             content_index=0, transcript=transcript,
                             usage={"type": "duration", "seconds": round(seconds, 3)})
        done = item | {"content": [{"type": "input_audio", "transcript": transcript}]}
        self.items.store(done)
        self.outbox.emit("conversation.item.done", previous_item_id=previous, item=done)

    # ---------------------------------------------------------------- an utterance committed while in progress

    def settle(self, user: UserItem) -> None:
        """The client committed `user` before its final: the ASR is told to finish it (a Flush); once it
        has, `flushed` gives the final a second to come."""
        user.committed = True
        self.settling[user.id] = (user, None)

    def flushed(self, item_id: str, now: float, wait_s: float = 1.0) -> None:
        if item_id in self.settling:
            self.settling[item_id] = (self.settling[item_id][0], now + wait_s)

    def wake_at(self) -> float | None:
        deadlines = [at for _, at in self.settling.values() if at is not None]
        return min(deadlines, default=None)

    def on_time(self, now: float, transcribing: bool) -> bool:
        """Commit, with an empty transcript, each settling utterance whose final never came (no words
        after all); true if one was."""
        due = [user for user, at in self.settling.values() if at is not None and at <= now]
        for user in due:
            if self.current is user:
                self.current = None
            self.commit(user, [], transcribing)
        return bool(due)
