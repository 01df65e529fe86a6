"""Client delegation: the GPT-Live client is the backend. The planner runs as always (it starts an
attempt as the user's words grow, overlapping attempts, the newest with words owns the oracle), but
an attempt calls no LLM: it becomes a `session.delegation.created`, and the client's
`session.commentary.append` for that delegation is the attempt's answer, word for word.

So the first commentary of a delegation resets the oracle (the attempt takes it over, as an LLM
stream's first words do) and later ones append; a delegation that a newer one superseded is
cancelled and what the client still sends for it is dropped by epoch, as a late LLM stream's words
are. A delegation ends (done) once `idle_s` passes after its last commentary with no more.
"""

from __future__ import annotations

import asyncio
import collections
import uuid
from collections.abc import AsyncIterator, Callable

from kame.clock import Clock

DONE = object()  # the delegation's queue: no more commentary
MAX_REMEMBERED = 256  # ended delegations whose late commentary is acknowledged, not refused


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


class ClientBackend:
    """The `LLMClient` of a client-delegation session: each `stream_chat` is a delegation."""

    supports_tools = False

    def __init__(self, clock: Clock, on_created: Callable[[str], None], name: str = "client",
                 idle_s: float = 2.0) -> None:
        self.name, self.clock, self.idle_s = name, clock, idle_s
        self._on_created = on_created
        self._open: dict[str, asyncio.Queue] = {}  # delegations waiting for or streaming commentary
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._general: list[str] = []  # commentary for no delegation, while none was open

    def known(self, delegation_id: str) -> bool:
        return delegation_id in self._open or delegation_id in self._ended

    def commentary(self, delegation_id: str | None, text: str) -> bool:
        """The client's speakable text: for its delegation, or (None) for the newest open one.
        False when it went nowhere yet (no delegation open): the next delegation starts with it."""
        if delegation_id is None:
            if not self._open:
                self._general.append(text)
                return False
            delegation_id = next(reversed(self._open))
        queue = self._open.get(delegation_id)
        if queue is not None:
            queue.put_nowait(text)
        return True  # an ended delegation's: dropped, as a superseded LLM stream's words are

    async def stream_chat(self, messages, tools=None, tool_choice=None) -> AsyncIterator[str]:
        delegation_id = new_id("deleg")
        queue: asyncio.Queue = asyncio.Queue()
        for text in self._general:
            queue.put_nowait(text)
        self._general.clear()
        self._open[delegation_id] = queue
        try:
            self._on_created(delegation_id)
            first = await queue.get()  # a delegation waits for its first words as long as the planner lets it
            while first is not DONE:
                yield " ".join(first.split()) + " "  # a commentary is whole words: none waits for the next
                first = await self._next(queue)
        finally:
            del self._open[delegation_id]
            self._ended[delegation_id] = None
            while len(self._ended) > MAX_REMEMBERED:
                self._ended.popitem(last=False)

    async def _next(self, queue: asyncio.Queue):
        """The next commentary, or DONE when `idle_s` of the session's clock passes without one."""
        getter = asyncio.ensure_future(queue.get())
        timer = asyncio.ensure_future(self.clock.sleep(self.idle_s))
        try:
            await asyncio.wait([getter, timer], return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()
            if not getter.done():
                getter.cancel()
        return getter.result() if getter.done() and not getter.cancelled() else DONE
