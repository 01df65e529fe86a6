"""`kame eval mtbench`: spoken MT-Bench through a running server, judged by an LLM.

Each question is spoken (piper TTS, cached by text hash), streamed to the server in every mode
(front-end alone, the tandem with each LLM profile, oracle delays), the assistant's audio is
transcribed with the project's ASR and graded by an LLM judge. Results go to a JSON file after
every item (a rerun skips what is done), then a Markdown report and a plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path

from tqdm import tqdm

from client.conversation import converse
from kame.errors import KameError

logger = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    evaluate = sub.add_parser("eval", help="evaluations")
    evals = evaluate.add_subparsers(dest="eval", required=True)
    mt = evals.add_parser("mtbench", help="spoken MT-Bench against a running server")
    mt.add_argument("--url", default="ws://127.0.0.1:8998/api/chat")
    mt.add_argument("--out", default="eval-out", help="folder for results.json, report.md, plot (default eval-out)")
    mt.add_argument("--categories", default="reasoning,stem,humanities")
    mt.add_argument("--limit", type=int, default=None, help="first N questions only")
    mt.add_argument("--profiles", default=None,
                    help="comma list of the server's LLM profiles to compare (default: the server's default)")
    mt.add_argument("--no-baseline", action="store_true", help="skip the front-end alone (Moshi) mode")
    mt.add_argument("--delays", default="", help="oracle delay sweep in seconds, e.g. 0,0.5,1,2")
    mt.add_argument("--fast", action="store_true", help="stream as fast as the server answers")
    mt.add_argument("--tail", type=float, default=10.0, help="seconds of silence after a question (default 10)")
    mt.add_argument("--judge-base-url", required=True, help="OpenAI-compatible endpoint of the judge")
    mt.add_argument("--judge-model", default="gpt-4.1")
    mt.add_argument("--judge-api-key-env", default="OPENAI_API_KEY")
    mt.add_argument("--judge-retries", type=int, default=2, help="re-asks for an unparseable judgement")
    mt.add_argument("--asr-model", default="tiny.en", help="Whisper model transcribing the assistant")
    mt.set_defaults(func=run_mtbench)


def modes_for(args: argparse.Namespace) -> list[dict]:
    profiles = [p for p in (args.profiles or "").split(",") if p] or [None]
    modes = [] if args.no_baseline else [{"mode": "moshi (front-end alone)", "options": {"asr": "off"}}]
    modes += [{"mode": f"tandem {p or 'default'}", "backend": p, "options": {}} for p in profiles]
    for delay in [float(d) for d in args.delays.split(",") if d.strip()]:
        modes.append({"mode": f"tandem {profiles[0] or 'default'} +{delay:g}s", "backend": profiles[0],
                      "options": {"oracle_delay": delay}, "delay_s": delay})
    return modes


async def judge(llm, question: str, answer: str, retries: int) -> tuple[float | None, list[str]]:
    from kame.backend.llm import ChatMessage, LLMError
    from kame.eval.mtbench import judge_messages, parse_rating

    judgements = []
    for _ in range(retries + 1):
        try:
            text = "".join([d async for d in llm.stream_chat([ChatMessage(r, c) for r, c in
                                                               judge_messages(question, answer)])])
        except LLMError as exc:
            judgements.append(f"(judge failed: {exc})")
            continue
        judgements.append(text)
        score = parse_rating(text)
        if score is not None:
            return score, judgements
    return None, judgements  # counted as missing, never as a number


async def evaluate(args: argparse.Namespace) -> Path:
    from kame.asr import build_asr
    from kame.asr.events import FinalTranscript
    from kame.asr.transcribe import transcribe_pcm
    from kame.backend.llm import OpenAICompatibleLLM
    from kame.backend.profiles import BackendProfile
    from kame.eval.mtbench import delay_plot, latency_figures, load_questions, markdown_report
    from kame.testing.speech import speech

    out = Path(args.out)
    categories = [c for c in args.categories.split(",") if c]
    questions = load_questions(tuple(categories), args.limit)
    modes = modes_for(args)
    results_path = out / "results.json"
    results = _load_results(results_path)
    done = {(r["mode"], r["question_id"]) for r in results}
    judge_llm = OpenAICompatibleLLM(BackendProfile("judge", args.judge_base_url, args.judge_model,
                                                   args.judge_api_key_env or None, first_token_timeout_s=60,
                                                   token_timeout_s=30, max_tokens=400, temperature=0.0))
    asr = build_asr("whisper", args.asr_model, realtime=False)
    todo = [(m, q) for m in modes for q in questions if (m["mode"], q["question_id"]) not in done]
    try:
        for mode, question in tqdm(todo, desc="mt-bench", unit="item"):
            pcm = speech(question["question"], out / "tts")
            conv = await converse(args.url, pcm, realtime=not args.fast, tail_s=args.tail,
                                  backend=mode.get("backend"), options=mode["options"])
            heard = await transcribe_pcm(asr, conv.assistant_audio)
            said = " ".join(e.text for e in heard if isinstance(e, FinalTranscript))
            score, judgements = await judge(judge_llm, question["question"], said, args.judge_retries)
            results.append({
                "mode": mode["mode"], "delay_s": mode.get("delay_s"), **question,
                "answer_said": said, "answer_text_stream": conv.assistant_text, "score": score,
                "judgements": judgements, "latency": latency_figures(conv.events, conv.text, conv.input_end_s),
                "transcripts": conv.events_of("transcript"), "oracle": conv.events_of("oracle"),
                "llm": conv.events_of("llm"),
            })
            _save(results_path, json.dumps(results, indent=1))
    finally:
        asr.close()
        await judge_llm.aclose()
    plot = delay_plot(results, out / "delay_curve.png")
    settings = {k: v for k, v in vars(args).items() if k not in ("func",)}
    report = markdown_report(results, [m["mode"] for m in modes], categories, settings,
                             plot.name if plot else None)
    _save(out / "report.md", report)
    return out


def _load_results(path: Path) -> list[dict]:
    """What an earlier run finished (the run is resumable), creating the folder if needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return json.loads(path.read_text()) if path.exists() else []


def _save(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # a run killed mid-write never leaves a broken file


def run_mtbench(args: argparse.Namespace) -> int:
    try:
        out = asyncio.run(evaluate(args))
    except ValueError as exc:
        raise KameError(str(exc)) from exc
    print(f"wrote {out / 'report.md'} and {out / 'results.json'}")
    return 0
