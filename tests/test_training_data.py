"""The data stages of training: prepare (timings file or Whisper), oracles (random, llm), tokens."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile
from safetensors import safe_open

from kame.backend.profiles import BackendProfile
from kame.frontend.engine import BatchedEngine
from kame.frontend.oracle import OracleUpdate, oracle_stream, tokenize_words
from kame.testing.openai_server import ScriptedOpenAIServer, ScriptedReply
from kame.training import oracles as oracles_module
from kame.training.dialogues import Word, prepare, read_channels, snap_to_speech
from kame.training.oracles import simulate
from kame.training.runfiles import DataError
from kame.training.tokens import tokenize

ROOT = Path(__file__).resolve().parent.parent
PADDING = 3

# one dialogue, two exchanges, timed by hand (seconds)
TIMINGS = [
    ("what", 0.2, 0.5, "user"), ("color", 0.5, 0.9, "user"), ("is", 0.9, 1.1, "user"), ("the", 1.1, 1.3, "user"),
    ("box", 1.3, 1.6, "user"),
    ("the", 2.0, 2.2, "assistant"), ("box", 2.2, 2.4, "assistant"), ("is", 2.4, 2.5, "assistant"),
    ("crimson", 2.41, 2.9, "assistant"), ("indeed", 2.6, 3.0, "assistant"),
    ("where", 3.2, 3.5, "user"), ("is", 3.5, 3.6, "user"), ("it", 3.6, 3.9, "user"),
    ("in", 4.2, 4.4, "assistant"), ("Paris", 4.4, 4.9, "assistant"),
]


def write_dialogue(folder: Path, name: str = "timed", rate: int = 16000, seconds: float = 5.0,
                   timings: list | None = TIMINGS) -> Path:
    """Quiet noise on both channels (speech is not needed when the timings are given)."""
    folder.mkdir(parents=True, exist_ok=True)
    noise = np.random.default_rng(0).standard_normal((int(rate * seconds), 2)).astype(np.float32) * 0.01
    path = folder / f"{name}.wav"
    soundfile.write(str(path), noise, rate)
    if timings is not None:
        items = [{"word": w, "start": s, "end": e, "speaker": who} for w, s, e, who in timings]
        path.with_suffix(".json").write_text(json.dumps(items[::-1]))  # any order: prepare sorts
    return path


def token_file(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), "pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (a safe_open handle)
        return tensors, handle.metadata()


@pytest.fixture(scope="module")
def timed_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("timed")
    write_dialogue(root / "data")
    prepare(root / "data", root / "run")
    simulate(root / "run", strategy="random", seed=1)
    tokenize(root / "run", frontend="tiny", device="cpu")
    return root / "run"


def test_prepared_turns_from_a_timings_file(timed_run):
    prepared = json.loads((timed_run / "prepared" / "timed.json").read_text())
    assert prepared["timings"] == "file" and prepared["sample_rate"] == 16000 and prepared["duration_s"] == 5.0
    assert [w["start"] for w in prepared["words"]] == sorted(s for _, s, _, _ in TIMINGS)
    assert [(t["speaker"], t["start"], t["end"], t["text"]) for t in prepared["turns"]] == [
        ("user", 0.2, 1.6, "what color is the box"), ("assistant", 2.0, 3.0, "the box is crimson indeed"),
        ("user", 3.2, 3.9, "where is it"), ("assistant", 4.2, 4.9, "in Paris")]


def test_oracle_events_every_half_second_of_the_user_turn(timed_run):
    oracles = json.loads((timed_run / "oracles" / "timed.json").read_text())
    events = [(e["time"], e["frame"], e["turn"], e["last_of_turn"], e["tier"], e["text"]) for e in oracles["events"]]
    # one dialogue: the random replies are its other assistant turn
    assert events == [
        (0.7, 8, 1, False, "random", "in Paris"), (1.2, 15, 1, False, "random", "in Paris"),
        (1.6, 20, 1, True, "full", "the box is crimson indeed"),
        (3.7, 46, 3, False, "random", "the box is crimson indeed"), (3.9, 48, 3, True, "full", "in Paris")]


def test_text_stream_and_oracle_tokens_at_their_frames(timed_run, tiny):
    tensors, metadata = token_file(timed_run / "tokens" / "timed.safetensors")
    meta = json.loads(metadata["kame"])
    frames = 63  # 5 s at 24 kHz is 62.5 frames of 1920 samples
    assert meta["frames"] == frames and tensors["text"].shape == (frames,)
    crimson, indeed = tiny.tokenizer.encode("crimson"), tiny.tokenizer.encode("indeed")
    expected = {25: 261, 27: 500, 28: 348, 30: 278, 52: 270, 55: 293, 56: 370, 57: 420}
    expected |= {31 + i: t for i, t in enumerate(crimson)}  # pushed a frame: "is" holds frame 30
    expected |= {31 + len(crimson) + i: t for i, t in enumerate(indeed)}  # right after "crimson"
    assert tensors["text"].tolist() == [expected.get(f, PADDING) for f in range(frames)]
    box, paris = tokenize_words(tiny.tokenizer, "the box is crimson indeed"), tokenize_words(tiny.tokenizer, "in Paris")
    assert meta["oracle_events"] == [[8, paris, False], [15, paris, False], [20, box, True], [46, box, False],
                                     [48, paris, True]]


def test_the_training_oracle_stream_is_what_the_engine_feeds(timed_run, tiny):
    """The same resets at the same frames: the engine's oracle token of each frame equals
    `oracle_stream`'s (a later, shorter oracle hides the tail of an earlier one in both)."""
    _, metadata = token_file(timed_run / "tokens" / "timed.safetensors")
    meta = json.loads(metadata["kame"])
    events = [(frame, tuple(tokens)) for frame, tokens, _ in meta["oracle_events"]]
    events += [(30, (7, 8, 9, 10, 11, 12, 13, 14)), (32, (15,)), (32, (16, 17)), (60, ())]  # short after long
    lm = tiny.lm
    stream = oracle_stream(events, meta["frames"], start_token=lm.text_initial_token_id,
                           padding_token=lm.text_padding_token_id)
    engine = BatchedEngine(tiny, batch_size=2)
    try:
        quiet, guided = engine.acquire(), engine.acquire()
        fed, silence = [], np.zeros(1920, dtype=np.float32)
        for frame in range(meta["frames"]):
            for epoch, (at, tokens) in enumerate(events):
                if at == frame:
                    engine.push_oracle(guided, OracleUpdate.reset(epoch, tokens))
            outputs = {out.slot: out for out in engine.step({quiet: silence, guided: silence})}
            assert outputs[quiet].oracle_token == lm.text_padding_token_id
            fed.append(outputs[guided].oracle_token)
    finally:
        engine.close()
    assert fed == stream
    assert stream[30:40] == [lm.text_initial_token_id, 7, lm.text_initial_token_id, 16, 17] + [PADDING] * 5


def test_each_sides_codes_come_from_its_own_channel(tmp_path):
    """With a Mimi that tells sounds apart (the presets' encodes everything to code 0): a side's codes
    vary in its own turns and hold Mimi's silence code in the other side's."""
    from kame.testing.dialogues import make_dialogues
    from kame.testing.mimi import tiny_with_calibrated_mimi

    paths = make_dialogues(tmp_path / "data", 2, seed=5)
    run = tmp_path / "run"
    prepare(tmp_path / "data", run, device="cpu")
    simulate(run)
    tokenize(run, frontend=str(tiny_with_calibrated_mimi(tmp_path / "frontend")), device="cpu")
    turns = 0
    for path in paths:
        prepared = json.loads((run / "prepared" / f"{path.stem}.json").read_text())
        tensors, _ = token_file(run / "tokens" / f"{path.stem}.safetensors")
        for turn in prepared["turns"]:
            first, last = int(turn["start"] * 12.5) + 2, int(turn["end"] * 12.5)  # past the onset
            speaking, silent = ("user_codes", "assistant_codes")[:: 1 if turn["speaker"] == "user" else -1]
            assert len(set(tensors[speaking][0, first:last].tolist())) >= 5, (path.name, turn)
            assert len(set(tensors[silent][0, first:last].tolist())) <= 2, (path.name, turn)
            turns += 1
    assert turns >= 4


def test_whisper_dialogues_tokenized_with_tiny_and_a_rerun_does_nothing(tmp_path):
    from kame.testing.dialogues import dialogue_exchanges, make_dialogues

    paths = make_dialogues(tmp_path / "data", 3, seed=5)
    run = tmp_path / "run"
    prepare(tmp_path / "data", run, device="cpu", workers=2)  # two Whisper processes, as on any 2-core CPU
    prepare(tmp_path / "data", tmp_path / "one", device="cpu", workers=1)  # the same words from one process
    for path in paths:
        assert (run / "prepared" / f"{path.stem}.json").read_text() == \
            (tmp_path / "one" / "prepared" / f"{path.stem}.json").read_text()
    simulate(run)
    tokenize(run, frontend="tiny", device="cpu")
    recovered = 0
    for index, path in enumerate(paths):
        prepared = json.loads((run / "prepared" / f"{path.stem}.json").read_text())
        assert prepared["timings"] == "whisper" and prepared["sample_rate"] == 22050
        assert [t["speaker"] for t in prepared["turns"]][:2] == ["user", "assistant"]
        said = " ".join(w["word"] for w in prepared["words"] if w["speaker"] == "assistant").lower()
        channels, _ = read_channels(path)
        for channel, turn in zip(channels, prepared["turns"], strict=False):  # the first words start with the voice
            onset = int(np.argmax(np.abs(channel) > 0.01)) / 22050
            assert abs(turn["start"] - onset) < 0.1, (path.name, turn, onset)
        keys = [e.key.lower() for e in dialogue_exchanges(5, index)]
        recovered += sum(key in said for key in keys)
        tensors, metadata = token_file(run / "tokens" / f"{path.stem}.safetensors")
        meta = json.loads(metadata["kame"])
        frames = -(-round(soundfile.info(str(path)).frames * 24000 / 22050) // 1920)
        assert meta["frames"] == frames and meta["name"] == path.stem
        assert meta["frontend"] == {"text_card": 1000, "padding_id": 3, "n_q": 8, "dep_q": 4, "card": 64}
        for key in ("user_codes", "assistant_codes"):
            assert tensors[key].shape == (4, frames) and str(tensors[key].dtype) == "torch.int16"
        assert tensors["text"].shape == (frames,) and str(tensors["text"].dtype) == "torch.int32"
        assert (tensors["text"] != PADDING).any() and meta["oracle_events"][-1][2] is True
    assert recovered >= 3  # of at least 3 answer words (one or two exchanges each)
    manifest = json.loads((run / "tokens" / "manifest.json").read_text())
    assert manifest == {"frontend": "tiny", "frontend_config": meta["frontend"],
                        "dialogues": [p.stem for p in paths]}

    outputs = [p for stage in ("prepared", "oracles", "tokens") for p in (run / stage).iterdir() if p.is_file()]
    before = {p: p.stat().st_mtime_ns for p in outputs}
    prepare(tmp_path / "data", run, device="cpu")
    simulate(run)
    tokenize(run, frontend="tiny", device="cpu")
    assert {p: p.stat().st_mtime_ns for p in outputs} == before
    (run / "tokens" / f"{paths[1].stem}.safetensors").unlink()
    tokenize(run, frontend="tiny", device="cpu")
    changed = [p.name for p in outputs if p.stat().st_mtime_ns != before[p]]
    assert sorted(changed) == sorted([f"{paths[1].stem}.safetensors", "manifest.json"])


def test_word_starts_snap_to_the_first_speech_inside_them():
    rate = 16000
    pcm = np.zeros(2 * rate, dtype=np.float32)
    pcm[rate // 2: rate] = np.random.default_rng(0).standard_normal(rate // 2) * 0.1
    words = [Word("early", 0.0, 0.8, "user"), Word("inside", 0.6, 0.9, "user"), Word("quiet", 1.2, 1.5, "user")]
    assert snap_to_speech(words, pcm, rate) == [
        Word("early", 0.5, 0.8, "user"), Word("inside", 0.6, 0.9, "user"), Word("quiet", 1.2, 1.5, "user")]


def _mono(folder: Path) -> Path:
    path = folder / "mono.wav"
    soundfile.write(str(path), np.full(16000, 0.1, dtype=np.float32), 16000)
    return path


def _silent_right(folder: Path) -> Path:
    path = folder / "quiet.wav"
    audio = np.zeros((16000, 2), dtype=np.float32)
    audio[:, 0] = 0.1
    soundfile.write(str(path), audio, 16000)
    return path


def _garbage(folder: Path) -> Path:
    path = folder / "broken.wav"
    path.write_bytes(b"RIFF but not really a wave file" * 10)
    return path


def _bad_json(folder: Path) -> Path:
    path = write_dialogue(folder, "badjson", timings=None)
    path.with_suffix(".json").write_text('[{"word": "hi", "start": 0.1,')
    return path


def _bad_speaker(folder: Path) -> Path:
    path = write_dialogue(folder, "badspeaker", timings=[("hi", 0.1, 0.3, "bob")])
    return path


def _late_word(folder: Path) -> Path:
    return write_dialogue(folder, "late", seconds=1.0, timings=[("hi", 0.1, 3.0, "user")])


@pytest.mark.parametrize(("make", "message"), [
    (_mono, "1 channel(s); a dialogue needs two"),
    (_silent_right, "the right (assistant) channel is silent"),
    (_garbage, "cannot read it as audio"),
    (_bad_json, "cannot read it as JSON"),
    (_bad_speaker, "item 0: speaker must be 'user' or 'assistant'"),
    (_late_word, "item 0: ends at 3.0 s, after the audio"),
])
def test_bad_dialogues_are_named_in_one_line_errors(tmp_path, make, message):
    (tmp_path / "data").mkdir()
    path = make(tmp_path / "data")
    with pytest.raises(DataError, match=re.escape(message)) as error:
        prepare(tmp_path / "data", tmp_path / "run")
    assert path.name in str(error.value) or path.with_suffix(".json").name in str(error.value)
    assert "\n" not in str(error.value)


def test_a_bad_dialogue_among_many_is_named_by_the_worker_that_found_it(tmp_path):
    from kame.testing.dialogues import make_dialogues

    make_dialogues(tmp_path / "data", 2, seed=5)
    bad = _silent_right(tmp_path / "data")
    with pytest.raises(DataError, match="the right \\(assistant\\) channel is silent") as error:
        prepare(tmp_path / "data", tmp_path / "run", device="cpu", workers=2)
    assert bad.name in str(error.value)


def test_prepare_workers_one_per_core_on_a_cpu_one_on_a_gpu(monkeypatch):
    from kame.training import dialogues

    monkeypatch.setattr(dialogues.os, "cpu_count", lambda: 8)
    assert dialogues.prepare_workers("cpu", 100) == 4  # at most 4
    assert dialogues.prepare_workers("cpu", 3) == 3  # never more than the dialogues
    assert dialogues.prepare_workers("cpu", 0) == 1
    assert dialogues.prepare_workers("cuda", 100) == 1
    assert dialogues.prepare_workers("cpu", 100, workers=6) == 6


def test_the_cli_stages_in_a_subprocess(tmp_path):
    write_dialogue(tmp_path / "data")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def kame(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kame.cli", *args], capture_output=True, text=True, env=env,
                              timeout=120)

    run = str(tmp_path / "run")
    assert kame("data", "prepare", "--data", str(tmp_path / "data"), "--run", run).stdout.startswith("prepared: 1")
    assert kame("data", "oracles", "--run", run).stdout.startswith("oracles: 1")
    tokens = kame("data", "tokenize", "--run", run, "--frontend", "tiny", "--device", "cpu")
    assert tokens.stdout.startswith("tokens: 1")
    assert (tmp_path / "run" / "tokens" / "timed.safetensors").is_file()
    _mono(tmp_path / "data")
    failed = kame("data", "prepare", "--data", str(tmp_path / "data"), "--run", run)
    assert failed.returncode == 2 and "mono.wav" in failed.stderr and "Traceback" not in failed.stderr
    assert kame("data", "oracles", "--run", run, "--strategy", "random", "--llm", "openai").returncode == 2


# ------------------------------------------------------------------ llm oracles


def tiered_reply(body: dict) -> ScriptedReply:
    """Says which hint it was given, so that the test can see the tier of every request."""
    system = body["messages"][0]["content"]
    if "Your reply mentions:" in system:
        return ScriptedReply(text="keywords answer")
    if "Your reply begins with:" in system:
        return ScriptedReply(text="more answer")
    return ScriptedReply(text="plain answer")


@pytest.fixture
def scripted():
    failures = [ScriptedReply(status=500)]  # the first request fails once, then is retried

    def script(body: dict) -> ScriptedReply:
        return failures.pop() if failures else tiered_reply(body)

    server = ScriptedOpenAIServer(script)
    server.start_in_thread()
    yield server
    server.stop_thread()


def test_llm_oracles_tiers_cache_and_retry(tmp_path, scripted, monkeypatch):
    monkeypatch.setattr(oracles_module, "BACKOFF_S", 0.01)
    timings = [("tell", 0.0, 0.5, "user"), ("me", 0.5, 1.0, "user"), ("a", 1.0, 1.5, "user"),
               ("color", 1.5, 2.0, "user"), ("please", 2.0, 4.0, "user"),
               ("it", 4.2, 4.4, "assistant"), ("is", 4.4, 4.6, "assistant"), ("crimson", 4.6, 5.0, "assistant"),
               ("today", 5.0, 5.5, "assistant")]
    write_dialogue(tmp_path / "data", seconds=6.0, timings=timings)
    run = tmp_path / "run"
    prepare(tmp_path / "data", run)
    profiles = {"scripted": BackendProfile("scripted", scripted.base_url, "scripted", None)}
    simulate(run, strategy="llm", llm="scripted", profiles=profiles, concurrency=2)

    events = json.loads((run / "oracles" / "timed.json").read_text())["events"]
    # a 4 s user turn: events at 0.5 ... 3.5 s (12.5 % ... 87.5 % heard), and at its end
    assert [(e["time"], e["tier"], e["text"]) for e in events] == [
        (0.5, "none", "plain answer"), (1.0, "none", "plain answer"), (1.5, "none", "plain answer"),
        (2.0, "none", "plain answer"), (2.5, "keywords", "keywords answer"), (3.0, "more", "more answer"),
        (3.5, "more", "more answer"), (4.0, "full", "it is crimson today")]
    assert all(e["turn"] == 1 for e in events) and [e["last_of_turn"] for e in events] == [False] * 7 + [True]
    bodies = scripted.requests
    # 6 distinct requests (the full tier is the true reply itself; 3.0 s and 3.5 s ask the same), one of
    # which failed once and was retried
    assert len(bodies) == 6 + 1
    users = sorted({b["messages"][-1]["content"] for b in bodies})
    assert users == ["tell", "tell me", "tell me a", "tell me a color"]  # the words heard so far
    hints = {b["messages"][0]["content"].split("\n", 1)[-1] for b in bodies if "\n" in b["messages"][0]["content"]}
    assert hints == {"Your reply mentions: crimson, today.", "Your reply begins with: it is"}

    simulate(run, strategy="llm", llm="scripted", profiles=profiles)  # nothing to do
    (run / "oracles" / "timed.json").unlink()
    simulate(run, strategy="llm", llm="scripted", profiles=profiles)  # every request from the cache
    assert len(scripted.requests) == 7
    assert json.loads((run / "oracles" / "timed.json").read_text())["events"] == events


def test_llm_oracles_give_up_with_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(oracles_module, "BACKOFF_S", 0.01)
    write_dialogue(tmp_path / "data")
    prepare(tmp_path / "data", tmp_path / "run")
    server = ScriptedOpenAIServer(lambda body: ScriptedReply(status=503))
    server.start_in_thread()
    try:
        profiles = {"down": BackendProfile("down", server.base_url, "scripted", None)}
        with pytest.raises(DataError, match=r"LLM 'down' failed: .*HTTP 503"):
            simulate(tmp_path / "run", strategy="llm", llm="down", profiles=profiles, concurrency=1)
        assert len(server.requests) >= oracles_module.RETRIES
    finally:
        server.stop_thread()
    with pytest.raises(DataError, match="unknown LLM profile 'nope'"):
        simulate(tmp_path / "run", strategy="llm", llm="nope")
