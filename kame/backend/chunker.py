"""Re-chunk a stream of LLM text deltas into whole words, as the oracle tokenizer needs them."""

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
