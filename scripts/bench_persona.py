"""A persona's prefill beside talking sessions: how long a PersonaPlex-layout session's prompt takes to step into
its slot, and whether the sessions already talking lose a frame meanwhile (docs/benchmarks.md, "A persona's
prefill beside talking sessions").

    python scripts/bench_persona.py --levels 1,4,16 --seconds 6
    python scripts/bench_persona.py --frontend personaplex-7b-random --device cuda --levels 1,8,32   # a GPU

The front-end is (by default) the PersonaPlex-layout test fixture (tests/fixtures/personaplex-tiny: a tiny random
LM, with a random Mimi of its card) on the engine's own thread (EngineRunner, the tick clock), as the server runs
it. At each level, N sessions push a frame of audio every 80 ms (a thread, real time) and read what comes back;
after 2 s a persona session is acquired with a prompt of PROMPT_FRAMES frames (a voice of 10 s, a role text, the
silences).
Reported: the prefill's wall time; each talking session's frames out and how late they came (the time from a
frame's push to its output, p50/p99/max, and how many took longer than a frame) during the prefill, and the same
in a run at the same level with no persona (the baseline), side by side.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kame.frontend.engine import BatchedEngine, PromptFrame  # noqa: E402
from kame.frontend.loader import load_frontend  # noqa: E402
from kame.frontend.persona import SILENCE_CODES, SINE_CODES, Persona, prompt_frames  # noqa: E402
from kame.frontend.presets import TINY_COPY_DIR  # noqa: E402
from kame.frontend.runner import EngineRunner  # noqa: E402
from kame.frontend.sampling import GenerationConfig  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "personaplex-tiny"
FRAME_S = 0.08
VOICE_FRAMES = 125  # 10 s of a voice prompt
ROLE = ("You are a patient teacher who explains one idea at a time, checks that the student followed, and "
        "never hurries. You work for a small school and you answer questions about its courses. ") * 2


def fixture_folder(root: Path) -> Path:
    from moshi.models import loaders
    from safetensors.torch import save_file

    reference = json.loads((FIXTURE / "reference.json").read_text())
    shutil.copy(FIXTURE / "model.safetensors", root / "model.safetensors")
    mimi_config = json.loads((TINY_COPY_DIR / "mimi_config.json").read_text())
    mimi_config["quantizer"]["bins"] = reference["lm_kwargs"]["card"]
    (root / "mimi_config.json").write_text(json.dumps(mimi_config))
    torch.manual_seed(0)
    save_file(loaders.get_mimi(None, mimi_config, num_codebooks=8).state_dict(), root / "mimi.safetensors")
    shutil.copy(TINY_COPY_DIR / "tokenizer.model", root / "tokenizer.model")
    config = reference["lm_kwargs"] | {"moshi_name": "model.safetensors", "mimi_name": "mimi.safetensors",
                                       "tokenizer_name": "tokenizer.model", "mimi_config_name": "mimi_config.json"}
    (root / "config.json").write_text(json.dumps(config))
    return root


class Talker:
    """One talking session: a frame every 80 ms; when each came back."""

    def __init__(self, runner: EngineRunner) -> None:
        self.pushed: dict[int, float] = {}
        self.late: list[tuple[float, float]] = []  # (output time, push-to-output seconds)
        self.handle = runner.acquire(self.output)
        self.count = 0

    def output(self, out) -> None:
        now = time.perf_counter()
        pushed = self.pushed.pop(out.frame, None)
        if pushed is not None:
            self.late.append((now, now - pushed))

    def push(self) -> None:
        self.pushed[self.count] = time.perf_counter()
        self.count += 1
        self.handle.push_frame(np.zeros(1920, np.float32))


def persona_frames(frontend) -> list:
    """The prompt: 10 s of a voice, the silences, ROLE (as tokens of the tokenizer; a preset without one: as many
    token ids as the tiny tokenizer makes of it)."""
    voice = tuple(tuple(int(c) for c in np.random.default_rng(1).integers(0, 2048, 8)) for _ in range(VOICE_FRAMES))
    if frontend.tokenizer is not None:
        return prompt_frames(Persona(ROLE, voice), frontend.tokenizer)
    import sentencepiece

    count = len(sentencepiece.SentencePieceProcessor(model_file=str(TINY_COPY_DIR / "tokenizer.model")).encode(ROLE))
    frames = prompt_frames(Persona(None, voice), None)
    quiet = frames[VOICE_FRAMES:]
    return frames + [PromptFrame(100 + i, SILENCE_CODES, SINE_CODES) for i in range(count)] + quiet


def run(frontend, sessions: int, seconds: float, window_s: float | None) -> dict:
    """With a persona's prefill (`window_s` None), or none and a window of `window_s` (the baseline)."""
    engine = BatchedEngine(frontend, batch_size=sessions + 1, gen=GenerationConfig(use_sampling=True))
    runner = EngineRunner(engine, clock="tick", torch_threads=1).start()
    try:
        runner.warm_up()
        talkers = [Talker(runner) for _ in range(sessions)]
        stop = threading.Event()

        def feed() -> None:
            next_at = time.perf_counter()
            while not stop.is_set():
                for talker in talkers:
                    talker.push()
                next_at += FRAME_S
                time.sleep(max(0.0, next_at - time.perf_counter()))

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        time.sleep(2.0)
        prompt = persona_frames(frontend)
        started = time.perf_counter()
        if window_s is None:
            runner.acquire(lambda out: None, timeout=120, prompt=prompt)
        else:
            time.sleep(window_s)
        ended = time.perf_counter()
        time.sleep(max(0.0, seconds - 2.0 - (ended - started)))
        stop.set()
        feeder.join()
        time.sleep(0.3)
    finally:
        runner.stop()
        engine.close()
    window = [lag for talker in talkers for at, lag in talker.late if started <= at <= ended + 0.16]
    skipped = sum(talker.handle._inbox.dropped_frames for talker in talkers)  # skipped to stay live
    return {"prompt_frames": len(prompt), "prefill_s": ended - started, "frames": len(window),
            "p50_ms": 1000 * statistics.median(window) if window else None,
            "p99_ms": 1000 * float(np.percentile(window, 99)) if window else None,
            "max_ms": 1000 * max(window) if window else None,
            "over_a_frame": sum(lag > FRAME_S for lag in window), "overruns": runner.stats.overruns,
            "skipped": skipped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,4,16")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--frontend", default=None, help="a PersonaPlex-layout source (default: the test fixture)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        if args.frontend is None:
            frontend = load_frontend(str(fixture_folder(Path(tmp))), device=args.device, dtype=torch.float32)
        else:
            frontend = load_frontend(args.frontend, device=args.device)
        if not getattr(frontend.lm, "predicted_q", None):
            sys.exit(f"{args.frontend}: not a PersonaPlex-layout front-end (it takes no persona)")
        print("| sessions talking | prompt frames | prefill s | frames out during it (with / without) | "
              "push-to-output p50 / p99 / max ms (with) | (without) | over 80 ms (with / without) | "
              "skipped to live, whole run (with / without) |")
        print("|---:|---:|---:|---|---|---|---|---|")
        for level in (int(v) for v in args.levels.split(",")):
            with_ = run(frontend, level, args.seconds, None)
            without = run(frontend, level, args.seconds, with_["prefill_s"])
            print(f"| {level} | {with_['prompt_frames']} | {with_['prefill_s']:.2f} | {with_['frames']} / "
                  f"{without['frames']} | {with_['p50_ms']:.1f} / {with_['p99_ms']:.1f} / {with_['max_ms']:.1f} | "
                  f"{without['p50_ms']:.1f} / {without['p99_ms']:.1f} / {without['max_ms']:.1f} | "
                  f"{with_['over_a_frame']} / {without['over_a_frame']} | {with_['skipped']} / {without['skipped']} |",
                  flush=True)


if __name__ == "__main__":
    main()
