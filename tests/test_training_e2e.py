"""`kame train` with its defaults, from piper-spoken dialogue WAVs (no transcripts) to a checkpoint
that `kame infer` and `kame serve` run: the whole recipe on a CPU (slow: about 3 minutes on a quiet
2-core machine, 7 when it is shared).

120 dialogues, not 25: on 25 (2 held out) the tiny model learns its 23 training dialogues by heart
and reads no oracle (measured: 0.0 points); on 120 (12 held out) the gain was +13.3 points (+13.3
and +14.1 with seeds 1 and 2; 1500 steps, the old default, gave +8.0 to +11.8) on the audio piper
spoke before its noise was seeded; on the seeded audio it is +10.0 (13 of 130 held-out tokens, on one
torch thread and on two): the bar exactly, now the same every run."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from client.client import KameClient
from tests.server_harness import Recording, received_samples, record, running_server, stream_realtime, wait_until

ROOT = Path(__file__).resolve().parents[1]
DIALOGUES = 120
HANG_LIMIT_S = 1200  # `kame train` with its defaults on these short dialogues: 3 minutes on a quiet 2-core CPU

# hang guards, not speed bounds: the run takes 3 minutes here when quiet, 7 shared, and over 10 on a machine
# running other work (clean-clone run 9 of issue 53); its time is a figure (docs/training.md)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(HANG_LIMIT_S + 300)]


def speak_ahead(seed: int, count: int) -> None:
    """Fill the speech cache `make_dialogues` reads with every sentence of its `count` dialogues, two
    processes at a time: each sentence is still spoken by a freshly loaded voice, as `speech` does,
    so the WAVs are the same; on a cold cache (88 sentences, ~1 s of voice loading each) this halves
    the wait on 2 cores, on a warm one it finds everything there."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from kame.testing.dialogues import dialogue_exchanges, tts_cache
    from kame.testing.speech import cached_path, speech

    texts = sorted({text for index in range(count) for item in dialogue_exchanges(seed, index)
                    for text in (item.question, item.answer)})
    missing = [t for t in texts if not cached_path(t, tts_cache()).exists()]
    if len(missing) < 4:  # starting two processes would cost more than speaking these here
        return
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(speech, missing, [tts_cache()] * len(missing)))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, float]:
    from kame.testing.dialogues import make_dialogues

    root = tmp_path_factory.mktemp("e2e")
    speak_ahead(0, DIALOGUES)
    make_dialogues(root / "data", DIALOGUES, seed=0)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "kame.cli", "train", "--data", str(root / "data"), "--frontend", "tiny",
         "--out", str(root / "run"), "--oracles", "random", "--device", "cpu"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=HANG_LIMIT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "oracle gain:" in done.stdout and "checkpoint:" in done.stdout
    return root / "run", time.monotonic() - start


def test_defaults_run_every_stage_and_the_loss_falls(run):
    folder, seconds = run
    print(f"kame train with its defaults: {seconds:.0f} s")  # a figure, not a bound (a busy machine stretches it)
    rows = [json.loads(line) for line in (folder / "train" / "log.jsonl").read_text().splitlines()]
    assert rows[-1]["text_loss"] < 0.5 * rows[0]["text_loss"]
    assert len(json.loads((folder / "tokens" / "manifest.json").read_text())["dialogues"]) == DIALOGUES


def test_eval_shows_the_oracle_gain(run):
    result = json.loads((run[0] / "eval.json").read_text())
    accuracy = result["text_accuracy"]
    # rounded: 13 more of 130 tokens right is 10 points, which floats make 0.0999...
    assert round(accuracy["own_oracle"] - accuracy["other_oracle"], 9) >= 0.10, accuracy


def test_kame_infer_runs_on_the_checkpoint(run, tmp_path):
    wav = sorted((run[0].parent / "data").glob("*.wav"))[0]
    done = subprocess.run(
        [sys.executable, "-m", "kame.cli", "infer", "--frontend", str(run[0] / "checkpoint"), "--device", "cpu",
         "--input", str(wav), "--output", str(tmp_path / "out.wav"), "--oracle", "The box is red", "--json"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["duration_s"] > 1.0


def test_kame_serve_runs_on_the_checkpoint(run):
    with running_server(frontend=str(run[0] / "checkpoint"), asr="none", max_sessions=1) as (url, _):
        async def session():
            client = await KameClient.connect(url + "/api/chat")
            got = Recording()
            receiver = asyncio.create_task(record(client, got))
            await stream_realtime(client, np.zeros(9600, np.float32))
            await wait_until(lambda: received_samples(got) >= 3 * 1920, "3 frames of audio back")
            await client.close()
            await receiver

        asyncio.run(session())
