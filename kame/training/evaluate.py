"""Teacher-forced evaluation on the held-out dialogues: does the front-end follow its oracle?

Each held-out dialogue is scored twice, with its own oracle stream and with another dialogue's;
the gap in text-token accuracy is what the oracle buys. Writes RUN/eval.json.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from kame.errors import KameError
from kame.frontend.loader import Frontend
from kame.training import checkpoints
from kame.training.augment import stream_of
from kame.training.dataset import Dialogue, load_tokens, split
from kame.training.model import OracleLM, merge_lora, text_accuracy_counts, text_loss
from kame.training.train import autocast, build_model, load_base, rank_device, ranks

logger = logging.getLogger(__name__)


def load_trained(run_dir: Path, device: str | torch.device = "auto") -> tuple[OracleLM, Frontend, int]:
    """(the trained model with any LoRA merged, the base front-end it lives in, its step)."""
    config = checkpoints.read_config(run_dir)
    found = checkpoints.latest(run_dir)
    if found is None:
        raise KameError(f"no checkpoint in {checkpoints.train_dir(run_dir)}: train first")
    step, path = found
    dev = device if isinstance(device, torch.device) else rank_device(device, ranks())
    frontend = load_base(config.frontend, dev, bool(config.lora_rank))
    model = build_model(frontend, config.lora_rank)
    checkpoints.restore_weights(model, checkpoints.load(path)["weights"], path)
    return merge_lora(model).eval(), frontend, step


@torch.no_grad()
def score(model: OracleLM, dialogue: Dialogue, oracle: list[int], chunk: int) -> tuple[int, int, float]:
    """(correct, scored tokens, text loss) of `dialogue` with the oracle stream `oracle`, in windows."""
    lm = model.lm
    correct = total = 0
    loss_sum = 0.0
    for start in range(0, dialogue.frames, chunk):
        length = min(chunk, dialogue.frames - start)
        codes = dialogue.codes(start, length)[None].to(lm.device)
        stream = torch.tensor(oracle[start:start + length], dtype=torch.long, device=lm.device)[None]
        with autocast(lm.device):
            logits = model(codes, stream)
        c, t = text_accuracy_counts(logits, codes[:, 0], lm.text_padding_token_id)
        correct, total = correct + c, total + t
        loss_sum += float(text_loss(logits, codes[:, 0], lm.text_padding_token_id)) * length
    return correct, total, loss_sum / dialogue.frames


def evaluate(run_dir: Path, device: str | torch.device = "auto") -> dict:
    """RUN/eval.json: text accuracy and loss with the own and with another dialogue's oracle."""
    run_dir = Path(run_dir)
    tokens = load_tokens(run_dir)
    train_set, held = split(tokens.dialogues)
    model, _, step = load_trained(run_dir, device)
    chunk = checkpoints.read_config(run_dir).chunk
    start_token, padding = model.lm.text_initial_token_id, model.lm.text_padding_token_id
    sums = {key: [0, 0, 0.0] for key in ("own_oracle", "other_oracle")}
    for index, dialogue in enumerate(held):
        other = held[(index + 1) % len(held)] if len(held) > 1 else train_set[0]
        for key, events in (("own_oracle", dialogue.events), ("other_oracle", other.events)):
            c, t, loss = score(model, dialogue, stream_of(events, dialogue.frames, start_token, padding), chunk)
            sums[key] = [sums[key][0] + c, sums[key][1] + t, sums[key][2] + loss]
    accuracy = {key: c / t if t else 0.0 for key, (c, t, _) in sums.items()}
    result = {
        "text_accuracy": accuracy,
        "text_loss": {key: loss / len(held) for key, (_, _, loss) in sums.items()},
        "oracle_gain": accuracy["own_oracle"] - accuracy["other_oracle"],
        "dialogues": len(held),
        "held_out": [d.name for d in held],
        "scored_tokens": sums["own_oracle"][1],
        "step": step,
    }
    (run_dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    logger.info("eval: text accuracy %.3f with the own oracle, %.3f with another's", *accuracy.values())
    return result
