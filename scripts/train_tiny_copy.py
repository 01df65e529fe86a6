"""Train the `tiny-copy` front-end: a tiny Moshi-shaped LM whose text stream repeats its oracle.

It makes the oracle path visible end to end without real weights: whatever words the backend
puts in the oracle come out of the front-end's text stream. Runs on a CPU in a few minutes.

    python scripts/train_tiny_copy.py [--out kame/frontend/assets/tiny-copy] [--seed 1234] [--steps 1500]

Writes config.json, model.safetensors (LM + oracle_emb.weight), mimi.safetensors (a random,
seeded tiny Mimi), mimi_config.json and tokenizer.model: the layout of a KAME hub repo.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import sentencepiece as spm
import torch
import torch.nn.functional as F
from moshi.models import loaders
from safetensors.torch import save_file

from kame.frontend.presets import TINY_LM_CONFIG, TINY_MIMI_CONFIG

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT / "kame" / "data" / "mt_bench_questions.jsonl"


def corpus_sentences() -> list[str]:
    sentences = []
    for line in QUESTIONS.read_text().splitlines():
        for turn in json.loads(line)["turns"]:
            sentences.extend(s.strip() for s in turn.replace("\n", " ").split(". ") if s.strip())
    return sentences


def train_tokenizer(out: Path, sentences: list[str], vocab: int) -> spm.SentencePieceProcessor:
    corpus = out / "corpus.txt"
    corpus.write_text("\n".join(sentences) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(out / "tokenizer"), vocab_size=vocab, model_type="unigram",
        character_coverage=1.0, byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=3,
        hard_vocab_limit=False, minloglevel=2, num_threads=2,
    )
    corpus.unlink()
    (out / "tokenizer.vocab").unlink()
    return spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))


def word_tokens(tokenizer: spm.SentencePieceProcessor, sentences: list[str]) -> list[list[int]]:
    """Each sentence as a list of token ids, tokenised a whole word at a time (as the planner does)."""
    return [[t for w in s.split() for t in tokenizer.encode(w)] for s in sentences]


def make_batch(rng: random.Random, pieces: list[list[int]], batch: int, length: int, cfg: dict):
    """Random oracle timelines (resets at random frames, then tokens, then padding) and targets."""
    start, pad, card = cfg["text_card"], cfg["existing_text_padding_id"], cfg["card"]
    oracle = torch.full((batch, length), pad, dtype=torch.long)
    for b in range(batch):
        t = rng.randrange(0, 12)
        while t < length:
            tokens = rng.choice(pieces)
            cut = rng.randrange(1, len(tokens) + 1)
            span = [start, *tokens[:cut]]
            span = span[: rng.randrange(2, len(span) + 1)] if rng.random() < 0.3 else span
            end = min(length, t + len(span))
            oracle[b, t:end] = torch.tensor(span[: end - t])
            t = end + rng.randrange(0, 15)
    target = torch.where(oracle == start, torch.full_like(oracle, pad), oracle)
    text_in = torch.cat([torch.full((batch, 1), start), target[:, :-1]], dim=1)
    audio = torch.randint(0, card, (batch, cfg["n_q"], length))
    for k, delay in enumerate(cfg["delays"][1:]):
        audio[:, k, : delay + 1] = card  # the initial token LMGen feeds while a codebook is delayed
    return torch.cat([text_in[:, None], audio], dim=1), oracle, target


def train(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    sentences = corpus_sentences()
    tokenizer = train_tokenizer(out, sentences, TINY_LM_CONFIG["text_card"])
    pieces = [p for p in word_tokens(tokenizer, sentences) if p]
    print(f"tokenizer: {tokenizer.vocab_size()} pieces, {len(pieces)} sentences")

    cfg = dict(TINY_LM_CONFIG)
    lm = loaders.get_moshi_lm(None, lm_kwargs=cfg, device="cpu", dtype=torch.float32)
    lm.train()
    oracle_emb = torch.nn.Embedding(cfg["text_card"] + 1, cfg["dim"])
    oracle_emb.weight.data.copy_(lm.text_emb.weight.data)
    params = [*lm.parameters(), *oracle_emb.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    t0 = time.time()
    for step in range(1, args.steps + 1):
        codes, oracle, target = make_batch(rng, pieces, args.batch, args.length, cfg)
        _, text_logits = lm.forward_text(codes, sum_condition=oracle_emb(oracle))
        loss = F.cross_entropy(text_logits[:, 0].reshape(-1, text_logits.shape[-1]), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == args.steps:
            acc = (text_logits[:, 0].argmax(-1) == target).float().mean().item()
            print(f"step {step}/{args.steps} loss {loss.item():.4f} acc {acc:.4f} ({time.time() - t0:.0f}s)")
    save(out, lm, oracle_emb, args)


def save(out: Path, lm, oracle_emb, args: argparse.Namespace) -> None:
    state = {k: v.detach().contiguous() for k, v in lm.state_dict().items()}
    state["oracle_emb.weight"] = oracle_emb.weight.detach().contiguous()
    save_file(state, str(out / "model.safetensors"))
    torch.manual_seed(args.seed)
    mimi = loaders.get_mimi(None, TINY_MIMI_CONFIG, num_codebooks=TINY_LM_CONFIG["dep_q"])
    save_file({k: v.contiguous() for k, v in mimi.state_dict().items()}, str(out / "mimi.safetensors"))
    (out / "mimi_config.json").write_text(json.dumps(TINY_MIMI_CONFIG, indent=2) + "\n")
    config = dict(TINY_LM_CONFIG) | {
        "moshi_name": "model.safetensors",
        "mimi_name": "mimi.safetensors",
        "mimi_config_name": "mimi_config.json",
        "tokenizer_name": "tokenizer.model",
        "lm_gen_config": {"use_sampling": False},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "kame" / "frontend" / "assets" / "tiny-copy"))
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=96, help="frames per training sequence (> the LM context)")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    train(args)


if __name__ == "__main__":
    main()
