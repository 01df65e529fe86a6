"""Knowledge base benchmark: index time, and retrieval time for partial spoken transcripts.

    python scripts/bench_knowledge.py [--documents 500] [--queries 300] [--rounds 3] [--seed 17] [--json]

Documents are generated deterministically (no network) from the words of the MT-Bench questions
shipped in kame/data/, drawn with their own frequencies: a .md, .txt or .html file each, of 6-14
paragraphs of 25-90 words, so passages of 120 words with 20 of overlap come to a few thousand.
Queries are the MT-Bench turns as an ASR would give them mid-sentence: lower case, no
punctuation, cut after a random share of the words, half of them inside the last word, some
with "um"/"uh". Index time: the first `refresh` (read, parse, split, insert), then a refresh with
nothing changed, then one after one file changed. Retrieval time: `retrieve` (query building,
completing the cut-off word, FTS5 BM25 top 4, packing 400 tokens) for every query, `--rounds`
times after one warm-up round; the same for an in-memory index and an index file.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kame.knowledge import KnowledgeBase

QUESTIONS = Path(__file__).resolve().parents[1] / "kame" / "data" / "mt_bench_questions.jsonl"


def turns() -> list[str]:
    return [turn for line in QUESTIONS.read_text().splitlines() if line for turn in json.loads(line)["turns"]]


def generate_documents(root: Path, count: int, rng: random.Random) -> None:
    frequencies = Counter(re.findall(r"[a-z']+", " ".join(turns()).lower()))
    vocabulary, weights = zip(*frequencies.items(), strict=True)
    for number in range(count):
        paragraphs = [
            " ".join(rng.choices(vocabulary, weights, k=rng.randint(25, 90))).capitalize() + "."
            for _ in range(rng.randint(6, 14))
        ]
        title = " ".join(rng.choices(vocabulary, weights, k=3)).title()
        kind = ("md", "txt", "html")[number % 3]
        folder = root / f"topic{number % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        if kind == "md":
            body = f"# {title}\n\n" + "\n\n".join(paragraphs)
        elif kind == "txt":
            body = "\n\n".join(paragraphs)
        else:
            body = f"<html><head><title>{title}</title></head><body>" + "".join(f"<p>{p}</p>" for p in paragraphs)
            body += "</body></html>"
        (folder / f"doc{number:04}.{kind}").write_text(body, encoding="utf-8")


def partial_transcripts(count: int, rng: random.Random) -> list[str]:
    spoken = [re.findall(r"[a-z0-9']+", turn.lower()) for turn in turns()]
    queries = []
    while len(queries) < count:
        words = rng.choice(spoken)
        if len(words) < 3:
            continue
        heard = words[: rng.randint(2, len(words))]
        if rng.random() < 0.5 and len(heard[-1]) > 3:
            heard[-1] = heard[-1][: rng.randint(2, len(heard[-1]) - 1)]  # the ASR is mid-word
        if rng.random() < 0.3:
            heard.insert(rng.randint(0, len(heard) - 1), rng.choice(("um", "uh")))
        queries.append(" ".join(heard))
    return queries


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def measure(root: Path, index_path: Path | None, queries: list[str], rounds: int) -> dict:
    kb = KnowledgeBase(root, index_path=index_path)
    try:
        first = kb.refresh()
        unchanged = kb.refresh()
        changed_file = sorted(root.rglob("*.md"))[0]
        changed_file.write_text(changed_file.read_text() + "\n\nOne more paragraph about benchmarks.")
        one_changed = kb.refresh()
        for query in queries:  # warm-up: SQLite's page cache, Python's code paths
            kb.retrieve(query)
        times, hits, passages, tokens = [], 0, 0, []
        for _ in range(rounds):
            for query in queries:
                retrieval = kb.retrieve(query)
                times.append(retrieval.elapsed_s * 1000)
                hits += retrieval.text is not None
                passages += len(retrieval.passages)
                tokens.append(retrieval.tokens)
        return {
            "index": "file" if index_path else "memory",
            "documents": first.documents,
            "passages": first.passages,
            "index_s": first.elapsed_s,
            "refresh_unchanged_ms": unchanged.elapsed_s * 1000,
            "refresh_one_changed_ms": one_changed.elapsed_s * 1000,
            "retrievals": len(times),
            "retrieve_p50_ms": statistics.median(times),
            "retrieve_p99_ms": percentile(times, 0.99),
            "retrieve_max_ms": max(times),
            "hit_share": hits / len(times),
            "passages_per_hit": passages / max(1, hits),
            "tokens_p50": statistics.median(tokens),
        }
    finally:
        kb.close()


def print_table(rows: list[dict]) -> None:
    print("| index | documents | passages | first index s | refresh, nothing changed ms | refresh, one file changed ms "
          "| retrieve p50 ms | p99 ms | max ms | queries with a match | tokens p50 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['index']} | {r['documents']} | {r['passages']} | {r['index_s']:.2f} | "
              f"{r['refresh_unchanged_ms']:.1f} | {r['refresh_one_changed_ms']:.1f} | {r['retrieve_p50_ms']:.2f} | "
              f"{r['retrieve_p99_ms']:.2f} | {r['retrieve_max_ms']:.2f} | {r['hit_share']:.0%} | "
              f"{r['tokens_p50']:.0f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=500)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    queries = partial_transcripts(args.queries, rng)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kame-kb-bench-") as folder:
        started = time.perf_counter()
        for index_path in (None, Path(folder) / "index" / "kb.sqlite"):
            root = Path(folder) / ("docs-file" if index_path else "docs-memory")
            generate_documents(root, args.documents, random.Random(args.seed))
            rows.append(measure(root, index_path, queries, args.rounds))
        elapsed = time.perf_counter() - started
        print(f"{len(queries)} partial transcripts x {args.rounds} rounds, {elapsed:.1f} s in all")
    print_table(rows)
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
