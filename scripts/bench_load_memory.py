"""Peak memory of loading a float32 checkpoint into bf16: this tree's loader, a baseline commit's
loader, and moshi's own `get_moshi_lm`, side by side in one run.

A synthetic checkpoint in KAME's layout (split keys, float32, oracle_emb) of about 1.5 GB is
written once; each loader then runs in a process of its own that first loads the tiny-copy preset
(so the one-off costs of a first load are paid), then loads the checkpoint in bf16 on the CPU. The
figure is the growth of the process's peak RSS over that second load, against the file's size.

    python scripts/bench_load_memory.py [--baseline c257950] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# ~375 M parameters: 1.5 GB in float32
CONFIG_OVERRIDES = {"dim": 2048, "num_heads": 16, "num_layers": 6, "text_card": 8000, "card": 2048,
                    "hidden_scale": 4.125, "context": 500}

MEASURE = textwrap.dedent("""
    import json, sys, time, torch
    kind, folder = sys.argv[1], sys.argv[2]
    # kame.testing.memory.peak_rss_bytes, written out: the baseline tree may not have it
    peak = lambda: int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
    from kame.frontend.loader import load_frontend
    load_frontend("tiny-copy", "cpu", dtype=torch.bfloat16)
    if kind == "moshi":
        from moshi.models import loaders
        config = json.load(open(folder + "/config.json"))
        kwargs = {k: v for k, v in config.items() if not k.endswith("_name") and k != "lm_gen_config"}
    before, started = peak(), time.perf_counter()
    if kind == "moshi":
        # moshi's loader refuses the oracle key: it reads a copy without it (same size, less 0.1 %)
        model = loaders.get_moshi_lm(folder + "/moshi-only.safetensors", lm_kwargs=kwargs, device="cpu",
                                     dtype=torch.bfloat16)
    else:
        model = load_frontend(folder, "cpu", dtype=torch.bfloat16).lm
    print(json.dumps({"grew": peak() - before, "seconds": time.perf_counter() - started,
                      "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}))
""")


def write_checkpoint(folder: Path) -> int:
    import torch
    from safetensors.torch import load_file, save_file

    from kame.testing import hub_layouts as hub

    weights = hub.random_weights({**hub.TINY_LM_CONFIG, **CONFIG_OVERRIDES}, seed=0, dtype=torch.float32)
    oracle = torch.randn(CONFIG_OVERRIDES["text_card"] + 1, CONFIG_OVERRIDES["dim"])
    hub.own_layout(folder, weights, oracle)
    state = load_file(folder / "model.safetensors")
    state.pop(hub.ORACLE_KEY)
    save_file(state, str(folder / "moshi-only.safetensors"))
    return (folder / "model.safetensors").stat().st_size


def measure(kind: str, folder: Path, tree: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", MEASURE, kind, str(folder)], cwd=tree, text=True,
                          capture_output=True, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})
    if done.returncode:
        raise SystemExit(f"{kind} in {tree} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="c257950", help="git ref of the loader to compare with")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="load-memory-") as tmp:
        tmp = Path(tmp)
        size = write_checkpoint(tmp / "checkpoint")
        baseline = tmp / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(baseline), args.baseline],
                       check=True)
        try:
            rows = {f"loader at {args.baseline}": measure("kame", tmp / "checkpoint", baseline),
                    "moshi's get_moshi_lm": measure("moshi", tmp / "checkpoint", ROOT),
                    "this tree's loader": measure("kame", tmp / "checkpoint", ROOT)}
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(baseline)], check=True)
    print(f"float32 checkpoint of {size / 1e9:.2f} GB loaded into bf16 on the CPU "
          f"(the bf16 model: {next(iter(rows.values()))['model_bytes'] / 1e9:.2f} GB)\n")
    print("| loader | peak RSS growth GB | vs file size | vs bf16 model | seconds |")
    print("|---|---:|---:|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {row['grew'] / 1e9:.2f} | {row['grew'] / size:.2f} | "
              f"{row['grew'] / row['model_bytes']:.2f} | {row['seconds']:.1f} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"file_bytes": size, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
