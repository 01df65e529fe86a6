"""Backend benchmark: our overhead from a transcript to the first oracle token, ASR partial lag, and
the oracle lead of the planner's stream policy.

    python scripts/bench_backend.py [--runs 20] [--llm-delay 0.2] [--only {oracle,asr,lead}] [--lead-real-clock]

1. Planner + engine thread (tiny-copy) + a real scripted OpenAI-compatible server whose first
   token is held back `--llm-delay` s. For each run: t0 = the transcript reaches the planner;
   t_sent = its first oracle update is pushed to the engine slot; t_applied = the engine applied
   it (at the next frame boundary of a slot fed at real-time pace). Overhead = t_sent - t0 - the
   LLM's own delay (HTTP, SSE parsing, word re-chunking, tokenising).
2. ASR partial lag (real Whisper tiny.en, real-time feed of a spoken question): wall time from
   pushing the audio a partial covers (its end_s) to receiving the partial.
3. Oracle lead (the planner alone, a scripted LLM, on a manual clock: simulated seconds, exact
   and instant; `--lead-real-clock` runs the same on the real clock). The user speaks an 8 s
   question: a partial growing by 2 words every 0.5 s, then the final at 8 s. The LLM's first
   word comes after 0.3, 0.8 or 1.5 s, then a word every 50 ms. Lead = the final's time minus
   the time of the reset of the oracle in place once the final's stream has answered: positive,
   the answer was in place before the user stopped. Policies: overlapping streams with and
   without `keep_agreeing_oracle`, and the old cancel-on-restart (`max_concurrent_streams=1`,
   no keeping: exactly the first version's behaviour); every stream gives the same answer, or
   each a different one. The markdown table goes to stderr, the JSON to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kame.asr.events import FinalTranscript, PartialTranscript
from kame.backend.llm import OpenAICompatibleLLM
from kame.backend.planner import AttemptRecord, Planner, PlannerConfig
from kame.backend.profiles import BackendProfile
from kame.clock import Clock, ManualClock, MonotonicClock, settle
from kame.frontend.engine import FRAME_SIZE, BatchedEngine
from kame.frontend.loader import load_frontend
from kame.frontend.oracle import OracleOp
from kame.frontend.runner import EngineRunner
from kame.testing.fakes import FakeLLM, FakeReply
from kame.testing.openai_server import ScriptedOpenAIServer, ScriptedReply


async def oracle_overhead(runs: int, llm_delay: float) -> dict:
    frontend = load_frontend("tiny-copy", "cpu")
    engine = BatchedEngine(frontend, 1)
    runner = EngineRunner(engine, batch_window_s=0.0).start()
    loop = asyncio.get_running_loop()
    applied: dict[int, float] = {}
    got_one = asyncio.Event()

    def record_applied(epoch: int, at: float) -> None:
        applied.setdefault(epoch, at)
        got_one.set()

    def on_output(out) -> None:
        now = time.perf_counter()
        for a in out.applied:
            if a.update.op is OracleOp.RESET:
                loop.call_soon_threadsafe(record_applied, a.update.epoch, now)

    handle = await runner.acquire_async(on_output)
    sent: dict[int, float] = {}

    def send_oracle(update) -> None:
        if update.op is OracleOp.RESET:
            sent.setdefault(update.epoch, time.perf_counter())
        handle.push_oracle(update)

    async def pump() -> None:  # the slot's audio, at real-time pace
        silence = np.zeros(FRAME_SIZE, np.float32)
        while True:
            handle.push_frame(silence)
            await asyncio.sleep(FRAME_SIZE / 24000)

    rows = []
    async with ScriptedOpenAIServer(default=ScriptedReply(text="Paris is the capital of France.",
                                                          first_token_delay_s=llm_delay)) as server:
        llm = OpenAICompatibleLLM(BackendProfile("bench", server.base_url, "m", None))
        planner = Planner(llm, frontend.tokenizer, send_oracle)
        pumping = asyncio.create_task(pump())
        for run in range(runs + 2):
            await asyncio.sleep(0.5)
            t0 = time.perf_counter()
            planner.on_transcript(FinalTranscript(f"what is the capital of France {run}", 0.0, 1.0))
            epoch = planner.epoch
            while epoch not in applied:
                got_one.clear()
                await got_one.wait()
            if run >= 2:  # two warm-up runs (connection set-up, first tokenisation)
                rows.append((sent[epoch] - t0 - llm_delay, applied[epoch] - sent[epoch]))
        pumping.cancel()
        await planner.aclose()
        await llm.aclose()
    handle.release()
    runner.stop()
    engine.close()
    overhead = sorted(r[0] * 1000 for r in rows)
    wait = sorted(r[1] * 1000 for r in rows)
    return {"runs": runs, "llm_first_token_delay_ms": llm_delay * 1000,
            "overhead_ms": {"p50": round(statistics.median(overhead), 2), "max": round(overhead[-1], 2)},
            "frame_wait_ms": {"p50": round(statistics.median(wait), 2), "max": round(wait[-1], 2)}}


async def asr_lag() -> dict:
    from kame.asr.whisper import WhisperAsr, WhisperOptions
    from kame.testing.speech import speech

    pcm = speech("What is the capital of France, and why is it so famous?", Path.home() / ".cache" / "kame-tts")
    pcm = np.concatenate([np.zeros(12000, np.float32), pcm, np.zeros(24000, np.float32)])
    asr = WhisperAsr(WhisperOptions())
    stream = asr.open_stream()
    pushed: list[tuple[float, float]] = []  # (audio seconds pushed so far, wall time)
    lags = []

    async def collect() -> None:
        async for event in stream:
            if isinstance(event, PartialTranscript):
                at = next(w for a, w in pushed if a >= event.end_s - 1e-6)
                lags.append((time.perf_counter() - at) * 1000)

    task = asyncio.create_task(collect())
    started = time.perf_counter()
    for index in range(0, len(pcm), FRAME_SIZE):
        stream.push_pcm(pcm[index:index + FRAME_SIZE])
        pushed.append(((index + FRAME_SIZE) / 24000, time.perf_counter()))
        await asyncio.sleep(max(0.0, started + (index + FRAME_SIZE) / 24000 - time.perf_counter()))
    await stream.flush()
    await stream.aclose()
    await task
    asr.close()
    return {"partials": len(lags), "lag_ms": {"p50": round(statistics.median(lags), 1), "max": round(max(lags), 1)}}


LEAD_LATENCIES_S = (0.3, 0.8, 1.5)
LEAD_POLICIES = {
    "overlap, keep agreeing": PlannerConfig(),
    "overlap, always reset": PlannerConfig(keep_agreeing_oracle=False),
    "cancel on restart (old)": PlannerConfig(max_concurrent_streams=1, keep_agreeing_oracle=False),
}
LEAD_QUESTION_TEXT = ("so I was wondering what the capital of France is and why so many people keep calling it "
                      "the city of light when other cities have plenty of lights too you know")
LEAD_QUESTION = LEAD_QUESTION_TEXT.split()  # 32 words: 16 partials, 0 to 7.5 s, the final at 8 s
LEAD_ANSWER = ("Paris is the capital of France, and it is called the city of light because it was among the "
               "first cities to light its streets and a centre of ideas.")
LEAD_EVERY_S = 0.5  # a partial this often, 2 more words each time
LEAD_WORD_S = 0.05  # the LLM's pace after its first word
LEAD_STEP_S = 0.01  # manual-clock resolution


class _OneTokenPerWord:
    """The planner needs a tokenizer; timing does not depend on which."""

    def encode(self, text: str) -> list[int]:
        return [len(text)]

    def id_to_piece(self, token: int) -> str:
        return "▁"


async def oracle_lead_run(latency_s: float, config: PlannerConfig, same_answer: bool, real_clock: bool) -> dict:
    clock: Clock = MonotonicClock() if real_clock else ManualClock()
    t0 = clock.now()
    answers = [LEAD_ANSWER if same_answer else f"take{k} {LEAD_ANSWER}" for k in range(40)]
    llm = FakeLLM([FakeReply.of_words(a, latency_s, LEAD_WORD_S) for a in answers], clock)
    resets: dict[int, float] = {}  # epoch -> when its reset was sent (seconds since the question began)

    def send_oracle(update) -> None:
        if update.op is OracleOp.RESET:
            resets.setdefault(update.epoch, clock.now() - t0)

    planner = Planner(llm, _OneTokenPerWord(), send_oracle, config=config, clock=clock)
    most_running = 0

    async def until(t: float) -> None:  # let time pass to t0 + t, watching how many streams run
        nonlocal most_running
        while clock.now() - t0 < t - 1e-9:
            if isinstance(clock, ManualClock):  # runs a millionth fast: float deadlines fall due on their step
                step = min(LEAD_STEP_S, t - (clock.now() - t0))
                await clock.advance(step * (1 + 1e-6))
            else:
                await asyncio.sleep(min(LEAD_STEP_S, t0 + t - clock.now()))
            most_running = max(most_running, len(planner.running_streams))

    for index in range(len(LEAD_QUESTION) // 2):
        await until(LEAD_EVERY_S * index)
        text = " ".join(LEAD_QUESTION[:2 * index + 2])
        planner.on_transcript(PartialTranscript(text, 0.0, clock.now() - t0))
        await settle()  # the new stream starts its request now, not at the next step
    await until(LEAD_EVERY_S * (len(LEAD_QUESTION) // 2))
    final_at = clock.now() - t0
    planner.on_transcript(FinalTranscript(" ".join(LEAD_QUESTION), 0.0, final_at))
    await settle()

    def final_stream() -> AttemptRecord | None:  # the final's stream (or its deferred start)
        return next((r for r in planner.attempts if r.requested_at - t0 >= final_at - 1e-9), None)

    while (record := final_stream()) is None or record.status == "running":
        await until(clock.now() - t0 + LEAD_STEP_S)
        if clock.now() - t0 > final_at + 30:
            raise RuntimeError("the final's stream never answered")
    in_place = planner.oracle_epoch
    await planner.aclose()
    return {"lead_s": round(final_at - resets[in_place], 2), "first_oracle_s": round(min(resets.values()), 2),
            "resets": len(resets), "max_streams": most_running, "llm_calls": len(llm.calls),
            "final_stream": record.status}


async def oracle_lead(real_clock: bool) -> list[dict]:
    runs = [(latency, policy, same)
            for latency in LEAD_LATENCIES_S for same in (True, False) for policy in LEAD_POLICIES]
    results = await asyncio.gather(*(oracle_lead_run(latency, LEAD_POLICIES[policy], same, real_clock)
                                     for latency, policy, same in runs))  # independent: on the real clock too
    return [{"llm_first_token_s": latency, "policy": policy, "answers": "same" if same else "differ", **result}
            for (latency, policy, same), result in zip(runs, results, strict=True)]


def lead_table(rows: list[dict], real_clock: bool) -> str:
    head = ["LLM first token (s)", "answers", "policy", "lead (s)", "first oracle (s)", "resets", "max streams",
            "LLM calls"]
    keys = ["llm_first_token_s", "answers", "policy", "lead_s", "first_oracle_s", "resets", "max_streams", "llm_calls"]
    lines = [f"oracle lead ({'real' if real_clock else 'manual'} clock; final at "
             f"{LEAD_EVERY_S * (len(LEAD_QUESTION) // 2):.1f} s; lead > 0: in place before the user stopped)",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(row[k]) for k in keys) + " |" for row in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--llm-delay", type=float, default=0.2)
    parser.add_argument("--only", choices=["oracle", "asr", "lead"], help="run only this section")
    parser.add_argument("--lead-real-clock", action="store_true", help="the oracle-lead section on the real clock")
    args = parser.parse_args()
    result = {}
    if args.only in (None, "oracle"):
        result["oracle"] = asyncio.run(oracle_overhead(args.runs, args.llm_delay))
    if args.only in (None, "asr"):
        result["asr"] = asyncio.run(asr_lag())
    if args.only in (None, "lead"):
        result["lead"] = asyncio.run(oracle_lead(args.lead_real_clock))
        print(lead_table(result["lead"], args.lead_real_clock), file=sys.stderr)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
