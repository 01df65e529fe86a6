"""The user's words on the wire while they speak (#44): real Whisper tiny.en on a spoken question, its
audio pushed as fast as it decodes (each decode at its interval of audio), so every time here is audio
time (a delta goes out when the audio up to its partial was heard), whatever the machine's speed.
Deltas as GPT-Live sends them (`StableWords`); the Realtime endpoint and /api/chat send every partial."""

from __future__ import annotations

import asyncio

import numpy as np

from kame.asr import FinalTranscript, PartialTranscript, build_asr
from kame.asr.transcribe import transcribe_pcm
from kame.testing.speech import speech
from server.stable_text import Keepalive, StableWords

from .conftest import words

QUESTION = ("Hi, I'm planning a trip to Japan next spring, and I'd love to see some old temples "
            "and eat some really good food.")
LEAD_S = 0.5


def spoken(tmp_path_factory) -> tuple[np.ndarray, float, float]:
    """The question with quiet around it, and when its speech starts and ends (by its loudness)."""
    pcm = speech(QUESTION, tmp_path_factory.mktemp("tts"))
    loud = np.flatnonzero(np.abs(pcm) > 0.02) / 24000
    audio = np.concatenate([np.zeros(int(24000 * LEAD_S), np.float32), pcm, np.zeros(24000 * 3, np.float32)])
    return audio, LEAD_S + loud[0], LEAD_S + loud[-1]


def deltas(events) -> list[tuple[float, str]]:
    """(audio time, delta) of each input-transcript delta a GPT-Live client gets: the words (`StableWords`)
    and, on the mapping's clock (here the audio's), the spaces that keep an open turn open (`Keepalive`)."""
    stable, keep, out = StableWords(), Keepalive(), []

    def emit(at: float, delta: str) -> None:
        out.append((at, delta))
        keep.sent(at, bool(delta.strip()), stable.open)

    for event in events:
        while (due := keep.due()) and due[0] <= event.end_s:
            if keep.fire(due[0], stable.open):
                emit(due[0], stable.space())
        final = isinstance(event, FinalTranscript)
        delta = stable.final(event.text) if final else stable.partial(event.text, event.settled)
        if delta:
            emit(event.end_s, delta)
        elif final:
            keep.sent(event.end_s, False, False)
    return out


def largest_gap(times: list[float], end: float) -> float:
    """The longest time between two deltas up to speech end and the next delta after it."""
    marks = [t for t in times if t <= end] + [t for t in times if t > end][:1]
    return max(b - a for a, b in zip(marks, marks[1:], strict=False))


def test_deltas_come_every_half_second_and_the_last_words_within_a_second(tmp_path_factory):
    audio, start, end = spoken(tmp_path_factory)
    events = asyncio.run(transcribe_pcm(build_asr("whisper", realtime=False), audio))
    sent = deltas(events)
    any_gap = largest_gap([t for t, _ in sent], end)
    word_gap = largest_gap([t for t, d in sent if d.strip()], end)
    last_words = max(t for t, d in sent if d.strip())
    settled = [e for e in events if isinstance(e, PartialTranscript) and e.settled and e.end_s > end]
    print(f"\ncadence (audio time, Whisper tiny.en every 0.3 s): speech {start:.2f}-{end:.2f} s, first words "
          f"{sent[0][0] - start:.2f} s in, largest gap {any_gap:.2f} s (words only {word_gap:.2f} s), "
          f"last words {last_words - end:.2f} s after the speech, settled partial {settled[0].end_s - end:.2f} s after")
    final = [e for e in events if isinstance(e, FinalTranscript)]
    last = [e for e in events if isinstance(e, PartialTranscript)][-1]
    assert len(final) == 1 and words("".join(d for _, d in sent)) == words(last.text)  # every word went out
    # the final decodes the whole utterance again: a fragment settled at a pause is heard in context (tiny.en
    # heard "Hi," alone as "All right."); the wire has the settled words already, the LLM reads the final
    assert len(words(final[0].text)) >= 18 and words(final[0].text)[-6:] == words(last.text)[-6:]
    assert sent[0][0] - start <= 0.8
    assert any_gap <= 0.5  # a client's user turn never sees a gap of 0.8 s
    assert word_gap <= 0.8  # words every two decodes at most
    assert last_words - end <= 1.0 and settled[0].end_s - end <= 1.0  # GPT-Live, Realtime and /api/chat alike
    assert final[0].end_s - end > 1.0  # ... though the turn itself ended later (the end-of-turn model)
