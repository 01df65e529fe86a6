"""The model being trained: moshi's LM with the oracle embedding added to its input, and its loss.

The forward pass is LMModel.forward's (delays applied, one step of initial tokens prepended,
the depformer teacher-forced on the delayed codes), with one difference: the oracle embedding of
frame t is added to the input of step t, exactly what `BatchedEngine.oracle_condition` adds at
inference.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from moshi.models.lm import LMModel
from moshi.models.lm_utils import _delay_sequence, _undelay_sequence
from torch import nn

from kame.errors import KameError

TEXT_PADDING_WEIGHT = 0.5  # a padding target counts half as much as a word token
SEMANTIC_WEIGHT = 100.0  # codebook 0 (semantic) against 1 for each acoustic codebook, as Moshi trains


@dataclass
class Logits:
    text: torch.Tensor  # [B, T, text_card]
    text_mask: torch.Tensor  # [B, T] bool: positions whose prediction is valid
    audio: torch.Tensor  # [B, dep_q, T, card]
    audio_mask: torch.Tensor  # [B, dep_q, T]


@dataclass
class Loss:
    total: torch.Tensor
    text: torch.Tensor
    audio: torch.Tensor


class OracleLM(nn.Module):
    """The LM and its oracle embedding as one module, so that DDP and peft see every weight."""

    def __init__(self, lm: LMModel, oracle_emb: nn.Embedding) -> None:
        super().__init__()
        self.lm = lm
        self.oracle_emb = oracle_emb

    def forward(self, codes: torch.Tensor, oracle: torch.Tensor) -> Logits:
        """`codes` [B, 1 + n_q, T] not delayed (text, assistant, user), `oracle` [B, T] token ids."""
        lm = self.lm
        initial = lm._get_initial_token().expand(codes.shape[0], -1, -1)
        delayed = torch.cat([initial, _delay_sequence(lm.delays, codes, initial)], dim=2)
        condition = self.oracle_emb(oracle)  # [B, T, dim]: step t's input gets frame t's oracle
        hidden, text_logits = lm.forward_text(delayed[:, :, :-1], condition)
        audio_logits = lm.forward_depformer_training(delayed[:, :, 1:], hidden)
        audio_logits, audio_mask = _undelay_sequence(lm.delays[1:1 + lm.dep_q], audio_logits, float("nan"))
        text_logits, text_mask = _undelay_sequence(lm.delays[:1], text_logits, float("nan"))
        return Logits(text_logits[:, 0], text_mask[:, 0], audio_logits, audio_mask)


def text_loss(logits: Logits, target: torch.Tensor, padding_id: int) -> torch.Tensor:
    """Cross-entropy on the assistant's text stream, padding targets weighted TEXT_PADDING_WEIGHT."""
    weight = torch.where(target == padding_id, TEXT_PADDING_WEIGHT, 1.0) * logits.text_mask
    ce = F.cross_entropy(torch.nan_to_num(logits.text.float()).transpose(1, 2), target, reduction="none")
    return (ce * weight).sum() / weight.sum().clamp(min=1e-6)


def audio_loss(logits: Logits, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the assistant's dep_q codebooks, the semantic one weighted SEMANTIC_WEIGHT."""
    dep_q = target.shape[1]
    per_codebook = torch.ones(dep_q, device=target.device)
    per_codebook[0] = SEMANTIC_WEIGHT
    weight = per_codebook[None, :, None] * logits.audio_mask
    flat = torch.nan_to_num(logits.audio.float()).permute(0, 3, 1, 2)  # [B, card, dep_q, T]
    ce = F.cross_entropy(flat, target, reduction="none")
    return (ce * weight).sum() / weight.sum().clamp(min=1e-6)


def compute_loss(logits: Logits, codes: torch.Tensor, padding_id: int, audio_weight: float = 1.0) -> Loss:
    """Text loss + `audio_weight` x audio loss; `codes` are the model's input codes (the targets,
    not delayed). With `audio_weight` 0 the audio loss is only reported: nothing flows back from it."""
    dep_q = logits.audio.shape[1]
    text = text_loss(logits, codes[:, 0], padding_id)
    audio = audio_loss(logits, codes[:, 1:1 + dep_q])
    if not audio_weight:
        return Loss(text, text, audio.detach())
    return Loss(text + audio_weight * audio, text, audio)


# the LM's parameters that only the audio loss trains: the depformer, its inputs, the audio heads
_AUDIO_HEADS = re.compile(r"(^|\.)lm\.(depformer\w*|linears)\.")


def freeze_audio_heads(model: nn.Module) -> int:
    """Freeze the audio-only parameters (LoRA adapters on them too); how many tensors were frozen."""
    frozen = 0
    for name, p in model.named_parameters():
        if _AUDIO_HEADS.search(name):
            p.requires_grad_(False)
            frozen += 1
    return frozen


def text_accuracy_counts(logits: Logits, target: torch.Tensor, padding_id: int) -> tuple[int, int]:
    """(correct, total) argmax predictions over the non-padding text targets."""
    scored = (target != padding_id) & logits.text_mask
    correct = (logits.text.argmax(-1) == target) & scored
    return int(correct.sum()), int(scored.sum())


def linear_names(lm: nn.Module, prefix: str = "lm.") -> list[str]:
    """The full names of moshi's linear layers: where LoRA adapters go."""
    return [prefix + name for name, module in lm.named_modules() if isinstance(module, nn.Linear)]


def add_lora(model: OracleLM, rank: int) -> nn.Module:
    """LoRA adapters of rank `rank` on every linear layer of the LM (peft); the oracle embedding
    stays trained in full, everything else frozen."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise KameError("--lora-rank needs peft: pip install 'kame-server[train]' (or peft==0.21.2)") from exc

    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=linear_names(model.lm))
    peft_model = get_peft_model(model, config)
    model.oracle_emb.weight.requires_grad_(True)
    return peft_model


def merge_lora(model: nn.Module) -> OracleLM:
    """The plain OracleLM with the adapters merged into its weights (no peft keys left)."""
    if isinstance(model, OracleLM):
        return model
    merged = model.merge_and_unload()
    assert isinstance(merged, OracleLM)
    return merged
