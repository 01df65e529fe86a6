"""Whisper's prepare stage of `kame train` on synthetic dialogues, side by side: one process on two
threads (the old way), `prepare_workers` processes on one thread each with glibc's default of giving
big freed blocks back to the kernel, and the same processes keeping them (`WORKER_MALLOC`, the default
now).

    python scripts/bench_prepare.py --dialogues 24

Prints wall seconds and CPU seconds (this process and its workers) of each, on the same WAVs, and
checks that both found the same words."""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

from kame.testing.dialogues import make_dialogues
from kame.training import dialogues


def cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed(data: Path, run: Path, workers: int) -> tuple[float, float, list[list[str]]]:
    wall, cpu = time.monotonic(), cpu_s()
    outputs = dialogues.prepare(data, run, device="cpu", workers=workers)
    wall, cpu = time.monotonic() - wall, cpu_s() - cpu
    return wall, cpu, [[w["word"] for w in json.loads(p.read_text())["words"]] for p in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dialogues", type=int, default=24)
    args = parser.parse_args()
    auto = dialogues.prepare_workers("cpu", args.dialogues)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_dialogues(root / "data", args.dialogues, seed=0)
        one_wall, one_cpu, one_words = timed(root / "data", root / "one", 1)
        kept, dialogues.WORKER_MALLOC = dialogues.WORKER_MALLOC, {}
        given_wall, given_cpu, given_words = timed(root / "data", root / "given", auto)
        dialogues.WORKER_MALLOC = kept
        many_wall, many_cpu, many_words = timed(root / "data", root / "many", auto)
    same = sum(a == b == c for a, b, c in zip(one_words, given_words, many_words, strict=True))
    print(f"{args.dialogues} dialogues: 1 process x 2 threads {one_wall:.1f} s wall, {one_cpu:.1f} s CPU; "
          f"{auto} processes x 1 thread, glibc's default {given_wall:.1f} s wall, {given_cpu:.1f} s CPU; "
          f"the same keeping their memory {many_wall:.1f} s wall, {many_cpu:.1f} s CPU; "
          f"speed-up {given_wall / many_wall:.2f}x (against one process {one_wall / many_wall:.2f}x); "
          f"same words in {same}/{args.dialogues} dialogues")


if __name__ == "__main__":
    main()
