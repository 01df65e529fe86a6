"""How the end of a turn is decided, measured: questions spoken with a pause inside them, through the
whisper ASR with the silence rule and with Smart Turn (docs/turn-taking.md has the figures).

    python scripts/eot_sweep.py --ask-s 0.6 --tail-s 0.1 0.2 --out /tmp/eot.json

For each question and pause: how many finals it got (one: the whole question in one final), and how long
after the last word (audio time) its last final came. Needs the eval extra (piper) and pipecat-ai (turn).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

from kame.asr import FinalTranscript, build_asr
from kame.testing.pauses import paused_question, word_starts
from kame.testing.speech import speech

# (question, the word the user hesitates before: its 0-based index)
QUESTIONS = [
    ("What is the capital of Spain?", 5),
    ("How many legs does a spider have?", 5),
    ("Who wrote the play called Hamlet?", 5),
    ("Why is the sky blue during the day?", 3),
    ("I would like to know the tallest mountain in Europe.", 4),
    ("Can you tell me how far away the moon is?", 5),
    ("What is the best way to learn a new language?", 6),
    ("Could you explain how a rainbow forms?", 4),
    ("Which planet in our solar system is the largest?", 4),
    ("How long does it take to boil an egg?", 7),
    ("What year did the Second World War end?", 4),
    ("Tell me a fun fact about the ocean.", 6),
]
# questions with a comma: the voice pauses briefly there (~0.3 s), and nothing should end the turn
COMMA_QUESTIONS = [
    "What is the capital of France, and why is it so famous?",
    "If I leave at noon, when will I arrive in Boston?",
    "Before we start, can you tell me your name?",
    "My friend says the moon is made of cheese, is that true?",
    "Well, how many people live in Tokyo?",
    "When you boil water, why do bubbles form?",
]


async def finals_of(asr, pcm) -> list[FinalTranscript]:
    """The audio pushed in one piece: the stream's VAD and end-of-turn decisions are made chunk by chunk
    in audio time as always, and Whisper decodes only the finals (no partials: the sweep is quicker)."""
    stream = asr.open_stream()
    events = []

    async def collect() -> None:
        events.extend([e async for e in stream])

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(collect(), name="asr-events")
        stream.push_pcm(pcm)
        await stream.flush()
        await stream.aclose()
    return [e for e in events if isinstance(e, FinalTranscript)]


def measure(asr, question) -> dict:
    finals = asyncio.run(finals_of(asr, question.pcm))
    last = finals[-1] if finals else None
    # whole: one final for the whole question (Whisper tiny may still mishear a word of it)
    return {"finals": len(finals), "whole": len(finals) == 1,
            "texts": [f.text for f in finals],
            "after_end_s": None if last is None else round(last.end_s - question.speech_end_s, 3)}


def summary(rows: list[dict]) -> dict:
    late = [r["after_end_s"] for r in rows if r["after_end_s"] is not None]
    return {"n": len(rows), "finals_per_question": round(statistics.mean(r["finals"] for r in rows), 2),
            "whole_rate": round(sum(r["whole"] for r in rows) / len(rows), 2),
            "after_end_median_s": round(statistics.median(late), 2) if late else None,
            "after_end_max_s": round(max(late), 2) if late else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pauses", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--questions", type=int, default=len(QUESTIONS))
    parser.add_argument("--ask-s", type=float, nargs="+", default=[0.6], help="smart-turn's eot_ask_s values")
    parser.add_argument("--tail-s", type=float, nargs="+", default=[0.1], help="smart-turn's eot_tail_s values")
    parser.add_argument("--fallback-s", type=float, default=2.5)
    parser.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "kame-eot-tts"))
    parser.add_argument("--out", default=None, help="every row as JSON")
    args = parser.parse_args()

    configs = {"silence": {"end_of_turn": "silence"}}
    configs |= {f"smart-turn ask {a} tail {t}": {"end_of_turn": "smart-turn", "eot_ask_s": a, "eot_tail_s": t,
                                                 "eot_fallback_s": args.fallback_s}
                for a in args.ask_s for t in args.tail_s if t <= a}
    engines = {name: build_asr("whisper", options=opts) for name, opts in configs.items()}
    aligner = next(iter(engines.values())).model
    rows = []
    for text, word in QUESTIONS[: args.questions]:
        starts = word_starts(speech(text, args.cache), aligner)
        for pause in args.pauses:
            question = paused_question(text, word, pause, args.cache, aligner, starts=starts)
            for name, asr in engines.items():
                rows.append({"config": name, "pause_s": pause, "question": text, "before": question.before,
                             **measure(asr, question)})
                print(json.dumps(rows[-1]), flush=True)
    for text in COMMA_QUESTIONS[: args.questions]:
        question = paused_question(text, -1, 0.0, args.cache, aligner)
        for name, asr in engines.items():
            rows.append({"config": name, "pause_s": "comma", "question": text, **measure(asr, question)})
            print(json.dumps(rows[-1]), flush=True)
    print("\n| end of turn | pause | finals per question | whole-question rate | final after the end: median | max |")
    print("|---|---|---|---|---|---|")
    for name in configs:
        for pause in [*args.pauses, "comma"]:
            s = summary([r for r in rows if r["config"] == name and r["pause_s"] == pause])
            shown = pause if pause == "comma" else f"{pause:g} s"
            print(f"| {name} | {shown} | {s['finals_per_question']} | {s['whole_rate']} | "
                  f"{s['after_end_median_s']} s | {s['after_end_max_s']} s |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
