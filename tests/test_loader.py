"""Loading front-ends from presets, local directories and a Hugging Face cache; clear errors."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kame.errors import FrontendLoadError
from kame.frontend.loader import ORACLE_KEY, load_frontend
from kame.frontend.presets import TINY_COPY_DIR
from kame.testing.hub_layouts import hf_cache_repo

from .server_harness import free_port


@pytest.fixture
def repo_dir(tmp_path: Path) -> Path:
    """A copy of the tiny-copy preset: a directory in the KAME hub layout, with mimi_config_name."""
    target = tmp_path / "kame-local"
    shutil.copytree(TINY_COPY_DIR, target)
    return target


def rewrite_weights(repo: Path, edit) -> None:
    state = load_file(repo / "model.safetensors")
    edit(state)
    save_file(state, repo / "model.safetensors")


def test_local_directory_loads_like_the_preset(repo_dir, tiny_copy):
    assert json.loads((repo_dir / "config.json").read_text())["mimi_config_name"] == "mimi_config.json"
    local = load_frontend(str(repo_dir), "cpu")
    torch.testing.assert_close(local.oracle_emb.weight, tiny_copy.oracle_emb.weight)
    assert not torch.equal(local.oracle_emb.weight, local.lm.text_emb.weight)  # a trained oracle table
    assert local.lm.dtype == torch.float32 and local.tokenizer.vocab_size() == 1000
    assert local.mimi.frame_size == 1920 and local.lm_gen_config == {"use_sampling": False}


def test_plain_moshi_checkpoint_gets_oracle_from_text_emb(repo_dir, caplog):
    rewrite_weights(repo_dir, lambda state: state.pop(ORACLE_KEY))
    with caplog.at_level(logging.INFO, logger="kame.frontend.loader"):
        frontend = load_frontend(str(repo_dir), "cpu")
    torch.testing.assert_close(frontend.oracle_emb.weight, frontend.lm.text_emb.weight)
    assert any("initialised from text_emb" in r.message for r in caplog.records)


def test_requested_dtype_is_used(repo_dir):
    frontend = load_frontend(str(repo_dir), "cpu", dtype=torch.bfloat16)
    assert frontend.lm.dtype == torch.bfloat16 and frontend.oracle_emb.weight.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.update({"bogus.weight": torch.zeros(2)}), "keys the LM does not know: bogus.weight"),
        (lambda s: s.pop("text_linear.weight"), "lacks 1 LM weights, e.g. text_linear.weight"),
        (lambda s: s.update({"text_linear.weight": torch.zeros(5, 5)}), r"text_linear.weight has shape \(5, 5\)"),
        (lambda s: s.update({ORACLE_KEY: torch.zeros(7, 64)}), r"oracle_emb.weight has shape \(7, 64\)"),
    ],
)
def test_bad_weights_name_the_file_and_the_problem(repo_dir, edit, message):
    rewrite_weights(repo_dir, edit)
    with pytest.raises(FrontendLoadError, match=message) as info:
        load_frontend(str(repo_dir), "cpu")
    assert "model.safetensors" in str(info.value)


def test_missing_files_and_bad_config(repo_dir):
    (repo_dir / "mimi.safetensors").unlink()
    with pytest.raises(FrontendLoadError, match=r"missing .*mimi.safetensors \(named by 'mimi_name'"):
        load_frontend(str(repo_dir), "cpu")
    (repo_dir / "config.json").write_text("{not json")
    with pytest.raises(FrontendLoadError, match="config.json is not valid JSON"):
        load_frontend(str(repo_dir), "cpu")
    (repo_dir / "config.json").unlink()  # a folder without one is a Moshi 7B snapshot, as moshi assumes
    with pytest.raises(FrontendLoadError, match=r"missing .*tokenizer-e351c8d8-checkpoint125.safetensors "
                                                r"\(named by 'mimi_name' in .*no config.json: Moshi 7B defaults"):
        load_frontend(str(repo_dir), "cpu")


def test_corrupt_weights_and_tokenizer(repo_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(repo_dir, broken)
    (broken / "tokenizer.model").write_bytes(b"garbage")
    with pytest.raises(FrontendLoadError, match="SentencePiece tokenizer"):
        load_frontend(str(broken), "cpu")
    (repo_dir / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(FrontendLoadError, match="cannot read .*model.safetensors as safetensors"):
        load_frontend(str(repo_dir), "cpu")


def test_config_that_does_not_fit_moshi(repo_dir):
    config = json.loads((repo_dir / "config.json").read_text())
    config["no_such_kwarg"] = 1
    (repo_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(FrontendLoadError, match="not valid for moshi's LMModel"):
        load_frontend(str(repo_dir), "cpu")


def test_unknown_source():
    with pytest.raises(FrontendLoadError, match="neither a preset"):
        load_frontend("no-such-thing", "cpu")


def test_hub_repo_id_resolves_through_huggingface_hub(tmp_path):
    hf_cache_repo(tmp_path / "hub", "SakanaAI/kame", TINY_COPY_DIR)
    frontend = load_frontend("SakanaAI/kame", "cpu", hf_cache_dir=tmp_path / "hub", local_files_only=True)
    assert frontend.source == "SakanaAI/kame" and frontend.lm.text_card == 1000


def test_offline_hub_gives_a_clear_error(tmp_path):
    with pytest.raises(FrontendLoadError, match="tiny-copy"):
        load_frontend("SakanaAI/kame", "cpu", hf_cache_dir=tmp_path / "empty", local_files_only=True)


def test_unreachable_hub_gives_a_clear_error(tmp_path, monkeypatch):
    """huggingface_hub's own retries run (5, then the error); their waits (1+2+4+8+8 s) are skipped."""
    import types

    from huggingface_hub.utils import _http

    # huggingface_hub keeps an HTTP session per thread, made offline for good if offline mode was on
    # when it was made (another test's, here): a fresh one, so that this test asks the port
    _http.reset_sessions()
    waits: list[float] = []
    monkeypatch.setattr(_http, "time", types.SimpleNamespace(sleep=waits.append))
    port = free_port()  # a loopback port with nobody listening
    with pytest.raises(FrontendLoadError, match="unreachable") as info:
        load_frontend("SakanaAI/kame", "cpu", hf_cache_dir=tmp_path / "empty", local_files_only=False,
                      hf_endpoint=f"http://127.0.0.1:{port}")
    assert "config.json" in str(info.value) and "tiny-copy" in str(info.value)
    assert len(waits) == 5  # the hub was asked again and again before the error


def test_cuda_request_without_gpu_is_clear():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(FrontendLoadError, match="no CUDA GPU"):
        load_frontend("tiny", "cuda")


def test_int8_on_a_cpu_is_refused_before_anything_loads():
    with pytest.raises(FrontendLoadError, match="--quantize int8 runs on a CUDA GPU only"):
        load_frontend("SakanaAI/kame", "cpu", quantize="int8")  # no download is tried first
    with pytest.raises(FrontendLoadError, match="quantize must be one of int8"):
        load_frontend("tiny", "cpu", quantize="int4")


def test_int8_quantization_replaces_every_linear_layer_of_the_lm(repo_dir, monkeypatch):
    """The layer walk, on a CPU: moshi's QLinear (bitsandbytes, CUDA) stood in by a recording double."""
    import moshi.utils.quantize as quantize
    from torch import nn

    from kame.frontend import loader

    class FakeQLinear(nn.Module):
        def __init__(self, linear: nn.Linear) -> None:
            super().__init__()
            assert linear.bias is None  # moshi's QLinear refuses biases: every LM linear has none
            self.weight = nn.Parameter(linear.weight.detach().to(torch.int8), requires_grad=False)

    monkeypatch.setattr(quantize, "QLinear", FakeQLinear)
    frontend = load_frontend(str(repo_dir), "cpu")
    linears = sum(isinstance(m, nn.Linear) for m in frontend.lm.modules())
    assert linears > 10
    loader._quantize_int8(frontend, torch.device("cpu"))
    assert not any(isinstance(m, nn.Linear) for m in frontend.lm.modules())
    assert sum(isinstance(m, FakeQLinear) for m in frontend.lm.modules()) == linears
    assert frontend.quantize == "int8"
