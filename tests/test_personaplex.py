"""PersonaPlex's layout (NVIDIA/personaplex: a Moshi whose depformer predicts the user's 8 codebooks after the
assistant's, dep_q 16) through KAME's loader and batched engine, against what NVIDIA's own code produced.

The fixture (tests/fixtures/personaplex-tiny, made by scripts/make_personaplex_fixture.py with personaplex's
LMModel and LMGen, random weights) holds the weights in personaplex's own key layout (fused attention keys) and
the reference's greedy frames for a conversation: KAME steps the assistant's 8 codebooks only, takes the user's
from the input (moshi 0.2.13's LMGen on dep_q 16 would take none) and adds nothing of an oracle (the checkpoint
has none): its tokens equal the reference's, frame for frame, one call earlier (personaplex's LMGen returns each
frame a call later than moshi's), with another session stepping beside it in the batch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from moshi.models import loaders
from safetensors.torch import save_file

from kame.frontend import weights
from kame.frontend.engine import BatchedEngine, PromptFrame
from kame.frontend.loader import load_frontend
from kame.frontend.presets import TINY_COPY_DIR
from kame.frontend.sampling import GenerationConfig

FIXTURE = Path(__file__).parent / "fixtures" / "personaplex-tiny"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())
SILENCE = (948, 243, 1178, 546, 1736, 1030, 1978, 2008)  # the reference's codes of silence (the assistant's)...
SINE = (430, 1268, 381, 1611, 1095, 1495, 56, 472)  # ...and of a 440 Hz tone (the user's), during its prompts
PAD = 3


def checkpoint(root: Path, config: dict) -> Path:
    """A folder as a hub repo lays it out: the fixture's LM, a random Mimi of 8 codebooks of the LM's card (the
    test feeds codes, Mimi only has to load), the tiny tokenizer, config.json with the tiny LM's `config`."""
    root.mkdir()
    shutil.copy(FIXTURE / "model.safetensors", root / "model.safetensors")
    mimi_config = json.loads((TINY_COPY_DIR / "mimi_config.json").read_text())
    mimi_config["quantizer"]["bins"] = REFERENCE["lm_kwargs"]["card"]
    (root / "mimi_config.json").write_text(json.dumps(mimi_config))
    torch.manual_seed(0)
    mimi = loaders.get_mimi(None, mimi_config, num_codebooks=8)
    save_file(mimi.state_dict(), root / "mimi.safetensors")
    shutil.copy(TINY_COPY_DIR / "tokenizer.model", root / "tokenizer.model")
    config = config | {"moshi_name": "model.safetensors", "mimi_name": "mimi.safetensors",
                       "tokenizer_name": "tokenizer.model", "mimi_config_name": "mimi_config.json"}
    (root / "config.json").write_text(json.dumps(config))
    return root


def run(frontend, user: list[list[int]], beside: list[list[int]] | None = None) -> list[list[int]]:
    """Our engine's frames (text token and the assistant's 8 codebooks) for the user's codes, greedy; `beside`:
    another session's codes in the same batch."""
    engine = BatchedEngine(frontend, batch_size=2, gen=GenerationConfig(use_sampling=False))
    first = engine.acquire()
    second = engine.acquire() if beside is not None else None
    frames: list[list[int]] = []
    codes: dict[int, list[int]] = {}

    def encode(pcm, mask):
        batch = torch.zeros(pcm.shape[0], 8, 1, dtype=torch.long)
        for slot, values in codes.items():
            batch[engine._rows.row(slot), :, 0] = torch.tensor(values)
        return batch

    def decode(tokens, ready):
        frames.append(tokens[engine._rows.row(first), :, 0].tolist())
        return torch.zeros(tokens.shape[0], 1920)

    engine._encode, engine._decode = encode, decode
    try:
        for t, values in enumerate(user):
            codes = {first: values} | ({second: beside[t]} if second is not None else {})
            frames_before = len(frames)
            engine.step({slot: np.zeros(1920, np.float32) for slot in codes})
            if len(frames) == frames_before:  # no row's audio ready yet: the frame's tokens are not decoded
                frames.append(None)
    finally:
        engine.close()
    return frames


@pytest.fixture(scope="module")
def frontend(tmp_path_factory):
    return load_frontend(str(checkpoint(tmp_path_factory.mktemp("pp") / "repo", REFERENCE["lm_kwargs"])),
                         device="cpu", dtype=torch.float32)


def test_the_fixture_is_in_personaplex_s_own_layout():
    header = weights.read_header(FIXTURE / "model.safetensors")
    assert "transformer.layers.0.self_attn.in_proj_weight" in header  # fused, as NVIDIA's checkpoint stores it
    assert "depformer_in.15.weight" in header and "linears.15.weight" in header  # 16 depformer steps
    assert REFERENCE["lm_kwargs"]["dep_q"] == 16 and REFERENCE["lm_kwargs"]["n_q"] == 16


def test_kame_steps_the_assistant_as_the_reference_does_with_a_session_beside_it(frontend):
    assert frontend.lm.dep_q == 8 and frontend.lm.predicted_q == 16  # the user's 8 come from the user
    assert frontend.oracle_emb is None  # no oracle table: nothing of an oracle goes into its input
    assert frontend.mimi.num_codebooks == 8
    assert "PersonaPlex layout" in frontend.family and "no oracle" in frontend.family  # what serve and doctor say
    user = REFERENCE["user_codes"]
    expected = REFERENCE["plain"][1:]  # personaplex's LMGen returns each frame one call later than moshi's
    beside = [list(reversed(values)) for values in user]
    for ours in (run(frontend, user), run(frontend, user, beside)):
        compared = [(t, ours[t], expected[t]) for t in range(len(expected)) if ours[t] is not None]
        assert len(compared) >= len(expected) - 2  # every frame once the acoustic delay has passed
        assert all(a == b for _, a, b in compared), next((t, a, b) for t, a, b in compared if a != b)


def test_without_config_json_the_weights_say_it_is_personaplex(tmp_path):
    """PersonaPlex's loader reads no config.json: with none (or an empty one) KAME takes the 7B's
    hyperparameters and counts the depformer's steps in the weights (checked on the header, no weight read)."""
    from kame.frontend.loader import preset_from_weights

    header = weights.read_header(FIXTURE / "model.safetensors")
    kwargs = preset_from_weights(header, FIXTURE / "model.safetensors")
    assert kwargs["dep_q"] == 16 and kwargs["n_q"] == 16 and kwargs["dim"] == 4096
    plain = {k: v for k, v in header.items() if not k.startswith(("depformer_in.", "linears.", "depformer_emb."))
             or int(k.split(".")[1]) < 8}
    assert preset_from_weights(plain, FIXTURE / "model.safetensors")["dep_q"] == 8  # Moshi's own 8


class Batch:
    """Our engine, greedy, with the user's codes given for each slot (Mimi bypassed) and each slot's frames
    (text token and the assistant's 8 codebooks) kept."""

    def __init__(self, frontend) -> None:
        self.engine = BatchedEngine(frontend, batch_size=2, gen=GenerationConfig(use_sampling=False))
        self.codes: dict[int, list[int]] = {}
        self.frames: dict[int, list] = {}
        self.engine._encode, self.engine._decode = self._encode, self._decode

    def _encode(self, pcm, mask):
        batch = torch.zeros(pcm.shape[0], 8, 1, dtype=torch.long)
        for slot, values in self.codes.items():
            batch[self.engine._rows.row(slot), :, 0] = torch.tensor(values)
        return batch

    def _decode(self, tokens, ready):
        for slot in self.codes:
            self.frames.setdefault(slot, []).append(tokens[self.engine._rows.row(slot), :, 0].tolist())
        return torch.zeros(tokens.shape[0], 1920)

    def step(self, codes: dict[int, list[int]]) -> None:
        self.codes = codes
        self.engine.step({slot: np.zeros(1920, np.float32) for slot in codes})


def test_a_persona_prompt_prefilled_beside_a_talking_session_equals_the_reference(frontend):
    """The prompt as PersonaPlex runs it (the voice's codes, 6 frames of silence, the role text's tokens one a
    frame, 6 of silence; the user's stream a tone throughout), prefilled for one slot while another session is
    mid-conversation: the conversation after it equals the reference's frame for frame, and the other
    session's frames are those it has with no prefill beside it."""
    prompt = ([PromptFrame(PAD, tuple(codes), SINE) for codes in REFERENCE["voice_codes"]]
              + [PromptFrame(PAD, SILENCE, SINE)] * REFERENCE["silence_frames"]
              + [PromptFrame(token, SILENCE, SINE) for token in REFERENCE["text_prompt"]]
              + [PromptFrame(PAD, SILENCE, SINE)] * REFERENCE["silence_frames"])
    user = REFERENCE["user_codes"]
    other = [list(reversed(values)) for values in user]

    def conversation(with_prompt: bool) -> tuple[list, list]:
        batch = Batch(frontend)
        try:
            talking = batch.engine.acquire()
            for values in other[:10]:  # the other session talks first
                batch.step({talking: values})
            slot = batch.engine.acquire()
            if with_prompt:
                batch.engine.prefill(slot, prompt)
            for t, values in enumerate(user):
                batch.step({talking: other[(10 + t) % len(other)], slot: values})
        finally:
            batch.engine.close()
        return batch.frames[slot], batch.frames[talking]

    prompted, beside = conversation(True)
    _, alone = conversation(False)
    expected = REFERENCE["prompted"][1:]  # one call earlier than personaplex's LMGen, as above
    assert prompted[: len(expected)] == expected and len(expected) == len(user) - 1
    assert prompted[: len(expected)] != REFERENCE["plain"][1:]  # the prompt shaped what followed
    assert beside == alone


def test_the_runner_prefills_a_persona_between_the_steps_of_a_talking_session(frontend):
    """On the engine's thread (EngineRunner): a session talks; another is acquired with a persona's prompt, which
    is stepped in the time the talking one's steps leave; its handle comes once the prompt is in, and its
    conversation then equals the reference's; the talking session's frames are those it has with nobody beside
    it."""
    import threading
    import time

    from kame.frontend.runner import EngineRunner

    prompt = ([PromptFrame(PAD, tuple(codes), SINE) for codes in REFERENCE["voice_codes"]]
              + [PromptFrame(PAD, SILENCE, SINE)] * REFERENCE["silence_frames"]
              + [PromptFrame(token, SILENCE, SINE) for token in REFERENCE["text_prompt"]]
              + [PromptFrame(PAD, SILENCE, SINE)] * REFERENCE["silence_frames"])
    user = REFERENCE["user_codes"]
    other = [list(reversed(values)) for values in user] * 2

    def frame(codes: list[int]) -> np.ndarray:  # the codes ride in the frame's first samples (Mimi bypassed)
        pcm = np.zeros(1920, np.float32)
        pcm[:8] = codes
        return pcm

    def run(with_persona: bool | None) -> dict[int, list]:
        """The talking session's and (unless None) the other's frames, by slot."""
        engine = BatchedEngine(frontend, batch_size=2, gen=GenerationConfig(use_sampling=False))
        tokens: dict[int, list] = {}

        def decode(batch, ready):
            for slot in list(engine._active):
                if bool(ready[engine._rows.row(slot)]):
                    tokens.setdefault(slot, []).append(batch[engine._rows.row(slot), :, 0].tolist())
            return torch.zeros(batch.shape[0], 1920)

        engine._encode = lambda pcm, mask: pcm[:, :, :8].round().long().transpose(1, 2)
        engine._decode = decode
        runner = EngineRunner(engine, clock="eager", batch_window_s=0.0).start()
        came = threading.Semaphore(0)
        try:
            talking = runner.acquire(lambda out: None, live=False)  # faster than real time: none skipped
            talker = threading.Thread(target=lambda: [(talking.push_frame(frame(c)), time.sleep(0.02)) for c in other])
            talker.start()
            time.sleep(0.1)
            if with_persona is not None:
                handle = runner.acquire(lambda out: came.release(), timeout=60,
                                        prompt=prompt if with_persona else ())
                for codes in user:  # one frame, then its output, as a live session's would come
                    handle.push_frame(frame(codes))
                    assert came.acquire(timeout=10)
            talker.join()
            time.sleep(0.2)
        finally:
            runner.stop()
            engine.close()
        return tokens

    prompted = run(True)
    alone = run(None)
    expected = REFERENCE["prompted"][1:]
    assert prompted[1][: len(expected)] == expected  # slot 1: the persona's
    assert prompted[0] == alone[0] and len(alone[0]) == len(other) - 1  # slot 0: the talking session's


def test_a_prompt_is_stepped_only_where_it_fits_before_the_next_step():
    """The runner's rule for a persona's prompt: while sessions talk, only the prompt frames whose measured cost
    (with a margin) fits in the time left before their next step; the first, to measure it, in half a frame's
    slack; while the engine is idle, half a frame's worth (a session may come); a cost measured high fades; an
    engine with no slack at all still steps a frame a second (the prompt goes on, the session does not wait
    forever)."""
    from types import SimpleNamespace

    from kame.frontend.runner import PREFILL_CHUNK, PREFILL_MARGIN, PREFILL_STARVED_S, EngineRunner

    runner = EngineRunner(SimpleNamespace(), frame_s=0.08)
    assert runner._prefill_budget(None, now=0.0) == 1  # idle, cost not measured: one frame measures it
    assert runner._prefill_budget(0.03, now=0.0) == 0 and runner._prefill_budget(0.05, now=0.0) == 1  # not measured yet
    runner._prefill_frame_s = 0.01
    assert runner._prefill_budget(None, now=0.0) == int(0.04 / (0.01 * PREFILL_MARGIN))  # idle: half a frame's worth
    assert runner._prefill_budget(0.01 * PREFILL_MARGIN * 3 + 1e-6, now=0.0) == 3
    assert runner._prefill_budget(0.01, now=0.0) == 0  # one frame, but not with its margin
    assert runner._prefill_budget(10.0, now=0.0) == PREFILL_CHUNK
    runner._prefill_frame_s = 0.05  # measured high once: in half a frame's slack it fades until a frame fits
    fades = 0
    while runner._prefill_budget(0.06, now=0.0) == 0:
        fades += 1
    assert fades == 5 and runner._prefill_frame_s <= 0.06 / PREFILL_MARGIN  # 0.05 x 0.9^5
    runner._prefill_frame_s = 0.01  # steps that leave no slack: a frame after PREFILL_STARVED_S without one
    assert runner._prefill_budget(0.005, now=100.0) == 0
    assert runner._prefill_budget(0.005, now=100.0 + PREFILL_STARVED_S / 2) == 0
    assert runner._prefill_budget(0.005, now=100.0 + PREFILL_STARVED_S) == 1
    assert runner._prefill_budget(0.005, now=100.0 + PREFILL_STARVED_S + 0.1) == 0  # and the wait starts again


def test_a_persona_session_over_api_chat_beside_a_plain_one(tmp_path, caplog):
    """PersonaPlex's own query (`/api/chat?text_prompt=...&voice_prompt=NAME.pt`) on a server whose front-end is
    the PersonaPlex-layout fixture, its voices in the checkpoint's voices/ folder (the reference-made voice.pt as
    TINY0.pt): the persona (role text and voice) is prefilled and the session talks, beside a session without
    one; an unknown voice is refused naming the voices there are, a path refused as a path."""
    import asyncio
    import logging

    from client.client import AudioMessage, KameClient, ServerRefused

    from .server_harness import running_server

    folder = checkpoint(tmp_path / "repo", REFERENCE["lm_kwargs"])
    (folder / "voices").mkdir()
    shutil.copy(FIXTURE / "voice.pt", folder / "voices" / "TINY0.pt")

    async def session(url: str, options: dict) -> int:
        client = await KameClient.connect(url + "/api/chat", events=False, audio="pcm", options=options)
        heard = 0
        try:
            for _ in range(15):
                await client.send_pcm(np.zeros(1920, np.float32))
                await asyncio.sleep(0.08)
            async with asyncio.timeout(10):
                async for message in client:
                    heard += isinstance(message, AudioMessage)
                    if heard >= 5:
                        break
        finally:
            await client.close()
        return heard

    async def both(url: str) -> list:
        persona = {"text_prompt": "You are a patient teacher.", "voice_prompt": "TINY0.pt"}
        return await asyncio.gather(session(url, persona), session(url, {}))

    async def refused(url: str, voice: str) -> str:
        with pytest.raises(ServerRefused) as refusal:
            await KameClient.connect(url + "/api/chat", options={"text_prompt": "x", "voice_prompt": voice})
        return str(refusal.value)

    with caplog.at_level(logging.INFO, logger="kame.frontend.runner"), \
            running_server(frontend=str(folder), asr="none", max_sessions=2) as (url, _):
        heard = asyncio.run(both(url))
        unknown = asyncio.run(refused(url, "NATF0.pt"))
        path = asyncio.run(refused(url, "../repo/voices/TINY0.pt"))
    assert heard == [5, 5]
    assert any("persona's prompt" in r.getMessage() and "prefilled" in r.getMessage() for r in caplog.records)
    assert "'NATF0.pt': no such voice; there are: TINY0.pt" in unknown
    assert "a voice is named, not a path" in path


def test_a_pt_voice_replayed_beside_a_talking_session_equals_the_reference(frontend):
    """A voice given as PersonaPlex's `.pt` (the fixture's voice.pt, saved by the reference's own stepping of the
    voice codes): KAME steps the LM on its embeddings, puts the cache's tokens back at the voice's last frame,
    then the silence, the role text and the conversation; its frames equal the reference's run from the same
    .pt (`prompted_from_embeddings`), frame for frame, with another session talking in the batch."""
    from kame.frontend.persona import embedding_frames
    from kame.frontend.voices import read_voice

    lm = frontend.lm
    voice = read_voice(FIXTURE / "voice.pt", lm.dim, lm.num_codebooks)
    assert voice.frames == len(REFERENCE["voice_codes"])
    quiet = [PromptFrame(PAD, SILENCE, SINE)] * REFERENCE["silence_frames"]
    prompt = (embedding_frames(voice, tuple(lm.delays)) + quiet
              + [PromptFrame(token, SILENCE, SINE) for token in REFERENCE["text_prompt"]] + quiet)
    batch = Batch(frontend)
    try:
        talker, slot = batch.engine.acquire(), batch.engine.acquire()
        for values in REFERENCE["user_codes"][:3]:
            batch.step({talker: values})
        batch.engine.prefill(slot, prompt, 0, 5)  # in parts, between the other session's steps
        batch.step({talker: REFERENCE["user_codes"][3]})
        batch.engine.prefill(slot, prompt, 5)
        for t, values in enumerate(REFERENCE["user_codes"]):
            batch.step({slot: values, talker: REFERENCE["user_codes"][(t + 4) % len(REFERENCE["user_codes"])]})
    finally:
        batch.engine.close()
    expected = REFERENCE["prompted_from_embeddings"][1:]  # one call earlier than personaplex's LMGen, as above
    assert batch.frames[slot][: len(expected)] == expected
    assert REFERENCE["prompted_from_embeddings"] == REFERENCE["prompted"]  # the reference's .pt is its codes' run


def test_voices_are_named_checked_and_unpacked_from_voices_tgz(tmp_path, frontend, monkeypatch):
    import tarfile

    monkeypatch.setenv("KAME_CACHE", str(tmp_path / "cache"))  # where voices.tgz is unpacked

    from kame.errors import SessionError
    from kame.frontend.voices import VoiceLibrary, voices_folder

    lm = frontend.lm
    archive = tmp_path / "ckpt" / "voices.tgz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(FIXTURE / "voice.pt", arcname="voices/NATF2.pt")
        tar.add(FIXTURE / "config.json", arcname="voices/../../escape.pt")  # a member reaching out: kept inside
        tar.add(FIXTURE / "README.md", arcname="voices/notes.txt")  # not a voice: left out
    folder = voices_folder(None, archive.parent)
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == ["NATF2.pt", "escape.pt"]
    assert not (tmp_path / "escape.pt").exists()
    library = VoiceLibrary(folder)
    assert library.voice("NATF2", lm.dim, lm.num_codebooks).frames == len(REFERENCE["voice_codes"])
    assert voices_folder(None, archive.parent) == folder  # unpacked once
    with pytest.raises(SessionError, match="not a PersonaPlex voice file"):
        library.voice("escape.pt", lm.dim, lm.num_codebooks)
    with pytest.raises(SessionError, match=r"embeddings of shape \(4, 1, 1, 16\), not \[steps, 1, 1, 32\]"):
        VoiceLibrary(folder).voice("NATF2.pt", 32, lm.num_codebooks)
    with pytest.raises(SessionError, match="voices given as audio files are not served yet"):
        library.voice("mine.wav", lm.dim, lm.num_codebooks)
    with pytest.raises(SessionError, match="this front-end has no voices"):
        VoiceLibrary(None).voice("NATF2.pt", lm.dim, lm.num_codebooks)
    assert voices_folder(tmp_path / "mine", archive.parent) == tmp_path / "mine"  # the configured folder wins


def test_a_front_end_without_a_persona_says_so():
    from types import SimpleNamespace

    from kame.errors import SessionError
    from kame.frontend.persona import persona_prompt

    plain = SimpleNamespace(lm=SimpleNamespace(dep_q=8, n_q=16), source="tiny-copy", tokenizer=None)
    assert persona_prompt(plain, None) == [] and persona_prompt(plain, "  ") == []
    with pytest.raises(SessionError, match="takes no persona"):
        persona_prompt(plain, "You are a pirate.")


def test_kame_is_trained_on_a_personaplex_base_with_an_oracle_of_its_own(tmp_path):
    """A PersonaPlex base has no oracle table: training KAME's oracle on it starts one as a copy of text_emb."""
    from kame.training.train import build_model

    base = load_frontend(str(checkpoint(tmp_path / "repo", REFERENCE["lm_kwargs"])), device="cpu",
                         dtype=torch.float32)
    assert base.oracle_emb is None
    model = build_model(base, lora_rank=None)
    assert base.oracle_emb is not None and base.oracle_emb.weight.requires_grad
    torch.testing.assert_close(base.oracle_emb.weight, base.lm.text_emb.weight)
    assert any(parameter is base.oracle_emb.weight for parameter in model.parameters())


def test_sampling_defaults_are_the_references_and_each_session_may_have_its_own(frontend):
    """PersonaPlex's reference samples audio at temperature 0.8 with top-k 250 and text at 0.7 with top-k 25; a
    checkpoint that names no lm_gen_config (PersonaPlex's has no config.json at all) gets exactly those, and a
    session's own (the query's text_temperature, ...) go to its row alone."""
    from kame.frontend.sampling import Sampling

    engine = BatchedEngine(frontend, batch_size=2)
    try:
        default = engine.sampler.default
        assert (default.audio_temperature, default.audio_topk, default.text_temperature, default.text_topk) == (
            0.8, 250, 0.7, 25)
        own = default.updated({"text_temperature": "0.3", "audio_topk": "50"})
        a, b = engine.acquire(sampling=own), engine.acquire()
        rows = engine._rows.row(a), engine._rows.row(b)
        assert [float(engine.sampler.text_temp[r]) for r in rows] == pytest.approx([0.3, 0.7])
        assert [int(engine.sampler.audio_topk[r]) for r in rows] == [50, 250]
    finally:
        engine.close()
    assert Sampling() == default


def test_a_hub_personaplex_gets_its_voices_tgz_from_the_hub_cache(tmp_path, frontend, monkeypatch):
    """A PersonaPlex-layout front-end named by its hub repo, whose voices.tgz is in the hub cache but not beside the
    weights the loader read: the server fetches it through huggingface_hub (offline here: the cache) and unpacks
    it; a Moshi-layout front-end never asks for one."""
    import tarfile
    from types import SimpleNamespace

    from huggingface_hub import constants

    from kame.frontend.voices import frontend_voices
    from kame.testing.hub_layouts import hf_cache_repo

    files = tmp_path / "files"
    files.mkdir()
    with tarfile.open(files / "voices.tgz", "w:gz") as tar:
        tar.add(FIXTURE / "voice.pt", arcname="voices/NATM1.pt")
    hf_cache_repo(tmp_path / "hub", "nvidia/personaplex-7b-v1", files)
    from huggingface_hub.utils import reset_sessions

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("KAME_CACHE", str(tmp_path / "cache"))
    try:
        hub = SimpleNamespace(lm=frontend.lm, source="nvidia/personaplex-7b-v1", folder=tmp_path / "weights-only")
        folder = frontend_voices(None, hub)
        assert folder is not None and (folder / "NATM1.pt").is_file()
        plain = SimpleNamespace(lm=SimpleNamespace(predicted_q=None), source="nvidia/personaplex-7b-v1", folder=None)
        assert frontend_voices(None, plain) is None
        missing = SimpleNamespace(lm=frontend.lm, source="nvidia/not-cached", folder=None)
        assert frontend_voices(None, missing) is None  # offline and not cached: no voices, said in the log
    finally:
        reset_sessions()  # the HTTP sessions made meanwhile stay offline for good (per thread, cached)


def test_a_malformed_voice_or_archive_is_an_error_not_a_crash(tmp_path, frontend, monkeypatch, caplog):
    """A .pt of other shapes of data, and a voices.tgz that is not an archive: a session's clear refusal, and a
    server that starts without voices (said in the log) instead of not starting."""
    import logging

    from kame.errors import SessionError
    from kame.frontend.voices import VoiceLibrary, voices_folder

    monkeypatch.setenv("KAME_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "voices"
    folder.mkdir()
    torch.save({"embeddings": [1, 2], "cache": 3}, folder / "LISTS.pt")
    with pytest.raises(SessionError, match="no 'embeddings' and 'cache' tensors"):
        VoiceLibrary(folder).voice("LISTS.pt", frontend.lm.dim, frontend.lm.num_codebooks)
    checkpoint_dir = tmp_path / "ckpt"
    checkpoint_dir.mkdir()
    (checkpoint_dir / "voices.tgz").write_bytes(b"not a tar archive")
    with caplog.at_level(logging.WARNING, logger="kame.frontend.voices"):
        assert voices_folder(None, checkpoint_dir) is None
    assert any("cannot unpack" in r.getMessage() for r in caplog.records)
