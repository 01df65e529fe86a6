"""Injectable time: the real monotonic clock, or a manual one that tests advance by hand."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale."""

    async def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class ManualClock:
    """Time stands still until `advance`; sleepers wake when their deadline is passed."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._sleepers: list[tuple[float, asyncio.Future]] = []

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future = asyncio.get_running_loop().create_future()
        self._sleepers.append((self._now + seconds, future))
        await future

    async def advance(self, seconds: float, rounds: int = 20) -> None:
        """Move time on, wake the sleepers it passed, then let the loop run `rounds` rounds (0: the
        woken run later, for a test that steps the loop itself)."""
        self._now += seconds
        due = [f for t, f in self._sleepers if t <= self._now]
        self._sleepers = [(t, f) for t, f in self._sleepers if t > self._now]
        for future in due:
            if not future.done():
                future.set_result(None)
        await settle(rounds)


async def wait_for(clock: Clock, future: asyncio.Future, seconds: float):
    """`future`'s result, or TimeoutError once `seconds` of `clock`'s time have passed (`asyncio.wait_for`
    on a session's clock: a test's manual clock decides when a wait is over). The future is cancelled
    when this wait is given up."""
    timer = asyncio.ensure_future(clock.sleep(seconds))
    try:
        await asyncio.wait((future, timer), return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
        if not future.done():
            future.cancel()
    if future.done() and not future.cancelled():
        return future.result()
    raise TimeoutError


async def settle(rounds: int = 20) -> None:
    """Let every ready task run until the loop is quiet (a few rounds of the event loop)."""
    for _ in range(rounds):
        await asyncio.sleep(0)
