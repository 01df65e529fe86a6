"""One thread for every session's Opus decoding and encoding, off the event loop.

A single worker keeps each session's packets in order (a decoder and an encoder hold stream
state); at 16 sessions Opus costs a few percent of a core (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class CodecThread:
    def __init__(self) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kame-codec")

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
