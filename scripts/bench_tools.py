"""Tool-call benchmark: what a tool round trip adds to the answer's latency, against the oracle lead.

    python scripts/bench_tools.py [--json]

The planner on the real clock with the real `openai` client against the scripted
OpenAI-compatible HTTP server, and a real python tool (`kame.tools.PythonTool`) that takes
`tool latency` seconds. The user speaks a 16-word question: a partial growing by 2 words every
0.5 s, then the final at 4.0 s. The LLM's first chunk comes `LLM first token` s after each
request, then a word every 50 ms. Modes:

- direct: the LLM answers at once (no tools);
- tool: the LLM first calls the tool (no text), then answers from its result (a second request:
  another first-token wait);
- tool + filler: the same, but it says "Let me check." before the call (spoken while the tool runs).

Lead = the final's time minus the time the reset of the oracle in place was sent, once the
final's attempt has answered (positive: the answer's guidance was in place before the user
stopped). "Answered after final" = the final's attempt finished, minus the final's time. "Tool
runs" = calls really run (the rest of the attempts' calls came from the turn's cache). The
markdown table goes to stderr, the JSON to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kame.asr.events import FinalTranscript, PartialTranscript
from kame.backend.llm import OpenAICompatibleLLM
from kame.backend.planner import Planner
from kame.backend.profiles import BackendProfile
from kame.frontend.oracle import OracleOp
from kame.testing.openai_server import ScriptedOpenAIServer, ScriptedReply, ScriptedToolCall, last_tool_results
from kame.tools import ToolBox
from kame.tools.python_tool import PythonTool

QUESTION_TEXT = "how many legs does a spider have and do all of the spiders in my garden have the same"
QUESTION = QUESTION_TEXT.split()
EVERY_S = 0.5
ANSWER = "Spiders have eight legs, all of them, the ones in your garden too."
WORD_S = 0.05
LATENCIES_S = (0.3, 0.8)
TOOL_LATENCIES_S = (0.2, 1.0)
MODES = ("direct", "tool", "tool + filler")


class _OneTokenPerWord:
    def encode(self, text: str) -> list[int]:
        return [len(text)]

    def id_to_piece(self, token: int) -> str:
        return "▁"


def script(body: dict) -> ScriptedReply:
    """The run's mode and delays ride in the model name: "mode|first token s"."""
    mode, delay = body["model"].split("|")
    timing = {"first_token_delay_s": float(delay), "token_delay_s": WORD_S / 3}  # ~3 chunks a word
    if mode == "direct" or last_tool_results(body):
        return ScriptedReply(text=ANSWER, **timing)
    filler = "Let me check. " if mode == "tool + filler" else ""
    return ScriptedReply(text=filler, tool_calls=(ScriptedToolCall("legs", {"animal": "spider"}),), **timing)


async def run_one(base_url: str, mode: str, latency_s: float, tool_s: float) -> dict:
    runs = []

    async def legs(animal: str) -> str:
        """How many legs an animal has."""
        runs.append(time.monotonic())
        await asyncio.sleep(tool_s)
        return "eight"

    llm = OpenAICompatibleLLM(BackendProfile("bench", base_url, f"{mode}|{latency_s}", None, max_tokens=60,
                                             first_token_timeout_s=10))
    t0 = time.monotonic()
    resets: dict[int, float] = {}

    def send_oracle(update) -> None:
        if update.op is OracleOp.RESET:
            resets.setdefault(update.epoch, time.monotonic() - t0)

    tools = ToolBox.of([PythonTool("legs", legs)]) if mode != "direct" else ToolBox()
    planner = Planner(llm, _OneTokenPerWord(), send_oracle, tools=tools)
    for index in range(len(QUESTION) // 2):
        await asyncio.sleep(max(0.0, t0 + EVERY_S * index - time.monotonic()))
        planner.on_transcript(PartialTranscript(" ".join(QUESTION[:2 * index + 2]), 0.0, time.monotonic() - t0))
    await asyncio.sleep(max(0.0, t0 + EVERY_S * (len(QUESTION) // 2) - time.monotonic()))
    final_at = time.monotonic() - t0
    planner.on_transcript(FinalTranscript(" ".join(QUESTION), 0.0, final_at))
    final = planner.attempts[-1]  # the planner's own record: it goes on changing
    while final.status == "running":
        await asyncio.sleep(0.01)
        if time.monotonic() - t0 > final_at + 30:
            raise RuntimeError("the final's attempt never answered")
    in_place = planner.oracle_epoch
    await planner.aclose()
    await llm.aclose()
    return {"mode": mode, "llm_first_token_s": latency_s, "tool_latency_s": tool_s if mode != "direct" else None,
            "lead_s": round(final_at - resets[in_place], 2), "first_oracle_s": round(min(resets.values()), 2),
            "answered_after_final_s": round(final.finished_at - t0 - final_at, 2), "final": final.status,
            "attempts": len(planner.attempts), "tool_runs": len(runs)}


async def bench() -> list[dict]:
    cases = [(mode, latency, tool) for latency in LATENCIES_S for tool in TOOL_LATENCIES_S for mode in MODES
             if mode != "direct" or tool == TOOL_LATENCIES_S[0]]
    async with ScriptedOpenAIServer(script) as server:
        return list(await asyncio.gather(*(run_one(server.base_url, *case) for case in cases)))


def table(rows: list[dict]) -> str:
    head = ["LLM first token (s)", "mode", "tool latency (s)", "lead (s)", "first oracle (s)",
            "answered after final (s)", "attempts", "tool runs"]
    keys = ["llm_first_token_s", "mode", "tool_latency_s", "lead_s", "first_oracle_s", "answered_after_final_s",
            "attempts", "tool_runs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join("-" if row[k] is None else str(row[k]) for k in keys) + " |" for row in rows]
    return "\n".join(lines)


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    rows = asyncio.run(bench())
    print(table(rows), file=sys.stderr)
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
