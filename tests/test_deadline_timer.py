"""The protocol mappings' `DeadlineTimer` on a manual clock: it wakes at the mapping's deadline,
sooner when the deadline comes nearer, sleeps without one, and ends when its task is cancelled,
whatever it is doing then (a timer that swallowed its cancellation kept a closing session's
TaskGroup, and so its engine slot, forever)."""

from __future__ import annotations

import asyncio

import pytest

from kame.clock import ManualClock, settle
from server.deadline import DeadlineTimer


class Mapping:
    """A mapping's deadlines: `wake_at` the earliest one, `on_time` notes when it was told the time."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.deadline: float | None = None
        self.woken: list[float] = []

    def wake_at(self) -> float | None:
        return self.deadline

    def on_time(self, now: float) -> None:
        self.woken.append(now)
        if self.deadline is not None and now >= self.deadline:
            self.deadline = None  # acted on


def timer_for(mapping: Mapping) -> DeadlineTimer:
    return DeadlineTimer(mapping.clock, mapping.wake_at, mapping.on_time, "test")


def test_it_wakes_at_the_deadline_sooner_when_it_comes_nearer_and_sleeps_without_one():
    async def go():
        clock = ManualClock()
        mapping = Mapping(clock)
        timer = timer_for(mapping)
        task = asyncio.create_task(timer.run())
        await settle()
        assert mapping.woken == []  # no deadline: asleep, not polling
        mapping.deadline = clock.now() + 2.0
        timer.nearer()
        await settle()
        woken = len(mapping.woken)  # told once that the deadline changed
        await clock.advance(1.0)
        assert len(mapping.woken) == woken  # not due yet
        mapping.deadline = clock.now() + 0.5  # nearer than the 1 s left
        timer.nearer()
        await settle()
        await clock.advance(0.5)
        assert mapping.woken[-1] == clock.now() and mapping.deadline is None
        count = len(mapping.woken)
        await clock.advance(60.0)
        assert len(mapping.woken) == count  # no deadline: no wake-ups
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())


@pytest.mark.parametrize("steps", range(8))
def test_a_cancelled_timer_ends_at_every_point_of_its_sleep(steps):
    """Cancelled `steps` loop rounds after its deadline passed (the sleep ending, its helpers being
    cancelled, the mapping acting, the next sleep starting): the task ends."""

    async def go():
        clock = ManualClock()
        mapping = Mapping(clock)
        task = asyncio.create_task(timer_for(mapping).run())
        mapping.deadline = clock.now() + 1.0
        await settle()
        await clock.advance(1.0, rounds=0)  # the deadline passes; the sleeper wakes on the next rounds
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=2.0)
        assert done, f"the timer did not end when cancelled {steps} rounds after its deadline"

    asyncio.run(go())
