"""The full-size architectures through the real loading path and engine, on a CPU.

1. Moshi 7B as Kyutai's legacy repo lays it out: a snapshot folder without config.json (moshi's
   default names, Moshi 7B's config), bf16 weights with fused attention keys, Mimi at full size;
   loaded by `load_frontend` in bf16, then given random weights (the file's data is a hole: zeros),
   then stepped through the batched engine with an oracle: 4096-dim oracle embedding, per-slot
   sampling over the full 32000-token text and 2048-code audio vocabularies.
2. Kyutai STT 1B as kyutai/stt-1b-en_fr lays it out (config.json with model_type stt and
   stt_config, fused bf16 keys), without an end-of-turn head (the pause rule): loaded by the kyutai-stt ASR, random
   weights, the test question transcribed with its silence prefix and delay tail.

Each part runs in a process of its own, so its peak RSS is its own. Prints a markdown table and
checks what each output must be (shapes, finite audio, the oracle fed each frame); exits non-zero
on a failure. `.ci/run` runs it after the tests (about 18 GB and 2-3 minutes on a 2-core CPU).

    python scripts/full_size_cpu.py [--part moshi|stt|all] [--frames 10] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from moshi.models import loaders

ROOT = Path(__file__).resolve().parent.parent
QUESTION = ROOT / "tests" / "fixtures" / "question.wav"
ORACLE = tuple(range(10, 50))


def peak_rss_gb() -> float:
    from kame.testing.memory import peak_rss_bytes

    return peak_rss_bytes() / 1e9


def fill_random_(module: torch.nn.Module, seed: int) -> None:
    """Random weights in place (the sparse file held zeros): norm scales 1, every other tensor uniform
    with std 1/sqrt(fan_in), as moshi's own init scales them; one pass per tensor."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("alpha") or param.dim() < 2:
                param.fill_(1.0)
            else:
                bound = math.sqrt(3.0 / param.shape[-1])
                param.uniform_(-bound, bound, generator=generator)


def random_mimi_(mimi: torch.nn.Module, seed: int) -> None:
    """Mimi with moshi's own random init, and codebooks that are not all zero (codes then vary)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        fresh = loaders.get_mimi(None, device="cpu")
        state = fresh.state_dict()
        for key, value in state.items():
            if key.endswith("embedding_sum"):
                value.normal_()
    mimi.load_state_dict(state)


def moshi_snapshot(folder: Path, lm_config: dict | None) -> Path:
    """Kyutai's legacy layout: no config.json when `lm_config` is None (Moshi 7B), else one naming nothing."""
    from kame.testing import hub_layouts as hub

    hub.sparse_safetensors(folder / loaders.MOSHI_NAME, hub.layout_shapes(lm_config))
    hub.sparse_safetensors(folder / loaders.MIMI_NAME, hub.mimi_shapes())
    (folder / loaders.TEXT_TOKENIZER_NAME).write_bytes(hub.TOKENIZER.read_bytes())
    if lm_config is not None:
        hub.write_config(folder, lm_config)
    return folder


def run_moshi(lm_config: dict | None, frames: int, folder: Path) -> dict:
    from kame.audio import FRAME_SIZE, read_audio
    from kame.frontend.engine import BatchedEngine
    from kame.frontend.loader import load_frontend
    from kame.frontend.oracle import OracleUpdate

    moshi_snapshot(folder, lm_config)
    started = time.perf_counter()
    frontend = load_frontend(str(folder), "cpu", dtype=torch.bfloat16)
    load_s = time.perf_counter() - started
    load_rss = peak_rss_gb()
    fill_random_(frontend.lm, 0)
    fill_random_(frontend.oracle_emb, 1)
    random_mimi_(frontend.mimi, 2)
    pcm = read_audio(QUESTION)
    engine = BatchedEngine(frontend, 1)
    try:
        slot = engine.acquire()
        engine.push_oracle(slot, OracleUpdate.reset(0, ORACLE))
        times, outputs = [], []
        for index in range(frames):
            frame = pcm[index * FRAME_SIZE:(index + 1) * FRAME_SIZE]
            frame = np.pad(frame, (0, FRAME_SIZE - len(frame)))
            tick = time.perf_counter()
            outputs.append(engine.step({slot: frame})[0])
            times.append(time.perf_counter() - tick)
    finally:
        engine.close()
    lm = frontend.lm
    fed = [o.oracle_token for o in outputs]
    expected = [lm.text_initial_token_id, *ORACLE][:frames]
    checks = {
        "dim 4096 / text_card / card": [lm.dim, lm.text_card, lm.card],
        "oracle fed each frame": fed == expected,
        "audio finite": all(np.isfinite(o.pcm).all() for o in outputs),
        "audio from frame": next((o.frame for o in outputs if o.audio_ready), None),
        "text tokens (random weights: any)": sum(o.text_token is not None for o in outputs),
        "text tokens in range": all(t is None or 0 <= t < lm.text_card for t in (o.text_token for o in outputs)),
    }
    ok = fed == expected and checks["audio finite"] and checks["text tokens in range"] \
        and checks["audio from frame"] is not None
    return {"part": "moshi", "params": sum(p.numel() for p in lm.parameters()), "dtype": "bf16",
            "load_s": round(load_s, 1), "load_peak_rss_gb": round(load_rss, 2),
            "step_ms_median": round(1000 * statistics.median(times[1:] or times), 1),
            "step_ms_first": round(1000 * times[0], 1), "frames": frames,
            "peak_rss_gb": round(peak_rss_gb(), 2), "checks": checks, "ok": ok}


def stt_repo(folder: Path, lm_config: dict) -> Path:
    from kame.testing import hub_layouts as hub

    hub.sparse_safetensors(folder / loaders.MOSHI_NAME, hub.layout_shapes(lm_config))
    hub.sparse_safetensors(folder / hub.STT_MIMI_NAME, hub.mimi_shapes())
    (folder / hub.STT_TOKENIZER_NAME).write_bytes(hub.TOKENIZER.read_bytes())
    hub.write_config(folder, {**lm_config, "model_type": "stt", "mimi_name": hub.STT_MIMI_NAME,
                              "tokenizer_name": hub.STT_TOKENIZER_NAME, "stt_config": dict(hub.STT_CONFIG)})
    return folder


def run_stt(lm_config: dict, folder: Path) -> dict:
    from kame.asr import FinalTranscript, PartialTranscript
    from kame.asr.kyutai_stt import KyutaiSttAsr, SttOptions
    from kame.asr.transcribe import transcribe_pcm
    from kame.audio import FRAME_SIZE, read_audio
    from kame.frontend.engine import FRAME_RATE

    stt_repo(folder, lm_config)
    started = time.perf_counter()
    asr = KyutaiSttAsr(SttOptions(model=str(folder), device="cpu", max_sessions=1))
    load_s = time.perf_counter() - started
    load_rss = peak_rss_gb()
    fill_random_(asr.model.lm, 3)
    random_mimi_(asr.model.mimi, 4)
    try:
        started = time.perf_counter()
        pcm = read_audio(QUESTION)
        events = asyncio.run(transcribe_pcm(asr, pcm))
        elapsed = time.perf_counter() - started
        steps = asr.runner.steps
    finally:
        asr.close()
    # silence prefix + the audio's whole frames (its last part is padded by the flush) + the delay tail
    expected_steps = 13 + len(pcm) // FRAME_SIZE + math.ceil(asr.delay_s * FRAME_RATE) + 1
    checks = {"prefix frames": asr.prefix_frames, "end of turn": asr.end_of_turn,
              "steps (expected)": [steps, expected_steps],
              "partials, finals (random weights: any)": [sum(isinstance(e, PartialTranscript) for e in events),
                                                         sum(isinstance(e, FinalTranscript) for e in events)]}
    checks["pause rule ms per frame"] = round(pause_rule_ms(pcm), 3)
    ok = asr.prefix_frames == 13 and asr.end_of_turn == "pause" and steps == expected_steps
    return {"part": "stt", "params": sum(p.numel() for p in asr.model.lm.parameters()), "dtype": "f32",
            "load_s": round(load_s, 1), "load_peak_rss_gb": round(load_rss, 2),
            "step_ms_median": round(1000 * elapsed / steps, 1), "frames": steps,
            "peak_rss_gb": round(peak_rss_gb(), 2), "checks": checks, "ok": ok}


def pause_rule_ms(pcm: np.ndarray, repeats: int = 20) -> float:
    """What the pause rule (Silero VAD on one session's input) costs the STT engine thread per frame."""
    from kame.asr.vad import SilenceEndOfTurn, silero_session
    from kame.audio import FRAME_SIZE

    rule = SilenceEndOfTurn(silero_session(), 8)
    frames = [pcm[i:i + FRAME_SIZE] for i in range(0, len(pcm) - FRAME_SIZE + 1, FRAME_SIZE)] * repeats
    rule(frames[0])
    started = time.perf_counter()
    for frame in frames:
        rule(frame)
    return 1000 * (time.perf_counter() - started) / len(frames)


def run_part(part: str, frames: int, lm_config: dict | None = None) -> dict:
    """One part in this process (`lm_config`: a smaller architecture, for the test of this script)."""
    from kame.testing import hub_layouts as hub

    with tempfile.TemporaryDirectory(prefix=f"full-size-{part}-") as tmp:
        if part == "moshi":
            return run_moshi(lm_config, frames, Path(tmp))
        return run_stt(lm_config or hub.STT_1B_LM_CONFIG, Path(tmp))


def markdown(rows: list[dict]) -> str:
    lines = ["| model | parameters | dtype | load s | peak RSS after load GB | ms per step (median) | "
             "frames | peak RSS GB | checks |", "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    names = {"moshi": "Moshi 7B, no config.json, fused keys", "stt": "Kyutai STT 1B, fused keys, no EOT head"}
    for r in rows:
        lines.append(f"| {names[r['part']]} | {r['params'] / 1e9:.2f} G | {r['dtype']} | {r['load_s']} | "
                     f"{r['load_peak_rss_gb']} | {r['step_ms_median']} | {r['frames']} | {r['peak_rss_gb']} | "
                     f"{'ok' if r['ok'] else 'FAILED'}: {json.dumps(r['checks'])} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["moshi", "stt", "all"], default="all")
    parser.add_argument("--frames", type=int, default=10, help="Moshi frames stepped (default 10)")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_process:
        print(json.dumps(run_part(args.part, args.frames)))
        return 0
    rows = []
    for part in ("moshi", "stt") if args.part == "all" else (args.part,):
        print(f"== {part} (in a process of its own)", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, __file__, "--part", part, "--frames", str(args.frames),
                               "--in-process"], stdout=subprocess.PIPE, text=True)
        if done.returncode:
            print(f"{part}: exited with {done.returncode}", file=sys.stderr)
            return 1
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(markdown(rows))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
