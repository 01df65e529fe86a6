"""Re-chunk a stream of LLM text deltas for the oracle: whole words (English), or each delta (Japanese:
no spaces to wait for; kame/backend/language.py)."""

from __future__ import annotations


class WordChunker:
    """Feed deltas with `push`; get back the words completed so far. `flush` returns the last one."""

    def __init__(self) -> None:
        self._partial = ""

    def push(self, delta: str) -> list[str]:
        text = self._partial + delta
        words = text.split()
        # the last word may go on in the next delta unless whitespace closed it
        self._partial = words.pop() if words and not text[-1].isspace() else ""
        return words

    def flush(self) -> list[str]:
        word, self._partial = self._partial, ""
        return [word] if word else []


class DeltaChunker:
    """Each delta as its own chunk, its surrounding spaces dropped (a language written without spaces)."""

    def push(self, delta: str) -> list[str]:
        chunk = delta.strip()
        return [chunk] if chunk else []

    def flush(self) -> list[str]:
        return []
