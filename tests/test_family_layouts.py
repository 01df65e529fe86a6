"""The published Moshi-family checkpoints beyond Moshi and KAME, at full size from an offline hub cache (their
headers checked key by key, no weight read): Kyutai's RL post-trained `moshika-rl-seamless` (Moshi's layout)
and `personaplex-rl-seamless` (PersonaPlex's), and J-Moshi (Moshi's layout, a Japanese tokenizer); none has a
config.json here, as moshi's and PersonaPlex's loaders expect of them. What `kame doctor` and `kame serve` say
of each: its family, what KAME runs of it, its licence. The RL repos' exact file lists are not known here (the
hub is out of reach): they are laid out as their bases', which the model cards say they load as."""

from __future__ import annotations

import copy

import pytest
from moshi.models import loaders

from kame.frontend.loader import family, inspect_source
from kame.testing import hub_layouts as hub

from .test_japanese import japanese_tokenizer

PERSONAPLEX_7B = {**copy.deepcopy(loaders._lm_kwargs), "dep_q": 16, "depformer_context": 16}


def cached(tmp_path, monkeypatch, repo_id: str, lm_config: dict | None, tokenizer: bytes):
    """`repo_id` in an offline hub cache: full-size sparse weights in Kyutai's fused layout, Mimi, a tokenizer
    under moshi's default names, no config.json."""
    from huggingface_hub import constants

    files = tmp_path / repo_id.replace("/", "--")
    hub.sparse_safetensors(files / loaders.MOSHI_NAME, hub.layout_shapes(lm_config))
    hub.sparse_safetensors(files / loaders.MIMI_NAME, hub.mimi_shapes())
    (files / loaders.TEXT_TOKENIZER_NAME).write_bytes(tokenizer)
    hub.hf_cache_repo(tmp_path / "cache", repo_id, files)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    report = inspect_source(repo_id, local_files_only=None)
    assert report.info.lm_config is None and report.dim == 4096 and report.file_dtype == "bf16"
    return report, family(report.lm_config, report.has_oracle, report.info.model_type, False, report.language,
                          repo_id)


def test_moshika_rl_seamless_is_moshi_with_its_own_licence(tmp_path, monkeypatch):
    report, kind = cached(tmp_path, monkeypatch, "kyutai/moshika-rl-seamless", None, hub.TOKENIZER.read_bytes())
    assert report.lm_config["dep_q"] == 8 and report.language == "en" and not report.has_oracle
    assert kind.startswith("Moshi (no oracle embedding: initialised from text_emb); kyutai/moshika-rl-seamless: "
                           "Moshi post-trained with RL")
    assert kind.endswith("CC BY-NC 4.0, gated (non-commercial)")


def test_personaplex_rl_seamless_is_personaplex(tmp_path, monkeypatch):
    report, kind = cached(tmp_path, monkeypatch, "kyutai/personaplex-rl-seamless", PERSONAPLEX_7B,
                          hub.TOKENIZER.read_bytes())
    assert report.lm_config["dep_q"] == report.lm_config["n_q"] == 16  # the depformer's steps, from the weights
    assert kind.startswith("PersonaPlex layout") and "no oracle (runs as its reference)" in kind
    assert "kyutai/personaplex-rl-seamless: PersonaPlex post-trained with RL" in kind


def test_j_moshi_is_moshi_7b_with_a_japanese_tokenizer(tmp_path, monkeypatch):
    report, kind = cached(tmp_path, monkeypatch, "nu-dialogue/j-moshi-ext", None,
                          japanese_tokenizer().serialized_model_proto())
    assert report.lm_config["dep_q"] == 8 and report.lm_config["text_card"] == 32000 and report.language == "ja"
    assert kind.startswith("J-Moshi (a Moshi speaking Japanese") and "CC BY-NC 4.0 (non-commercial)" in kind


@pytest.mark.parametrize("source", ["kyutai/moshiko-pytorch-bf16", "SakanaAI/kame", "/some/folder"])
def test_other_sources_get_no_rl_note(source):
    assert "RL" not in family({"dep_q": 8, "n_q": 16}, False, source=source)
