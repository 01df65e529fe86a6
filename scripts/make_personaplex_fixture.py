"""Make tests/fixtures/personaplex-tiny: a tiny PersonaPlex-layout LM built and run by NVIDIA/personaplex's own
model code (random weights), and what its reference generator produced with it, for tests/test_personaplex.py.

    git clone https://github.com/NVIDIA/personaplex /tmp/personaplex   # the reference (MIT), any recent commit
    python scripts/make_personaplex_fixture.py --personaplex /tmp/personaplex --out tests/fixtures/personaplex-tiny

PersonaPlex's package is also named `moshi`, so the reference runs in a child process with its folder first on
sys.path (this project's moshi 0.2.13 never loads there). What is written:

- `model.safetensors`: the LM's state dict as personaplex's LMModel names it (fused attention keys
  `self_attn.in_proj_weight`, a 16-step depformer), bfloat16; the runs below used exactly these values (in float32).
- `config.json`: the LMModel kwargs of the tiny model, in moshi's config.json format (a real PersonaPlex checkpoint
  needs none: its loader hard-codes the 7B's), naming the files of the folder.
- `reference.json`: the user's codes fed frame by frame and, for each call of the reference's `LMGen.step`
  (greedy), the frame it returned (text token, the assistant's 8 codebooks; null for the first two calls):
  `plain` (the conversation from the first frame) and `prompted` (voice prompt codes, 6 frames of silence, the
  text prompt's tokens one a frame, 6 of silence, then the conversation, as `step_system_prompts` runs them),
  and `prompted_from_embeddings`: the same prompt with the voice given as a `.pt` (below) instead of codes.
- `voice.pt`: the voice codes as the reference saves a voice prompt's embeddings (`save_voice_prompt_embeddings`:
  the summed input embeddings of each step after the first, and the token cache at the end), the format of the
  `.pt` voices in PersonaPlex's voices.tgz.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

FRAMES = 40  # conversation frames of each run (the tiny model's context, 100, is not reached: no ring wrap)
VOICE_FRAMES = 5
TEXT_PROMPT = [1, 17, 42, 99, 5, 250, 7]  # token ids of the tiny vocabulary (the reference wraps nothing itself)
TINY = {"dim": 16, "num_heads": 2, "num_layers": 2, "hidden_scale": 2, "context": 100, "text_card": 1000,
        "depformer_dim": 16, "depformer_num_heads": 2, "depformer_num_layers": 1, "depformer_dim_feedforward": 32}
SEED = 20261207

CHILD = r"""
import json, sys
import torch
from safetensors.torch import save_file
from moshi.models import loaders
from moshi.models.lm import LMModel, LMGen

out, frames, voice_frames, text_prompt, tiny, seed = sys.argv[1], *map(json.loads, sys.argv[2:7])
torch.manual_seed(seed)
kwargs = {**loaders._lm_kwargs, "dep_q": 16, **tiny}
lm = LMModel(device="cpu", dtype=torch.float32, **kwargs).eval()
with torch.no_grad():  # the values the fixture stores (bf16), as float32: both sides run these
    for p in lm.parameters():
        p.copy_(p.to(torch.bfloat16).to(torch.float32))
save_file({k: v.to(torch.bfloat16).contiguous() for k, v in lm.state_dict().items()}, out + "/model.safetensors")
generator = torch.Generator().manual_seed(seed + 1)
user = torch.randint(0, kwargs["card"], (frames, 8), generator=generator)
voice = torch.randint(0, kwargs["card"], (voice_frames, 8), generator=generator)

def run(prompted):
    gen = LMGen(lm, device="cpu", use_sampling=False, sample_rate=24000, frame_rate=12.5,
                audio_silence_frame_cnt=6, text_prompt_tokens=text_prompt if prompted else None)
    gen.streaming_forever(1)
    gen.reset_streaming()
    outputs = []
    with torch.no_grad():
        if prompted:
            for codes in voice:
                gen._step_voice_prompt_frame(codes.view(1, 8, 1))
            gen.step_system_prompts(None)  # no voice prompt of its own: silence, text, silence (Mimi unused)
        for codes in user:
            tokens = gen.step(input_tokens=codes.view(1, 8, 1))
            outputs.append(None if tokens is None else tokens[0, :9, 0].tolist())
    return outputs

def save_voice():
    # the reference's voice embeddings of the voice codes, as its _step_voice_prompt_core saves them for a WAV
    gen = LMGen(lm, device="cpu", use_sampling=False, sample_rate=24000, frame_rate=12.5,
                save_voice_prompt_embeddings=True)
    gen.streaming_forever(1)
    gen.reset_streaming()
    saved = []
    with torch.no_grad():
        for codes in voice:
            gen._step_voice_prompt_frame(codes.view(1, 8, 1), saved)
    torch.save({"embeddings": torch.stack(saved, dim=0).detach().cpu(), "cache": gen._streaming_state.cache.clone()},
               out + "/voice.pt")

def run_from_embeddings():
    # the prompt with the voice given as its .pt (load_voice_prompt_embeddings: replayed, its cache restored)
    gen = LMGen(lm, device="cpu", use_sampling=False, sample_rate=24000, frame_rate=12.5,
                audio_silence_frame_cnt=6, text_prompt_tokens=text_prompt)
    gen.streaming_forever(1)
    gen.reset_streaming()
    gen.load_voice_prompt_embeddings(out + "/voice.pt")
    outputs = []
    with torch.no_grad():
        gen.step_system_prompts(None)
        for codes in user:
            tokens = gen.step(input_tokens=codes.view(1, 8, 1))
            outputs.append(None if tokens is None else tokens[0, :9, 0].tolist())
    return outputs

plain, prompted = run(False), run(True)
save_voice()
json.dump({"lm_kwargs": kwargs, "user_codes": user.tolist(), "voice_codes": voice.tolist(),
           "text_prompt": text_prompt, "silence_frames": 6, "plain": plain, "prompted": prompted,
           "prompted_from_embeddings": run_from_embeddings()}, open(out + "/reference.json", "w"))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--personaplex", type=Path, required=True, help="a checkout of NVIDIA/personaplex")
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/personaplex-tiny"))
    args = parser.parse_args()
    package = args.personaplex / "moshi"
    if not (package / "moshi" / "models" / "lm.py").is_file():
        sys.exit(f"{package}/moshi/models/lm.py not found: --personaplex is a checkout of NVIDIA/personaplex")
    args.out.mkdir(parents=True, exist_ok=True)
    out = str(args.out.resolve())
    code = f"import sys; sys.path.insert(0, {str(package.resolve())!r})\n" + CHILD
    subprocess.run([sys.executable, "-c", code, out, *(json.dumps(v) for v in
                                                    (FRAMES, VOICE_FRAMES, TEXT_PROMPT, TINY, SEED))], check=True)
    reference = json.loads((args.out / "reference.json").read_text())
    config = dict(reference["lm_kwargs"], moshi_name="model.safetensors")
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {args.out}: model.safetensors, config.json, reference.json "
          f"({len(reference['plain'])} + {len(reference['prompted'])} reference frames)")


if __name__ == "__main__":
    main()
