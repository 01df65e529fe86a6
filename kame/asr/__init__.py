"""Streaming ASR engines (whisper, kyutai-stt, none) behind one contract (`events.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import numpy as np

from kame.asr.events import (
    AsrEngine,
    AsrFailure,
    FinalTranscript,
    PartialTranscript,
    TranscriptEvent,
    TranscriptStream,
)
from kame.errors import KameError

ASR_ENGINES = ("whisper", "kyutai-stt", "none")
DEFAULT_MODELS = {"whisper": "tiny.en", "kyutai-stt": "kyutai/stt-1b-en_fr", "none": ""}

__all__ = [
    "ASR_ENGINES", "AsrEngine", "AsrFailure", "FinalTranscript", "NoAsr", "PartialTranscript",
    "TranscriptEvent", "TranscriptStream", "build_asr", "hears", "open_stream_in",
]
LANGUAGE_NAMES = {"en": "English", "fr": "French", "ja": "Japanese"}


def hears(asr: AsrEngine, language: str) -> str | None:
    """None when `asr` can transcribe `language`; else why not, for a clear error. An engine says what it
    hears with `languages` (None or absent: any; an English-only Whisper: en only)."""
    languages = getattr(asr, "languages", None)
    if languages is None or language in languages:
        return None
    named = ", ".join(LANGUAGE_NAMES.get(code, code) for code in languages)
    model = getattr(getattr(asr, "options", None), "model", "") or ""
    fix = (" a multilingual Whisper hears it (asr_model = \"small\", or \"large-v3\" on a GPU)" if asr.name == "whisper"
           else " a multilingual Whisper hears it (asr = \"whisper\", asr_model = \"small\")")
    return (f"the ASR ({asr.name} {model}".rstrip() + f") hears {named} only, not "
            f"{LANGUAGE_NAMES.get(language, language)}:{fix}")


def open_stream_in(asr: AsrEngine, language: str) -> TranscriptStream:
    """A stream of `asr` that hears `language` (engines that detect the language themselves take none)."""
    if getattr(asr, "per_stream_language", False):
        return asr.open_stream(language=language)  # type: ignore[call-arg]
    return asr.open_stream()


class NoAsr:
    """No ASR: the front-end alone, i.e. plain Moshi (the baseline). Streams never emit."""

    name = "none"

    def open_stream(self) -> _SilentStream:
        return _SilentStream()

    def warm_up(self) -> None:
        pass

    def close(self) -> None:
        pass


class _SilentStream:
    def __init__(self) -> None:
        self._closed = asyncio.Event()

    def push_pcm(self, pcm: np.ndarray) -> None:
        pass

    async def flush(self) -> None:
        pass

    async def aclose(self) -> None:
        self._closed.set()

    async def __aiter__(self) -> AsyncIterator[TranscriptEvent]:
        await self._closed.wait()
        return
        yield  # an async generator that ends when the stream is closed


def build_asr(engine: str, model: str | None = None, device: str = "auto", max_sessions: int = 8,
              realtime: bool = True, options: Mapping | None = None) -> AsrEngine:
    """Load the named ASR engine (`model` defaults per engine, see DEFAULT_MODELS).

    `realtime=False` is for files pushed faster than real time: whisper then decodes at every
    interval of audio instead of once its backlog is drained, so partials still appear.
    `options`: more fields of the engine's options (WhisperOptions, SttOptions), by name.
    """
    options = dict(options or {})
    if engine == "none":
        return NoAsr()
    if engine == "whisper":
        from kame.asr.whisper import WhisperAsr, WhisperOptions

        return WhisperAsr(WhisperOptions(model=model or DEFAULT_MODELS["whisper"], device=device, coalesce=realtime,
                                         **options))
    if engine == "kyutai-stt":
        from kame.asr.kyutai_stt import KyutaiSttAsr, SttOptions

        return KyutaiSttAsr(SttOptions(model=model or DEFAULT_MODELS["kyutai-stt"], device=device,
                                       max_sessions=max_sessions, **options))
    raise KameError(f"unknown ASR engine {engine!r}; choose one of {', '.join(ASR_ENGINES)}")
