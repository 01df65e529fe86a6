"""The checkpoints users point at, in the layouts of the public repos (kame.testing.hub_layouts):
each loads to exactly the model that the same weights in this project's own layout give, and
where moshi's own loader can read it, to exactly what moshi's loader gives."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from moshi.models import loaders
from moshi.models.loaders import CheckpointInfo

from kame.asr import FinalTranscript
from kame.asr.kyutai_stt import KyutaiSttAsr, SttOptions
from kame.asr.transcribe import transcribe_pcm
from kame.asr.vad import SilenceEndOfTurn
from kame.audio import FRAME_SIZE, read_audio
from kame.errors import FrontendLoadError
from kame.frontend.checkpoint import HubOptions, resolve_repo
from kame.frontend.engine import BatchedEngine
from kame.frontend.loader import inspect_source, load_frontend
from kame.frontend.oracle import OracleUpdate
from kame.frontend.weights import apply_load_hooks, check_against, read_header
from kame.testing import hub_layouts as hub
from kame.testing.hub_layouts import (
    KAME_REPO,
    MOSHIKO_REPO,
    TINY_STT_LM_CONFIG,
    hf_cache_repo,
    kame_repo,
    kyutai_moshi_repo,
    kyutai_stt_repo,
    own_layout,
    random_weights,
)

QUESTION = Path(__file__).parent / "fixtures" / "question.wav"
FRAMES = 20


@pytest.fixture(scope="module")
def speech() -> list[np.ndarray]:
    pcm = read_audio(QUESTION)
    return [pcm[i * FRAME_SIZE:(i + 1) * FRAME_SIZE] for i in range(FRAMES)]


@pytest.fixture(scope="module")
def moshi_weights():
    return random_weights(hub.TINY_LM_CONFIG, seed=3)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, moshi_weights):
    """Kyutai's Moshi repo (fused bf16), KAME repos (split fp32 + oracle, hf:// and file:// names), the
    same weights in our layout, and a hub cache holding the Kyutai and KAME repos."""
    root = tmp_path_factory.mktemp("layouts")
    oracle = torch.randn(moshi_weights.lm_config["text_card"] + 1, moshi_weights.lm_config["dim"],
                         generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    kyutai = kyutai_moshi_repo(root / "kyutai", moshi_weights)
    cache = root / "hub"
    hf_cache_repo(cache, MOSHIKO_REPO, kyutai)
    from_hub = f"hf://{MOSHIKO_REPO}/"
    kame_repo(root / "kame-hf", moshi_weights, oracle, mimi=from_hub + loaders.MIMI_NAME,
              tokenizer=from_hub + loaders.TEXT_TOKENIZER_NAME, mimi_config=from_hub + "mimi_config.json")
    hf_cache_repo(cache, KAME_REPO, root / "kame-hf")
    local = f"file://{kyutai}/"
    kame_file = kame_repo(root / "kame-file", moshi_weights, oracle, mimi=local + loaders.MIMI_NAME,
                          tokenizer=local + loaders.TEXT_TOKENIZER_NAME, mimi_config=local + "mimi_config.json")
    return {"kyutai": kyutai, "kame-file": kame_file, "cache": cache,
            "own": own_layout(root / "own", moshi_weights, oracle),
            "own-plain": own_layout(root / "own-plain", moshi_weights, None)}


@pytest.fixture
def offline_cache(layouts, monkeypatch):
    """huggingface_hub (and so moshi's hf_get) reading the fixture cache, offline, as HF_HUB_OFFLINE=1 does."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(layouts["cache"]))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yield layouts["cache"]
    from huggingface_hub.utils import reset_sessions

    reset_sessions()  # the HTTP sessions made meanwhile stay offline for good (per thread, cached)


def run_engine(frontend, frames) -> tuple[list, np.ndarray]:
    engine = BatchedEngine(frontend, 1)
    try:
        slot = engine.acquire()
        engine.push_oracle(slot, OracleUpdate.reset(0, tuple(range(10, 40))))
        outputs = [engine.step({slot: frame})[0] for frame in frames]
    finally:
        engine.close()
    return [o.text_token for o in outputs], np.stack([o.pcm for o in outputs])


def same_outputs(a, b) -> None:
    assert a[0] == b[0]
    np.testing.assert_array_equal(a[1], b[1])


def test_kyutai_fused_attention_loads_as_the_split_model(layouts, speech):
    kyutai = load_frontend(str(layouts["kyutai"]), "cpu")
    own = load_frontend(str(layouts["own-plain"]), "cpu")
    for key, value in own.lm.state_dict().items():
        torch.testing.assert_close(kyutai.lm.state_dict()[key], value, rtol=0, atol=0, msg=key)
    tokens, pcm = run_engine(kyutai, speech)
    same_outputs((tokens, pcm), run_engine(own, speech))
    assert any(t is not None for t in tokens) and np.abs(pcm).max() > 0


def test_kyutai_repo_through_the_cache_equals_moshis_own_loader(offline_cache, layouts):
    """The repo-id path with HF_HUB_OFFLINE=1 reads the hub cache, and gives moshi's own model."""
    ours = load_frontend(MOSHIKO_REPO, "cpu")
    reference = CheckpointInfo.from_hf_repo(MOSHIKO_REPO).get_moshi(device="cpu", dtype=torch.float32)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(ours.lm.state_dict()[key], value, rtol=0, atol=0, msg=key)
    torch.testing.assert_close(ours.oracle_emb.weight, reference.text_emb.weight, rtol=0, atol=0)


def test_hf_names_resolve_into_another_repo_as_moshi_resolves_them(offline_cache, layouts, speech):
    ours = resolve_repo(KAME_REPO, HubOptions(local_files_only=True))
    moshis = CheckpointInfo.from_hf_repo(KAME_REPO)
    for field in ("moshi_weights", "mimi_weights", "tokenizer", "lora_weights"):
        assert getattr(ours, field) == getattr(moshis, field), field
    for field in ("lm_config", "raw_config", "mimi_config", "model_type", "lm_gen_config", "stt_config",
                  "tts_config", "model_id"):
        assert getattr(ours, field) == getattr(moshis, field), field
    assert "models--kyutai--moshiko-pytorch-bf16" in str(ours.mimi_weights)
    kame = load_frontend(KAME_REPO, "cpu")
    same_outputs(run_engine(kame, speech), run_engine(load_frontend(str(layouts["own"]), "cpu"), speech))


def test_file_names_point_at_local_files(layouts, speech):
    kame = load_frontend(str(layouts["kame-file"]), "cpu")
    same_outputs(run_engine(kame, speech), run_engine(load_frontend(str(layouts["own"]), "cpu"), speech))


def test_a_float32_kame_checkpoint_is_read_into_bf16(layouts, speech):
    kame = load_frontend(str(layouts["kame-file"]), "cpu", dtype=torch.bfloat16)
    own = load_frontend(str(layouts["own"]), "cpu", dtype=torch.bfloat16)
    assert kame.lm.dtype == torch.bfloat16 and kame.oracle_emb.weight.dtype == torch.bfloat16
    same_outputs(run_engine(kame, speech), run_engine(own, speech))


def test_a_snapshot_without_config_is_moshi_7b(tmp_path):
    """A folder of Kyutai's legacy layout (no config.json): moshi's default names and Moshi 7B's
    architecture, its fused full-size header checked key by key (no weight read)."""
    folder = tmp_path / "snapshot"
    hub.sparse_safetensors(folder / loaders.MOSHI_NAME, hub.layout_shapes(None))
    hub.sparse_safetensors(folder / loaders.MIMI_NAME, hub.mimi_shapes())
    (folder / loaders.TEXT_TOKENIZER_NAME).write_bytes(hub.TOKENIZER.read_bytes())
    report = inspect_source(str(folder))
    assert report.info.lm_config is None and report.info.moshi_weights == folder / loaders.MOSHI_NAME
    assert report.dim == 4096 and 7.6e9 < report.params < 7.8e9 and report.fused_attention == 32 + 6
    assert not report.has_oracle and report.file_dtype == "bf16"


@pytest.mark.parametrize("marker", [True, False], ids=["no_exist-marker", "snapshot-only"])
def test_a_cached_repo_without_config_is_moshi_7b_offline(tmp_path, monkeypatch, marker):
    """kyutai/moshiko-pytorch-bf16 has no config.json. Offline, from the hub cache: after a download
    that found none (huggingface_hub's .no_exist marker) or a snapshot of its files alone."""
    from huggingface_hub import constants

    files = tmp_path / "files"
    hub.sparse_safetensors(files / loaders.MOSHI_NAME, hub.layout_shapes(None))
    hub.sparse_safetensors(files / loaders.MIMI_NAME, hub.mimi_shapes())
    (files / loaders.TEXT_TOKENIZER_NAME).write_bytes(hub.TOKENIZER.read_bytes())
    snapshot = hf_cache_repo(tmp_path / "cache", MOSHIKO_REPO, files)
    if marker:
        no_exist = snapshot.parent.parent / ".no_exist" / snapshot.name
        no_exist.mkdir(parents=True)
        (no_exist / "config.json").touch()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    report = inspect_source(MOSHIKO_REPO, local_files_only=None)
    assert report.info.lm_config is None and report.dim == 4096 and report.fused_attention == 38
    assert report.info.moshi_weights == snapshot / loaders.MOSHI_NAME
    with pytest.raises(FrontendLoadError, match="not in the local cache"):  # and a repo not there at all
        inspect_source("kyutai/not-downloaded", local_files_only=None)


def test_the_full_size_kame_header_checks_out(tmp_path):
    """KAME's own layout at full size: split keys, float32, oracle_emb of text_card + 1 rows."""
    shapes = hub.layout_shapes(None, torch.float32, fuse=False)
    shapes[hub.ORACLE_KEY] = ((32001, 4096), torch.float32)
    hub.sparse_safetensors(tmp_path / "model.safetensors", shapes)
    header = read_header(tmp_path / "model.safetensors")
    lm = loaders.get_moshi_lm(None, device="meta", dtype=torch.bfloat16)
    check_against(lm, {k: v for k, v in header.items() if k != hub.ORACLE_KEY}, tmp_path / "model.safetensors")
    assert sum(e.end - e.start for e in header.values()) > 30e9  # ~31 GB: the reported float32 size


def test_quantized_scale_keys_are_split_with_their_weights():
    """moshi's hook splits the `_scb` scales of an int8 (q8) checkpoint as it splits the weights."""
    mha = torch.nn.Module()
    mha.attn = hub.StreamingMultiheadAttention(16, 2, causal=True, context=4, weights_per_step=2, device="meta")
    state = {"attn.in_proj_weight": torch.empty(2 * 48, 16, dtype=torch.int8, device="meta"),
             "attn.in_proj_weight_scb": torch.empty(2 * 48, device="meta")}
    apply_load_hooks(mha, state)
    assert sorted(state) == ["attn.in_projs.0.weight", "attn.in_projs.0.weight_scb",
                             "attn.in_projs.1.weight", "attn.in_projs.1.weight_scb"]
    assert state["attn.in_projs.1.weight_scb"].shape == (48,)


# ---------------------------------------------------------------- Kyutai STT


@pytest.fixture(scope="module")
def stt_layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("stt")
    with_heads = random_weights({**TINY_STT_LM_CONFIG, **hub.EOT_HEADS}, seed=7)
    without = random_weights(TINY_STT_LM_CONFIG, seed=7)
    return {"heads": kyutai_stt_repo(root / "stt-heads", with_heads),
            "plain": kyutai_stt_repo(root / "stt-plain", without),
            "own": own_layout(root / "own", without, None, {"model_type": "stt", "stt_config": hub.STT_CONFIG})}


def transcribe(model: str, pcm: np.ndarray) -> tuple[KyutaiSttAsr, list]:
    asr = KyutaiSttAsr(SttOptions(model=model, device="cpu", max_sessions=1))
    try:
        return asr, asyncio.run(transcribe_pcm(asr, pcm))
    finally:
        asr.close()


def test_kyutai_stt_fused_checkpoint_transcribes_as_the_split_one(stt_layouts):
    pcm = read_audio(QUESTION)
    kyutai, events = transcribe(str(stt_layouts["plain"]), pcm)
    _, own_events = transcribe(str(stt_layouts["own"]), pcm)
    assert events and events == own_events


def test_the_silence_prefix_rounds_up_to_whole_frames(stt_layouts):
    """1.0 s of prefix is 13 frames, as Kyutai's scripts count it (math.ceil(1.0 * 12.5))."""
    frames = 10
    asr, _ = transcribe(str(stt_layouts["plain"]), np.zeros(frames * FRAME_SIZE, np.float32))
    tail = math.ceil(hub.STT_CONFIG["audio_delay_seconds"] * 12.5) + 1
    assert asr.runner.steps == 13 + frames + tail


def test_no_end_of_turn_head_ends_turns_on_a_pause(stt_layouts, caplog):
    """Kyutai STT's layout without an end-of-turn head: the start-up says so once, naming the
    checkpoint, and the engine's end-of-turn signal comes from the pause after the speech (Silero VAD
    on the input), at the frame the rule sets, not during the speech."""
    speech = read_audio(QUESTION)
    pcm = np.concatenate([speech, np.zeros(int(2.0 * 24000), np.float32)])
    with caplog.at_level(logging.WARNING):
        # the pause alone (Smart Turn's part, answered on a thread of its own: tests/test_end_of_turn.py)
        asr = KyutaiSttAsr(SttOptions(model=str(stt_layouts["plain"]), device="cpu", max_sessions=1,
                                      end_of_turn="silence"))
    warnings = [r.message for r in caplog.records if "end-of-turn" in r.message]
    assert len(warnings) == 1 and str(stt_layouts["plain"]) in warnings[0] and asr.end_of_turn == "pause"
    outputs = []
    step = asr.batch.step
    asr.batch.step = lambda frames, timings=None: outputs.extend(step(frames, timings)) or outputs[-len(frames):]
    try:
        asyncio.run(transcribe_pcm(asr, pcm))
    finally:
        asr.close()
    ended = [o.frame for o in outputs if o.end_of_turn == 1.0]
    level = [np.sqrt(np.mean(speech[i:i + FRAME_SIZE] ** 2)) for i in range(0, len(speech), FRAME_SIZE)]
    spoken = 1 + max(i for i, rms in enumerate(level) if rms > 10 ** (-45 / 20))  # the file ends in silence
    speech_end = asr.prefix_frames + spoken  # the engine's frame after the last word
    pause = SilenceEndOfTurn.frames_for(0.6, hub.STT_CONFIG["audio_delay_seconds"], 12.5)
    assert ended and speech_end + pause - 1 <= ended[0] <= speech_end + pause + 2
    assert ended == list(range(ended[0], ended[0] + len(ended)))  # then on until speech comes again


class _ScriptedVad:
    """Silero's ONNX session, stood in: a chunk is speech when it is loud."""

    def run(self, _outputs, feeds):
        loud = float(np.abs(feeds["input"][0, 64:]).mean()) > 0.05
        return np.array([[0.9 if loud else 0.1]], np.float32), feeds["h"], feeds["c"]


def test_the_pause_rule_waits_for_speech_then_for_the_pause():
    rule = SilenceEndOfTurn(_ScriptedVad(), silence_frames=5)
    loud = (np.random.default_rng(0).standard_normal(FRAME_SIZE) * 0.3).astype(np.float32)
    quiet = np.zeros(FRAME_SIZE, np.float32)
    signal = [rule(f) for f in [quiet] * 8 + [loud] * 4 + [quiet] * 8 + [loud] + [quiet] * 2]
    assert signal[:12] == [0.0] * 12  # silence before any speech is no turn's end
    first = signal.index(1.0)
    assert 12 + 4 <= first <= 12 + 6 and signal[first:20] == [1.0] * (20 - first)
    assert signal[20:] == [0.0] * 3  # speech again: the next pause is waited for


def test_a_turn_ends_on_a_frame_without_text_and_only_once(stt_layouts):
    """The stream's side: pieces of a word on frames in a row stay together, the end of turn waits for
    a frame without text, and a pause that goes on does not end an empty turn again."""
    import sentencepiece

    tokenizer = sentencepiece.SentencePieceProcessor(model_file=str(hub.TOKENIZER))
    he, ll, o, wo, n = tokenizer.encode("hello won")[:5]

    frames = [(he, 0.0), (ll, 0.0), (o, 0.0), (None, 0.0), (wo, 1.0), (n, 1.0), (None, 1.0), (None, 1.0)]
    events = _stt_stream_events(tokenizer, frames)
    finals = [e.text for e in events if isinstance(e, FinalTranscript)]
    assert finals == ["hello won"]
    assert [e.text for e in events if not isinstance(e, FinalTranscript)] == ["he", "hell", "hello", "hello wo",
                                                                             "hello won"]


def test_an_end_of_turn_head_is_used_when_the_checkpoint_has_one(stt_layouts, caplog):
    with caplog.at_level(logging.WARNING):
        asr = KyutaiSttAsr(SttOptions(model=str(stt_layouts["heads"]), device="cpu", max_sessions=1))
    asr.close()
    assert asr.end_of_turn == "head" and not [r for r in caplog.records if "end-of-turn" in r.message]


# ---------------------------------------------------------------- memory


def test_loading_holds_one_float32_tensor_at_a_time(tmp_path):
    """A float32 checkpoint read into bf16 peaks at about the bf16 model, not the float32 file plus it."""
    config = {**hub.TINY_LM_CONFIG, "dim": 1024, "num_heads": 8, "num_layers": 8, "text_card": 4000}
    weights = random_weights(config, seed=0, dtype=torch.float32)
    own_layout(tmp_path / "big", weights, None)
    size = (tmp_path / "big" / "model.safetensors").stat().st_size
    assert size > 250e6
    script = textwrap.dedent(f"""
        import torch
        from kame.frontend.loader import load_frontend
        from kame.testing.memory import peak_rss_bytes
        load_frontend("tiny-copy", "cpu", dtype=torch.bfloat16)  # the one-off costs of a first load, paid
        before = peak_rss_bytes()
        load_frontend({str(tmp_path / 'big')!r}, "cpu", dtype=torch.bfloat16)
        print(peak_rss_bytes() - before)
    """)
    grew = int(subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)
               .stdout.split()[-1])
    assert grew < size  # measured: 0.66 of the file (the bf16 model is 0.5); reading it whole first costs 1.55


def test_truncated_and_foreign_files_are_clear_errors(layouts, tmp_path):
    folder = tmp_path / "cut"
    shutil.copytree(layouts["own"], folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(FrontendLoadError, match="do not fit .* truncated download"):
        load_frontend(str(folder), "cpu")


# ---------------------------------------------------------------- config keys


def test_lora_name_is_merged_as_moshis_loader_merges_it(layouts, tmp_path):
    """A base in Kyutai's layout plus LoRA adapters named by lora_name (moshi's LoRALinear keys)."""
    from moshi.modules.lora import replace_all_linear_with_lora
    from safetensors.torch import save_file

    folder = tmp_path / "lora"
    shutil.copytree(layouts["kyutai"], folder)
    lm = loaders.get_moshi_lm(folder / loaders.MOSHI_NAME, lm_kwargs=dict(hub.TINY_LM_CONFIG), device="cpu",
                              dtype=torch.float32)
    replace_all_linear_with_lora(lm, 4, 2.0)
    with torch.no_grad():
        adapters = {k: torch.randn_like(v) * 0.05 for k, v in lm.state_dict().items() if ".lora_" in k}
    save_file(adapters, str(folder / "lora.safetensors"))
    config = {**hub.TINY_LM_CONFIG, "mimi_config_name": "mimi_config.json", "lora": True, "lora_rank": 4,
              "lora_scaling": 2.0, "lora_name": "lora.safetensors", "lm_gen_config": {"use_sampling": False}}
    hub.write_config(folder, config)
    ours = load_frontend(str(folder), "cpu").lm
    kwargs = {k: v for k, v in config.items() if k not in ("mimi_config_name", "lora_name", "lm_gen_config")}
    reference = loaders.get_moshi_lm(folder / loaders.MOSHI_NAME, lm_kwargs=kwargs,
                                     lora_weights=folder / "lora.safetensors", fuse_lora=True, device="cpu",
                                     dtype=torch.float32)
    base = load_frontend(str(layouts["kyutai"]), "cpu").lm.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, msg=key)
    assert not torch.equal(ours.state_dict()["text_linear.weight"], base["text_linear.weight"])  # it did merge


def test_lora_without_its_weights_is_a_clear_error(layouts, tmp_path):
    folder = tmp_path / "half-lora"
    shutil.copytree(layouts["kyutai"], folder)
    hub.write_config(folder, {**hub.TINY_LM_CONFIG, "mimi_config_name": "mimi_config.json", "lora": True})
    with pytest.raises(FrontendLoadError, match="`lora` and `lora_name` go together"):
        load_frontend(str(folder), "cpu")


def test_model_type_and_unused_tables_are_honoured_or_said(layouts, tmp_path, caplog):
    folder = tmp_path / "hibiki"
    shutil.copytree(layouts["kyutai"], folder)
    config = json.loads((folder / "config.json").read_text())
    hub.write_config(folder, {**config, "model_type": "hibiki", "tts_config": {"multistream": False},
                              "stt_config": dict(hub.STT_CONFIG)})
    with caplog.at_level(logging.INFO, logger="kame"):
        frontend = load_frontend(str(folder), "cpu")
    emb = frontend.lm.text_emb.weight
    assert frontend.model_type == "hibiki" and torch.equal(emb[2], emb[3])  # moshi's get_moshi does the same
    said = [r.message for r in caplog.records if r.message.startswith("config.json:")]
    assert any(m.startswith("config.json: tts_config ignored") for m in said)
    assert any(m.startswith("config.json: stt_config ignored") for m in said)
    assert not any("lm_gen_config" in m for m in said)  # the front-end uses it


def test_a_speech_to_text_model_is_refused_as_the_front_end(stt_layouts):
    with pytest.raises(FrontendLoadError, match="is a speech-to-text model .* --asr kyutai-stt"):
        load_frontend(str(stt_layouts["plain"]), "cpu")


def test_inspection_catches_what_loading_would_refuse(layouts, tmp_path):
    """The header-only check (`kame doctor`) says what `load_frontend` would: a bad oracle table, a
    tokenizer that is not one."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bad-oracle"
    shutil.copytree(layouts["own"], folder)
    state = load_file(folder / "model.safetensors")
    state[hub.ORACLE_KEY] = torch.zeros(7, 64)
    save_file(state, str(folder / "model.safetensors"))
    for check in (inspect_source, lambda source: load_frontend(source, "cpu")):
        with pytest.raises(FrontendLoadError, match=r"oracle_emb.weight has shape \(7, 64\)"):
            check(str(folder))
    broken = tmp_path / "broken-tokenizer"
    shutil.copytree(layouts["own"], broken)
    (broken / "tokenizer.model").write_bytes(b"not a model")
    with pytest.raises(FrontendLoadError, match="cannot load the SentencePiece tokenizer"):
        inspect_source(str(broken))


def test_a_pause_in_the_words_settles_them_before_the_end_of_turn(stt_layouts):
    """Kyutai's STT only ever extends its partial: five frames without text (0.4 s) after a word are a pause,
    said once as a settled partial (GPT-Live and Realtime send a partial's newest word only then or at the
    final, which waits for the end-of-turn decision), and the words go on after it."""
    import sentencepiece

    from kame.asr.kyutai_stt import SETTLE_FRAMES

    tokenizer = sentencepiece.SentencePieceProcessor(model_file=str(hub.TOKENIZER))
    hello, won = tokenizer.encode(" hello"), tokenizer.encode(" won")
    frames = ([(t, 0.0) for t in hello] + [(None, 0.0)] * (SETTLE_FRAMES + 3) + [(t, 0.0) for t in won]
              + [(None, 0.0)] * (SETTLE_FRAMES - 1) + [(None, 1.0)])
    events = _stt_stream_events(tokenizer, frames)
    settled = [(e.text, e.end_s) for e in events if getattr(e, "settled", False)]
    assert [text for text, _ in settled] == ["hello"]  # once, not for the pause that the final ended
    finals = [e.text for e in events if isinstance(e, FinalTranscript)]
    assert finals == ["hello won"]


def _stt_stream_events(tokenizer, frames: list[tuple[int | None, float]]) -> list:
    """What a Kyutai STT stream makes of the engine's frames (text token or None, end-of-turn probability),
    its engine stood in for."""
    from types import SimpleNamespace

    from kame.asr.kyutai_stt import KyutaiSttStream, SttFrame

    class Runner:
        async def acquire_async(self, on_output, on_error):
            return SimpleNamespace(push_frame=lambda frame: None, release=lambda: None, dropped_frames=0)

    asr = SimpleNamespace(options=SttOptions(), model=SimpleNamespace(tokenizer=tokenizer), prefix_frames=13,
                          delay_s=0.5, runner=Runner())

    async def scenario():
        stream = KyutaiSttStream(asr)
        for index, (token, end) in enumerate(frames):
            stream._on_output(SttFrame(0, 20 + index, token, end))
        await stream.aclose()
        return [event async for event in stream]

    return asyncio.run(scenario())
