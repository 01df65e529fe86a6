"""Re-make the tiny presets' text tokenizer (kame/frontend/assets/tiny-copy/tokenizer.model).

    python scripts/make_tiny_tokenizer.py [--out DIR]

SentencePiece unigram, 1000 pieces with byte fallback (unk 0, bos 1, eos 2, pad 3, as Moshi's
tokenizer), trained on the MT-Bench questions' sentences shipped in kame/data (Apache-2.0, see
kame/data/NOTICE.md). The `tiny`, `tiny-stt` and `tiny-copy` presets all read this one file;
`kame train --recipe tiny-copy` copies it from the `tiny` base, it does not make it.
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
from pathlib import Path

import sentencepiece as spm

from kame.frontend.presets import TINY_COPY_DIR, TINY_LM_CONFIG
from kame.training.synthetic import sentences


def make(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("\n".join(sentences()) + "\n")
        spm.SentencePieceTrainer.train(
            input=str(corpus), model_prefix=str(Path(tmp) / "tokenizer"), vocab_size=TINY_LM_CONFIG["text_card"],
            model_type="unigram", character_coverage=1.0, byte_fallback=True, unk_id=0, bos_id=1, eos_id=2,
            pad_id=3, hard_vocab_limit=False, minloglevel=2, num_threads=2,
        )
        target = out / "tokenizer.model"
        target.write_bytes((Path(tmp) / "tokenizer.model").read_bytes())
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(TINY_COPY_DIR), help="folder to write tokenizer.model into")
    path = make(Path(parser.parse_args().out))
    print(f"wrote {path} (sha256 {hashlib.sha256(path.read_bytes()).hexdigest()[:16]})")


if __name__ == "__main__":
    main()
