"""When the engine thread steps: the frame clock's two policies behind one interface, `StepPolicy`.

A policy is pure: it decides from the slots' inboxes and a time passed in, with no thread, lock or
clock of its own (the runner calls it under its lock with its time source's `now()`, tests with a
manual time), so what each promises about time is checked exactly, without sleeping.

- `TickPolicy` (`engine_clock = "tick"`): one step per frame for every slot that has a frame, at the
  phase of the frame period that keeps the live slots' summed wait shortest; early when every sending
  slot has its frame, and at once when a live slot is behind (holds two frames or more).
- `EagerPolicy` (`engine_clock = "eager"`): step as soon as a frame arrives, waiting at most
  `batch_window_s` for the other sending slots.
"""

from __future__ import annotations

import cmath
import math
from collections.abc import Collection
from typing import Literal, Protocol

import numpy as np

from kame.frontend.slots import SlotInbox

EngineClock = Literal["tick", "eager"]  # the policy's name, as `engine_clock` and `EngineRunner(clock=...)` spell it
SENDING_FRAMES = 2  # a slot that pushed a frame within this many frame periods is sending
PHASE_WEIGHT = 0.2  # how much each arrival moves a slot's learnt phase (an exponential average)
PHASE_STEADY = 0.5  # a slot's phase counts once its average is this consistent (1: every arrival alike)


class StepPolicy(Protocol):
    """What the engine thread asks before each step; every call is made under the runner's lock."""

    name: EngineClock

    def arrived(self, inbox: SlotInbox, now: float) -> None:
        """A frame was pushed into `inbox` at `now`."""

    def wakes(self, inbox: SlotInbox, inboxes: Collection[SlotInbox], now: float) -> bool:
        """Whether that frame must wake the engine thread now (else the time `next_step` gave it will)."""

    def next_step(self, inboxes: Collection[SlotInbox], holding: int, now: float) -> float | None:
        """When to step, given the inboxes (`holding` of them hold a frame): `now` or earlier: step now
        (the policy takes it as done: the caller must step); later: wait until then unless a push wakes
        the thread; None: sleep until a push wakes it."""

    def interrupt(self) -> bool:
        """A command or a stop came while the thread waited: True to step the batch gathered so far
        first (and stop gathering), False to let the command go first."""


def sending(inbox: SlotInbox, now: float, frame_s: float) -> bool:
    """Holds a frame, or pushed one lately: a slot whose client stopped sending holds nobody up."""
    return bool(inbox.frames) or (inbox.last_arrival is not None
                                  and now - inbox.last_arrival <= SENDING_FRAMES * frame_s)


class TickPolicy:
    """The tick clock.

    A step is due at `next_tick`, which lies at `phase_s` of the frame period (times modulo
    `frame_s`) at least half a frame after the step that planned it. It comes early when every
    sending slot holds a frame within two margins of the tick ("ready": waiting out the arrivals'
    jitter would only add latency), and when a live slot holds
    two frames or more ("behind": a stall left it late; the catch-up steps every slot that has a frame,
    so the extra step serves the whole batch, and does not move the plan). The phase is the one that
    keeps the live slots' summed wait (tick - arrival, modulo the frame) shortest: just after one of
    their learnt arrival phases; the current one is kept unless another saves over a millisecond a slot.
    """

    name: EngineClock = "tick"

    def __init__(self, frame_s: float, margin_s: float | None = None) -> None:
        self.frame_s = frame_s
        self.margin_s = frame_s / 16 if margin_s is None else margin_s  # "just after": the arrivals' jitter
        self.next_tick: float | None = None  # None: idle (the next frame is stepped at once)
        self.phase_s: float | None = None  # where in the period the tick lies; None: no steady arrivals yet

    def arrived(self, inbox: SlotInbox, now: float) -> None:
        """Note the arrival and learn the slot's phase (live slots only)."""
        inbox.last_arrival = now
        if inbox.live:
            arrival = cmath.exp(2j * math.pi * (now % self.frame_s) / self.frame_s)
            inbox.phase = arrival if inbox.phase == 0 else inbox.phase + PHASE_WEIGHT * (arrival - inbox.phase)

    def sending(self, inbox: SlotInbox, now: float) -> bool:
        return sending(inbox, now, self.frame_s)

    def ready(self, inboxes: Collection[SlotInbox], now: float) -> bool:
        """Some slot holds a frame and every sending slot does."""
        return any(inbox.frames for inbox in inboxes) and all(
            inbox.frames for inbox in inboxes if self.sending(inbox, now))

    def next_step(self, inboxes: Collection[SlotInbox], holding: int, now: float) -> float | None:
        """Now if there is a `reason` (the next tick planned), else the tick; None once a tick found no
        frame: sleep until one arrives, then step it at once."""
        reason = self.reason(inboxes, now)
        if reason is not None:
            self.stepped(reason, inboxes, now)
            return now
        if self.next_tick is not None and now >= self.next_tick:
            self.idle()
        return self.next_tick

    def interrupt(self) -> bool:
        return False  # nothing is gathered between ticks: commands go first

    def reason(self, inboxes: Collection[SlotInbox], now: float) -> str | None:
        """Why to step now: "due", "behind" or "ready"; None: wait (for `next_tick` or a frame)."""
        if not any(inbox.frames for inbox in inboxes):
            return None
        if self.next_tick is None or now >= self.next_tick:
            return "due"
        if any(self._behind(inbox) for inbox in inboxes):
            return "behind"
        return "ready" if self._near(now) and self.ready(inboxes, now) else None

    def wakes(self, inbox: SlotInbox, inboxes: Collection[SlotInbox], now: float) -> bool:
        """A reason to step before the tick (the cheap checks first, and the slots as a view, not a
        copy: this runs at every push)."""
        return self._behind(inbox) or (self._near(now) and self.ready(inboxes, now))

    @staticmethod
    def _behind(inbox: SlotInbox) -> bool:
        return inbox.live and len(inbox.frames) >= 2

    def _near(self, now: float) -> bool:
        """Close enough to the tick to step when every frame is in: no need to wait out the margin (but
        no earlier, or the step would stay at whatever phase it had, the arrivals just before it waiting
        a whole frame); without a phase (no steady live slot: self-paced clients) at any time."""
        return self.phase_s is None or self.next_tick is None or self.next_tick - now <= 2 * self.margin_s

    def stepped(self, reason: str, inboxes: Collection[SlotInbox], now: float) -> None:
        """A step starts at `now` for `reason`: plan the next tick (a catch-up keeps the plan)."""
        if reason == "behind" and self.next_tick is not None:
            return
        self.phase_s = self._best_phase(inboxes, now)
        if self.phase_s is None:
            self.next_tick = now + self.frame_s
        else:
            earliest = now + self.frame_s / 2
            self.next_tick = earliest + (self.phase_s - earliest) % self.frame_s

    def idle(self) -> None:
        """The tick came and no slot had a frame: sleep until one comes, then step it at once."""
        self.next_tick = None

    def _best_phase(self, inboxes: Collection[SlotInbox], now: float) -> float | None:
        period = self.frame_s
        phases = np.array([cmath.phase(inbox.phase) / (2 * math.pi) * period % period for inbox in inboxes
                           if inbox.live and abs(inbox.phase) >= PHASE_STEADY and self.sending(inbox, now)])
        if not len(phases):
            return None
        candidates = (phases + self.margin_s) % period
        if self.phase_s is not None:
            candidates = np.append(candidates, self.phase_s)
        waits = ((candidates[:, None] - phases[None, :]) % period).sum(axis=1)
        best = int(np.argmin(waits))
        if self.phase_s is not None and waits[-1] <= waits[best] + 0.001 * len(phases):
            return self.phase_s
        return float(candidates[best])


class EagerPolicy:
    """The eager clock: the first frame opens a window of `batch_window_s`; the step comes when every
    slot that was sending when it opened holds a frame, or when it closes. The sending slots are
    counted once, then the wait compares `holding` with that count (the thread wakes at every push)."""

    name: EngineClock = "eager"

    def __init__(self, frame_s: float, batch_window_s: float) -> None:
        self.frame_s = frame_s  # "sending": a frame within SENDING_FRAMES of these
        self.batch_window_s = batch_window_s
        self.deadline: float | None = None  # the open window's end; None: no frame is waiting
        self._sending = 0  # slots sending when the window opened

    def arrived(self, inbox: SlotInbox, now: float) -> None:
        inbox.last_arrival = now

    def wakes(self, inbox: SlotInbox, inboxes: Collection[SlotInbox], now: float) -> bool:
        return True  # every frame may be the one the window waits for

    def next_step(self, inboxes: Collection[SlotInbox], holding: int, now: float) -> float | None:
        if self.deadline is None:
            if not holding:
                return None
            self.deadline = now + self.batch_window_s
            self._sending = sum(sending(inbox, now, self.frame_s) for inbox in inboxes)
        if holding >= self._sending or now >= self.deadline:
            self.deadline = None
            return now
        return self.deadline

    def interrupt(self) -> bool:
        """An open window is stepped as it is, before the command (a release among them)."""
        gathering, self.deadline = self.deadline is not None, None
        return gathering


def make_policy(clock: EngineClock, frame_s: float, batch_window_s: float) -> StepPolicy:
    """The policy named by `clock` (`engine_clock`'s "auto" is resolved before: kame/runtime.py)."""
    if clock == "tick":
        return TickPolicy(frame_s)
    if clock == "eager":
        return EagerPolicy(frame_s, batch_window_s)
    raise ValueError(f"clock must be 'tick' or 'eager', got {clock!r}")
