"""What the int8 KV cache costs in quality: the same session on the model-dtype cache and on int8, side by side.

    python scripts/kv_quality.py [--frontend tiny] [--device cpu] [--frames 300] [--json-out FILE]

One slot hears tests/fixtures/question.wav (looped) and gets an oracle at frame 10, greedy sampling. The
reference run (the model's dtype) records every step's text logits and the 8 codebooks' audio logits and
the tokens it chose; the int8 run is then *teacher-forced* on those tokens (each step's sampling returns the
reference's token), so that every step compares the two caches on the same history:
- text / audio agreement: the share of steps whose most likely token is the same (audio: per codebook);
- logits: the largest and the mean absolute difference, over the reference's logit spread (std per step).
A free run on int8 (no forcing) gives the share of frames with the same text token as the reference and
the first frame that differs: how soon greedy generation drifts apart once one token differs.
With random weights (no real checkpoint here) the logits are flatter than a trained model's, so ties flip
more easily: read the agreement as a lower bound. The context wraps when --frames exceeds it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kame.audio import FRAME_SIZE, read_audio  # noqa: E402
from kame.frontend.engine import BatchedEngine, GenerationConfig  # noqa: E402
from kame.frontend.kv_cache import kv_bytes_per_slot  # noqa: E402
from kame.frontend.loader import load_frontend  # noqa: E402
from kame.frontend.oracle import OracleUpdate, tokenize_words  # noqa: E402

ORACLE_AT = 10
ANSWER = "The capital of France is Paris, a city on the Seine famous for its museums and its food."


class Recorder:
    """Hooks one engine's sampling: records the logits it sees; with `forced`, makes the sampling pick the
    recorded tokens of another run (every other logit set to -inf)."""

    def __init__(self, engine: BatchedEngine, forced: dict | None = None) -> None:
        self.engine, self.forced = engine, forced
        self.text: list[torch.Tensor] = []
        self.audio: list[torch.Tensor] = []  # one per codebook call, dep_q per step
        self.text_tokens: list[int] = []
        self.audio_tokens: list[int] = []
        text_hook, audio_logits = engine.lm_gen.on_text_logits_hook, engine.sampler.audio_logits

        def on_text(logits: torch.Tensor) -> None:
            self.text.append(logits[0, 0, 0].float().cpu().clone())
            self.text_tokens.append(int(logits[0, 0, 0].argmax()))
            if forced is not None:
                self._force(logits, forced["text"][len(self.text) - 1])
            text_hook(logits)

        def on_audio(logits: torch.Tensor, graphed: bool):
            self.audio.append(logits[0, 0, 0].float().cpu().clone())
            self.audio_tokens.append(int(logits[0, 0, 0].argmax()))
            if forced is not None:
                self._force(logits, forced["audio"][len(self.audio) - 1])
            return audio_logits(logits, graphed)

        engine.lm_gen.on_text_logits_hook = on_text
        engine.sampler.audio_logits = on_audio

    @staticmethod
    def _force(logits: torch.Tensor, token: int) -> None:
        logits.fill_(float("-inf"))
        logits[..., token] = 0.0


def frames_of(count: int) -> list[np.ndarray]:
    pcm = read_audio(ROOT / "tests" / "fixtures" / "question.wav")
    needed = count * FRAME_SIZE
    pcm = np.tile(pcm, needed // len(pcm) + 1)[:needed].astype(np.float32)
    return list(pcm.reshape(count, FRAME_SIZE))


def run(frontend, kv_cache: str, frames, oracle, forced=None) -> tuple[Recorder, list, float]:
    engine = BatchedEngine(frontend, 1, gen=GenerationConfig(use_sampling=False), kv_cache=kv_cache)
    recorder = Recorder(engine, forced)
    outputs = []
    started = time.perf_counter()
    try:
        slot = engine.acquire()
        for index, frame in enumerate(frames):
            if index == ORACLE_AT:
                engine.push_oracle(slot, oracle)
            outputs.extend(engine.step({slot: frame}))
            if index % 50 == 49:
                print(f"{kv_cache}{' (forced)' if forced else ''}: {index + 1} frames, "
                      f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    finally:
        engine.close()
    return recorder, outputs, (time.perf_counter() - started) / len(frames)


def compare(reference: list[torch.Tensor], other: list[torch.Tensor]) -> dict:
    ref, got = torch.stack(reference), torch.stack(other)
    finite = torch.isfinite(ref) & torch.isfinite(got)
    diff = torch.where(finite, (got - ref).abs(), torch.zeros_like(ref))
    spread = torch.stack([row[torch.isfinite(row)].std() for row in ref])
    return {"agreement": round(float((ref.argmax(-1) == got.argmax(-1)).float().mean()), 4),
            "max_abs_diff": round(float(diff.max()), 4),
            "mean_abs_diff_over_std": round(float((diff.mean(-1) / spread).mean()), 5)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frontend", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--frames", type=int, default=300)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="default: the loader's (float32 on a CPU: the 7B then needs 31 GB; bfloat16 fits 24)")
    parser.add_argument("--no-free-run", action="store_true", help="skip the free run (a third pass)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    frontend = load_frontend(args.frontend, args.device, getattr(torch, args.dtype) if args.dtype else None)
    # a preset without a tokenizer (moshi-7b-random): 40 text token ids stand for the answer
    tokens = tokenize_words(frontend.tokenizer, ANSWER) if frontend.tokenizer else range(1000, 1040)
    oracle = OracleUpdate.reset(0, tuple(tokens))
    frames = frames_of(args.frames)
    reference, ref_out, ref_s = run(frontend, "model", frames, oracle)
    forced = {"text": reference.text_tokens, "audio": reference.audio_tokens}
    teacher, _, int8_s = run(frontend, "int8", frames, oracle, forced)
    free_out = None if args.no_free_run else run(frontend, "int8", frames, oracle)[1]
    dep_q = frontend.lm.dep_q
    audio = {f"codebook_{k}": compare(reference.audio[k::dep_q], teacher.audio[k::dep_q]) for k in range(dep_q)}
    same = [a.text_token == b.text_token for a, b in zip(ref_out, free_out, strict=True)] if free_out else None
    context = frontend.lm.transformer.layers[0].self_attn.context
    result = {
        "frontend": args.frontend, "device": args.device, "dtype": str(frontend.dtype), "frames": args.frames,
        "context": context, "wraps": args.frames > context,
        "kv_bytes_per_slot": {"model": kv_bytes_per_slot(frontend.lm, "model"),
                              "int8": kv_bytes_per_slot(frontend.lm, "int8")},
        "step_s": {"model": round(ref_s, 4), "int8": round(int8_s, 4)},
        "teacher_forced": {"text": compare(reference.text, teacher.text), "audio": audio,
                           "audio_agreement_mean": round(float(np.mean([a["agreement"] for a in audio.values()])),
                                                         4)},
        "free_run": same and {"text_token_agreement": round(float(np.mean(same)), 4),
                              "first_difference_frame": next((i for i, s in enumerate(same) if not s), None)},
    }
    print(json.dumps(result, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
