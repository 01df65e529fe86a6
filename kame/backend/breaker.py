"""A circuit breaker per backend profile: after repeated failures, fail fast for a cool-down
instead of hammering a dead endpoint (shared by every session that uses the profile)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from kame.backend.llm import ChatMessage, LLMClient, LLMError
from kame.clock import Clock, MonotonicClock

logger = logging.getLogger(__name__)

# failures that say the backend is unwell; a bad request or a missing key is ours to fix
THRESHOLD, COOLDOWN_S = 5, 30.0  # the defaults: failed attempts in a row that open it, for this long
_COUNTED = {"connection", "timeout", "server", "rate_limit", "protocol"}


class CircuitBreakerLLM:
    """Wraps an LLMClient. Closed: calls pass. `threshold` failed attempts in a row: open, every
    call fails at once for `cooldown_s`. Then half-open: one trial call; success closes it."""

    def __init__(self, inner: LLMClient, threshold: int = THRESHOLD, cooldown_s: float = COOLDOWN_S,
                 clock: Clock | None = None):
        self.inner, self.threshold, self.cooldown_s = inner, threshold, cooldown_s
        self.name = inner.name
        self.supports_tools = getattr(inner, "supports_tools", False)
        self.structured_output = getattr(inner, "structured_output", False)
        self.clock = clock or MonotonicClock()
        self.failures = 0
        self.opened_at: float | None = None
        self._trial_running = False

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half-open" if self.clock.now() - self.opened_at >= self.cooldown_s else "open"

    async def stream_chat(self, messages: list[ChatMessage], **options) -> AsyncIterator:
        state = self.state
        if state == "open" or (state == "half-open" and self._trial_running):
            remaining = max(0.0, self.cooldown_s - (self.clock.now() - (self.opened_at or 0.0)))
            raise LLMError("unavailable", f"{self.name}: circuit open after {self.failures} failures in a row; "
                           f"next try in {remaining:.0f} s", retry_after_s=remaining or self.cooldown_s)
        self._trial_running = state == "half-open"
        try:
            async for delta in self.inner.stream_chat(messages, **options):
                yield delta
        except LLMError as exc:
            if exc.kind in _COUNTED:
                self._failed()
            raise
        else:
            self.failures, self.opened_at = 0, None
        finally:
            self._trial_running = False

    def _failed(self) -> None:
        self.failures += 1
        if self.failures >= self.threshold:
            if self.opened_at is None or self.state == "half-open":
                logger.warning("backend %s: circuit open for %.0f s after %d failures in a row",
                               self.name, self.cooldown_s, self.failures)
            self.opened_at = self.clock.now()

    async def aclose(self) -> None:
        close = getattr(self.inner, "aclose", None)
        if close is not None:
            await close()

    def __getattr__(self, name: str):  # wait_ready etc. of the wrapped client
        return getattr(self.inner, name)
