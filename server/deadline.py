"""One timer for a protocol mapping: it sleeps on the session's clock until the mapping's next
deadline (`wake_at()`), is woken sooner when a deadline comes nearer (`nearer(at)`), and then lets
the mapping act on the time (`on_time(now)`). No polling: a mapping with no deadline sleeps until
one appears. Used by the Realtime and GPT-Live adapters."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kame.clock import Clock

logger = logging.getLogger(__name__)

STUCK_ROUNDS = 100  # rounds in a row whose deadline is already past: a bug, not a busy loop


class DeadlineTimer:
    def __init__(self, clock: Clock, wake_at: Callable[[], float | None], on_time: Callable[[float], None],
                 name: str) -> None:
        self.clock, self._wake_at, self._on_time, self.name = clock, wake_at, on_time, name
        self._rearm = asyncio.Event()
        self._armed: float | None = None

    def nearer(self) -> None:
        """Call after the mapping changed: the timer wakes now if its deadline came nearer."""
        at = self._wake_at()
        if at is not None and (self._armed is None or at < self._armed):
            self._rearm.set()

    async def run(self) -> None:
        past = 0
        while True:
            self._rearm.clear()
            self._armed = at = self._wake_at()
            delay = None if at is None else at - self.clock.now()
            if delay is None or delay > 0:
                past = 0
                await self._sleep_or_rearm(delay)
            else:
                past += 1
                if past > STUCK_ROUNDS:
                    logger.error("%s: the mapping's deadline stays in the past", self.name)
                    await self.clock.sleep(0.08)
            self._on_time(self.clock.now())

    async def _sleep_or_rearm(self, delay: float | None) -> None:
        waits = [asyncio.ensure_future(self._rearm.wait())]
        if delay is not None:
            waits.append(asyncio.ensure_future(self.clock.sleep(delay)))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left = [wait for wait in waits if not wait.done()]
            for wait in left:
                wait.cancel()
            if left:  # `asyncio.wait` raises nothing of theirs: only this task's own cancellation goes on
                await asyncio.wait(left)
