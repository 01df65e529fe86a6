"""What a call's audio path (server/phone/line.py) does to the caller's words, offline: the robustness
questions (4, in 3 voices) through the line's codec alone, through the codec and the telephone echo canceller
with silence going down the line, and with the assistant's voice going down the line the whole time but no
echo of it on the line (a headset, or a phone that cancels its own echo). Whisper tiny.en, not in real time.

    python scripts/phone_line_check.py            # about a minute here

docs/evaluation.md ("The phone path") has the figures.
"""

from __future__ import annotations

import asyncio
import difflib
import tempfile

import numpy as np

from kame.aec import EchoOptions
from kame.asr import build_asr
from kame.asr.events import FinalTranscript
from kame.asr.transcribe import transcribe_pcm
from kame.audio import FRAME_SIZE
from kame.eval.conditions import Voices, clean, words
from kame.eval.robustness import load_questions
from kame.eval.voices import ASSISTANT_VOICE, DEFAULT_VOICES, voice
from server.phone.line import PhoneLine

ASSISTANT_SAYS = "Let me think about that for a moment, I will tell you what I know about it right away."


def through(line: PhoneLine, pcm: np.ndarray, played: np.ndarray | None) -> np.ndarray:
    frames = -(-len(pcm) // FRAME_SIZE)
    pcm = np.pad(pcm, (0, frames * FRAME_SIZE - len(pcm)))
    played = np.zeros_like(pcm) if played is None else np.resize(played, len(pcm)).astype(np.float32)
    return np.concatenate([line.process_input(pcm[i * FRAME_SIZE:(i + 1) * FRAME_SIZE],
                                              played[i * FRAME_SIZE:(i + 1) * FRAME_SIZE]) for i in range(frames)])


def edits(reference: str, heard: str) -> tuple[int, int]:
    ref, hyp = words(reference), words(heard)
    ops = difflib.SequenceMatcher(a=ref, b=hyp).get_opcodes()
    return sum(max(i2 - i1, j2 - j1) for op, i1, i2, j1, j2 in ops if op != "equal"), len(ref)


async def main() -> None:
    asr = build_asr("whisper", realtime=False)
    cache = tempfile.mkdtemp(prefix="phone-line-check-")
    assistant = voice(ASSISTANT_VOICE).speaker(cache)(ASSISTANT_SAYS)
    ways = (("the codec alone", lambda: PhoneLine(echo=EchoOptions(telephone=False)), None),
            ("the codec and the canceller, silence down the line", PhoneLine, None),
            ("the codec and the canceller, the assistant down the line, no echo", PhoneLine, assistant))
    totals = {name: [0, 0] for name, _, _ in ways}
    for name in DEFAULT_VOICES:
        speak = voice(name).speaker(cache)
        for question in load_questions(4):
            asked = clean(question, Voices(speak, speak))
            pcm = np.concatenate([np.zeros(3 * FRAME_SIZE, np.float32), asked.pcm,
                                  np.zeros(10 * FRAME_SIZE, np.float32)])
            for way, line, played in ways:
                events = await transcribe_pcm(asr, through(line(), pcm, played))
                heard = " ".join(e.text for e in events if isinstance(e, FinalTranscript))
                wrong, count = edits(asked.reference, heard)
                totals[way][0] += wrong
                totals[way][1] += count
                print(f"{name:10} {way}: {heard}")
    for way, (wrong, count) in totals.items():
        print(f"WER {100 * wrong / count:5.1f} % ({wrong}/{count} words): {way}")


if __name__ == "__main__":
    asyncio.run(main())
