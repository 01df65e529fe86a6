"""Named front-end presets shipped with the package: tiny random models and the 7B architecture.

A preset is either a directory inside the package laid out like a Hugging Face repo
(``tiny-copy``) or a set of configs whose weights are drawn at random with a fixed seed
(``tiny`` for plumbing and benchmarks, ``moshi-7b-random`` for GPU benchmarks).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
TINY_COPY_DIR = ASSETS / "tiny-copy"

# A Mimi small enough for a CPU: same frame layout (24 kHz, 1920-sample frames at 12.5 Hz),
# far fewer channels and layers.
TINY_MIMI_CONFIG: dict = {
    "sample_rate": 24000,
    "channels": 1,
    "frame_rate": 12.5,
    "seanet": {
        "channels": 1,
        "dimension": 32,
        "causal": True,
        "n_filters": 4,
        "n_residual_layers": 1,
        "activation": "ELU",
        "compress": 2,
        "dilation_base": 2,
        "disable_norm_outer_blocks": 0,
        "kernel_size": 7,
        "residual_kernel_size": 3,
        "last_kernel_size": 3,
        "norm": "none",
        "pad_mode": "constant",
        "ratios": [8, 6, 5, 4],
        "true_skip": True,
    },
    "quantizer": {
        "dimension": 16,
        "n_q": 8,
        "bins": 64,
        "input_dimension": 32,
        "output_dimension": 32,
    },
    "transformer": {
        "d_model": 32,
        "num_heads": 2,
        "num_layers": 1,
        "causal": True,
        "layer_scale": 0.01,
        "context": 50,
        "conv_layout": True,
        "max_period": 10000,
        "gating": "none",
        "norm": "layer_norm",
        "positional_embedding": "rope",
        "dim_feedforward": 64,
        "input_dimension": 32,
        "output_dimensions": [32],
    },
}

# A Moshi-shaped LM: text stream + 4 generated audio codebooks + 4 user codebooks,
# with Moshi's acoustic delay of one frame on all but the first codebook of each half.
TINY_LM_CONFIG: dict = {
    "dim": 64,
    "text_card": 1000,
    "existing_text_padding_id": 3,
    "n_q": 8,
    "dep_q": 4,
    "card": 64,
    "num_heads": 4,
    "num_layers": 2,
    "hidden_scale": 2,
    "causal": True,
    "layer_scale": None,
    "context": 40,
    "max_period": 10000,
    "gating": "silu",
    "norm": "rms_norm_f32",
    "positional_embedding": "rope",
    "depformer_dim": 32,
    "depformer_dim_feedforward": 64,
    "depformer_num_heads": 2,
    "depformer_num_layers": 1,
    "depformer_layer_scale": None,
    "depformer_multi_linear": True,
    "depformer_context": 4,
    "depformer_max_period": 10000,
    "depformer_gating": "silu",
    "depformer_pos_emb": "none",
    "depformer_weights_per_step": True,
    "delays": [0, 0, 1, 1, 1, 0, 1, 1, 1],
}

# Moshi 7B (moshiko) architecture, as published by Kyutai.
MOSHI_7B_LM_CONFIG: dict = {
    "dim": 4096,
    "text_card": 32000,
    "existing_text_padding_id": 3,
    "n_q": 16,
    "dep_q": 8,
    "card": 2048,
    "num_heads": 32,
    "num_layers": 32,
    "hidden_scale": 4.125,
    "causal": True,
    "layer_scale": None,
    "context": 3000,
    "max_period": 10000,
    "gating": "silu",
    "norm": "rms_norm_f32",
    "positional_embedding": "rope",
    "depformer_dim": 1024,
    "depformer_dim_feedforward": int(4.125 * 1024),
    "depformer_num_heads": 16,
    "depformer_num_layers": 6,
    "depformer_layer_scale": None,
    "depformer_multi_linear": True,
    "depformer_context": 8,
    "depformer_max_period": 10000,
    "depformer_gating": "silu",
    "depformer_pos_emb": "none",
    "depformer_weights_per_step": True,
    "delays": [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1],
}

# Moshi's sampling defaults; the tiny models are deterministic (argmax) so outputs are testable.
MOSHI_GEN_CONFIG: dict = {"temp": 0.8, "temp_text": 0.7, "top_k": 250, "top_k_text": 25}
GREEDY_GEN_CONFIG: dict = {"use_sampling": False}


@dataclass(frozen=True)
class RandomPreset:
    """A front-end whose weights are drawn at random (seeded) from these configs."""

    name: str
    lm_config: dict
    mimi_config: dict | None  # None: Mimi's published config
    lm_gen_config: dict
    tokenizer: Path | None  # None: a synthetic tokenizer is not available, token ids only
    seed: int = 0
    description: str = ""
    stt_config: dict = field(default_factory=dict)

    def lm_kwargs(self) -> dict:
        return copy.deepcopy(self.lm_config)


_TINY = RandomPreset(
    name="tiny",
    lm_config=TINY_LM_CONFIG,
    mimi_config=TINY_MIMI_CONFIG,
    lm_gen_config=GREEDY_GEN_CONFIG,
    tokenizer=TINY_COPY_DIR / "tokenizer.model",
    description="random tiny Moshi + tiny Mimi, for plumbing tests and CPU benchmarks",
)

RANDOM_PRESETS: dict[str, RandomPreset] = {
    "tiny": _TINY,
    # the tiny model's configs, but the engine steps nothing (kame.frontend.engine.NullEngine): the
    # host side of a server (I/O, Opus, ASR feed, planners) measured without a model's compute
    "null": dataclasses.replace(
        _TINY, name="null",
        description="no model compute: each frame's input comes back as its output (for host-side benchmarks)"),
    "moshi-7b-random": RandomPreset(
        name="moshi-7b-random",
        lm_config=MOSHI_7B_LM_CONFIG,
        mimi_config=None,
        lm_gen_config=MOSHI_GEN_CONFIG,
        tokenizer=None,
        description="Moshi 7B architecture with random weights, for GPU benchmarks",
    ),
    # PersonaPlex's layout at 7B (the depformer predicts the user's 8 codebooks too; KAME steps the assistant's
    # 8): a persona's prefill measured at full size (scripts/bench_persona.py, gpu_bench.sh's persona pass)
    "personaplex-7b-random": RandomPreset(
        name="personaplex-7b-random",
        lm_config={**MOSHI_7B_LM_CONFIG, "dep_q": 16, "depformer_context": 16},
        mimi_config=None,
        lm_gen_config=MOSHI_GEN_CONFIG,
        tokenizer=None,
        description="PersonaPlex 7B layout with random weights, for GPU benchmarks of a persona's prefill",
    ),
}

# A Kyutai-STT-shaped model (no depformer, text out, end-of-turn heads) for the kyutai-stt plumbing.
TINY_STT_LM_CONFIG: dict = {
    **{k: v for k, v in TINY_LM_CONFIG.items() if not k.startswith("depformer")},
    "n_q": 4,
    "dep_q": 0,
    "delays": [0, 0, 0, 0, 0],
    "extra_heads_num_heads": 4,
    "extra_heads_dim": 6,
}
RANDOM_PRESETS["tiny-stt"] = RandomPreset(
    name="tiny-stt",
    lm_config=TINY_STT_LM_CONFIG,
    mimi_config=TINY_MIMI_CONFIG,
    lm_gen_config={"use_sampling": False},
    tokenizer=TINY_COPY_DIR / "tokenizer.model",
    description="random tiny speech-to-text model in Kyutai STT's layout, for the kyutai-stt plumbing",
    stt_config={"audio_silence_prefix_seconds": 0.24, "audio_delay_seconds": 0.16},
)

DIRECTORY_PRESETS: dict[str, Path] = {"tiny-copy": TINY_COPY_DIR}

PRESET_NAMES = sorted([*RANDOM_PRESETS, *DIRECTORY_PRESETS])
