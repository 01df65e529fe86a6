"""Backend benchmark: our overhead from a transcript to the first oracle token, and ASR partial lag.

    python scripts/bench_backend.py [--runs 20] [--llm-delay 0.2]

1. Planner + engine thread (tiny-copy) + a real scripted OpenAI-compatible server whose first
   token is held back `--llm-delay` s. For each run: t0 = the transcript reaches the planner;
   t_sent = its first oracle update is pushed to the engine slot; t_applied = the engine applied
   it (at the next frame boundary of a slot fed at real-time pace). Overhead = t_sent - t0 - the
   LLM's own delay (HTTP, SSE parsing, word re-chunking, tokenising).
2. ASR partial lag (real Whisper tiny.en, real-time feed of a spoken question): wall time from
   pushing the audio a partial covers (its end_s) to receiving the partial.
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
from kame.backend.planner import Planner
from kame.backend.profiles import BackendProfile
from kame.frontend.engine import FRAME_SIZE, BatchedEngine
from kame.frontend.loader import load_frontend
from kame.frontend.oracle import OracleOp
from kame.frontend.runner import EngineRunner
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--llm-delay", type=float, default=0.2)
    args = parser.parse_args()
    result = {"oracle": asyncio.run(oracle_overhead(args.runs, args.llm_delay)), "asr": asyncio.run(asr_lag())}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
