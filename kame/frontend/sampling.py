"""Sampling settings of the front-end LM, global and per slot.

Moshi's `LMGen` samples every slot of a batch with one temperature and one top-k. A session may
ask for its own (the Moshi web client's sliders arrive as query parameters), so the engine keeps
each setting as a per-slot tensor and applies it to the logits itself: moshi is left to sample
from the already shaped distribution (temperature 1, no top-k). The tensors keep their storage
for the engine's life, so the audio path also works inside moshi's CUDA graphs; a session's
settings are written into them in place when it takes its slot.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import torch

TOPK_CAP = 1000  # the largest per-session top-k honoured (0 means no top-k at all)
REPETITION_CONTEXT_CAP = 512  # the most text tokens the repetition penalty looks back on


@dataclass(frozen=True)
class GenerationConfig:
    """Sampling settings of the LM; defaults are Moshi's, overridden by the checkpoint's lm_gen_config."""

    use_sampling: bool = True  # False: argmax, deterministic (tests, tiny models)
    temp: float = 0.8  # audio temperature
    temp_text: float = 0.7  # text temperature
    top_k: int = 250  # audio top-k
    top_k_text: int = 25  # text top-k
    cfg_coef: float = 1.0  # classifier-free guidance; != 1 doubles the batch, oracle included

    @classmethod
    def from_dict(cls, values: Mapping) -> GenerationConfig:
        known = {k: v for k, v in values.items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass(frozen=True)
class Sampling:
    """One slot's sampling, named as the Moshi web client names its query parameters."""

    text_temperature: float = 0.7  # 0: the most likely text token (greedy)
    text_topk: int = 25  # 0: no top-k
    audio_temperature: float = 0.8
    audio_topk: int = 250
    repetition_penalty: float = 1.0  # > 1 lowers text tokens generated in the last `context` tokens
    repetition_penalty_context: int = 64
    pad_mult: float = 0.0  # added to the text padding token's logit: > 0 speaks less, < 0 more

    @classmethod
    def of(cls, gen: GenerationConfig) -> Sampling:
        """The checkpoint's own settings as a slot's default."""
        return cls(text_temperature=gen.temp_text, text_topk=gen.top_k_text,
                   audio_temperature=gen.temp, audio_topk=gen.top_k)

    def updated(self, overrides: Mapping[str, object]) -> Sampling:
        """These settings with `overrides` (query-string values, strings allowed); ValueError naming the bad one."""
        values = {}
        for name, raw in overrides.items():
            field = self.__dataclass_fields__.get(name)
            if field is None:
                raise ValueError(f"unknown sampling setting {name!r}")
            kind = int if field.type == "int" else float
            try:
                value = kind(raw)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{name} must be {'an integer' if kind is int else 'a number'}, not {raw!r}") from exc
            low, high = _RANGES[name]
            if not low <= value <= high:  # NaN fails this too
                raise ValueError(f"{name} must be between {low} and {high}, not {raw}")
            values[name] = value
        return dataclasses.replace(self, **values)

    def as_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


_RANGES: dict[str, tuple[float, float]] = {
    "text_temperature": (0.0, 10.0), "audio_temperature": (0.0, 10.0),
    "text_topk": (0, TOPK_CAP), "audio_topk": (0, TOPK_CAP),
    "repetition_penalty": (1.0, 10.0), "repetition_penalty_context": (0, REPETITION_CONTEXT_CAP),
    "pad_mult": (-100.0, 100.0),
}
SAMPLING_PARAMETERS = tuple(_RANGES)


class SlotSampler:
    """Per-row temperature, top-k, repetition penalty and padding bias, applied to the LM's logits in place.

    Rows are the engine's batch rows; a step may run on the first n rows only, and the logits' batch says
    how many: each per-row tensor is cut to it (a view, so CUDA graphs keep their addresses)."""

    def __init__(self, batch_size: int, device: torch.device, default: Sampling, text_padding_id: int) -> None:
        self.default, self.pad_id = default, text_padding_id
        f32 = {"dtype": torch.float32, "device": device}
        self.text_temp = torch.full((batch_size,), default.text_temperature, **f32)
        self.text_topk = torch.full((batch_size,), default.text_topk, dtype=torch.long, device=device)
        self.audio_temp = torch.full((batch_size,), default.audio_temperature, **f32)
        self.audio_topk = torch.full((batch_size,), default.audio_topk, dtype=torch.long, device=device)
        self.pad_mult = torch.full((batch_size,), default.pad_mult, **f32)
        self.penalty = torch.ones(batch_size, **f32)
        self._settings = [default] * batch_size
        self._recent: list[deque[int]] = [deque(maxlen=REPETITION_CONTEXT_CAP) for _ in range(batch_size)]
        self._penalised: set[int] = set()
        self._biased: set[int] = set()
        self._uniform_text: tuple[float, int] | None = (default.text_temperature, default.text_topk)
        self._uniform_audio: tuple[float, int] | None = (default.audio_temperature, default.audio_topk)

    def set(self, slot: int, sampling: Sampling | None) -> None:
        """The slot's settings from now on (the default when None); its repetition history starts empty."""
        sampling = sampling or self.default
        self._settings[slot] = sampling
        self.text_temp[slot] = sampling.text_temperature
        self.text_topk[slot] = sampling.text_topk
        self.audio_temp[slot] = sampling.audio_temperature
        self.audio_topk[slot] = sampling.audio_topk
        self.pad_mult[slot] = sampling.pad_mult
        self.penalty[slot] = sampling.repetition_penalty
        self._recent[slot].clear()
        penalised = sampling.repetition_penalty != 1.0 and sampling.repetition_penalty_context > 0
        (self._penalised.add if penalised else self._penalised.discard)(slot)
        (self._biased.add if sampling.pad_mult != 0.0 else self._biased.discard)(slot)
        self._uniform_text = _same((s.text_temperature, s.text_topk) for s in self._settings)
        self._uniform_audio = _same((s.audio_temperature, s.audio_topk) for s in self._settings)

    def settings(self, slot: int) -> Sampling:
        return self._settings[slot]

    def move_row(self, source: int, target: int) -> None:
        """Row `source`'s settings and repetition history move to row `target` (the engine's compaction)."""
        self.set(target, self._settings[source])
        self._recent[target].extend(self._recent[source])

    def record_text(self, slot: int, token: int | None) -> None:
        """A text token the slot generated (None: padding); the repetition penalty looks back on them."""
        if token is not None and slot in self._penalised:
            self._recent[slot].append(token)

    def text_logits(self, logits: torch.Tensor) -> tuple[float, int]:
        """Shape the text logits [B, 1, 1, card] in place; the temperature and top-k moshi then samples with.

        When every slot has the same temperature and top-k, moshi's own sampling applies them."""
        rows = logits[:, 0, 0]
        n = rows.shape[0]
        if self._penalised:
            self._apply_penalty(rows)
        if self._biased:
            rows[:, self.pad_id] += self.pad_mult[:n].to(rows.dtype)
        if self._uniform_text is not None:
            return self._uniform_text
        # the text path runs outside CUDA graphs: its top-k search only goes as deep as a slot asks
        deepest = max((1 if s.text_temperature <= 0 else s.text_topk for s in self._settings[:n]), default=1)
        rows.copy_(_shape(rows, self.text_temp[:n], self.text_topk[:n], deepest or TOPK_CAP))
        return 1.0, 0

    def audio_logits(self, logits: torch.Tensor, graphed: bool) -> tuple[torch.Tensor, float, int]:
        """One codebook's depformer logits [B, 1, 1, card], and the temperature and top-k to sample them with.

        `graphed`: inside a CUDA graph, which replays what it captured: always shaped on the device."""
        if not graphed and self._uniform_audio is not None:
            return logits, *self._uniform_audio
        n = logits.shape[0]
        return _shape(logits[:, 0, 0], self.audio_temp[:n], self.audio_topk[:n], TOPK_CAP)[:, None, None], 1.0, 0

    def _apply_penalty(self, rows: torch.Tensor) -> None:
        seen = torch.zeros(rows.shape, dtype=torch.bool)
        for row in self._penalised:
            context = self._settings[row].repetition_penalty_context
            recent = list(self._recent[row])[-context:]
            if recent and row < rows.shape[0]:
                seen[row, recent] = True
        seen = seen.to(rows.device)
        penalty = self.penalty[: rows.shape[0]].to(rows.dtype)[:, None]
        # CTRL's rule: a seen token's positive logit is divided by the penalty, a negative one multiplied
        shaped = torch.where(rows > 0, rows / penalty, rows * penalty)
        rows.copy_(torch.where(seen, shaped, rows))


def _same(values):
    """The one value every item has, or None."""
    distinct = set(values)
    return distinct.pop() if len(distinct) == 1 else None


def _shape(rows: torch.Tensor, temperature: torch.Tensor, topk: torch.Tensor, deepest: int) -> torch.Tensor:
    """Rows [B, card] divided by each row's temperature and cut to its top-k (-inf elsewhere).

    A temperature of 0 keeps the most likely token only; a top-k of 0 keeps every token.
    `deepest`: no row's top-k is larger (a shape, so fixed while a CUDA graph replays it)."""
    greedy = temperature <= 0
    kmax = min(deepest, rows.shape[-1])
    k = torch.where(greedy, torch.ones_like(topk), topk).clamp(max=kmax)
    scaled = rows / torch.where(greedy, torch.ones_like(temperature), temperature).to(rows.dtype)[:, None]
    best = torch.topk(scaled, kmax, dim=-1).values  # [B, kmax], descending
    kth = best.gather(-1, (k.clamp(min=1) - 1)[:, None])
    kth = torch.where((k > 0)[:, None], kth, torch.full_like(kth, float("-inf")))
    return scaled.masked_fill(scaled < kth, float("-inf"))
