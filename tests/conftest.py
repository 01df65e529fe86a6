"""Shared fixtures: tiny front-ends loaded once per test session, on the CPU."""

from __future__ import annotations

import json
import os
import re
import uuid

# One torch thread per test process, and for the processes the tests start: the tiny models here train
# and step as fast on one thread as on two (test_training's run: 59 s on one, 65 s on two with twice the
# CPU), and on a shared machine two OpenMP threads spin waiting for a core (docs/benchmarks-history.md,
# "Training a tiny model on a shared CPU": 10x slower). Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest

from kame.testing.openai_server import ScriptedOpenAIServer, ScriptedReply
from kame.training.dialogues import WORKER_MALLOC

# Test processes keep freed memory, with the variables `kame train`'s prepare workers start with:
# Whisper and torch free and take blocks of over 32 MB again and again, and glibc's default gives each
# back to the kernel and faults it in again, page by page. glibc reads these when a process starts:
# here, on the controller, before pytest-xdist starts the workers (a serial run's own process keeps
# glibc's default; the servers and CLIs the tests start inherit them either way).
for _name, _value in WORKER_MALLOC.items():
    os.environ.setdefault(_name, _value)


@pytest.fixture(scope="session")
def tiny():
    """(torch is imported in the fixtures, not at the top: collecting and the hooks need no torch)"""
    from kame.frontend.loader import load_frontend

    return load_frontend("tiny", "cpu")


@pytest.fixture(scope="session")
def tiny_copy():
    from kame.frontend.loader import load_frontend

    return load_frontend("tiny-copy", "cpu")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Back to one torch thread before each test: faster-whisper's loading (ctranslate2) sets the
    loading thread's OpenMP count to its own `cpu_threads`."""
    import torch

    if torch.get_num_threads() != 1 and os.environ.get("OMP_NUM_THREADS") == "1":
        torch.set_num_threads(1)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def noise_frames(rng: np.random.Generator, count: int, scale: float = 0.1) -> list[np.ndarray]:
    return [(rng.standard_normal(1920) * scale).astype(np.float32) for _ in range(count)]


# ------------------------------------------------------------------ a running tandem server

QUESTIONS = {
    "france": ("What is the capital of France, and why is it famous?", "Paris is the capital of France"),
    "spider": ("How many legs does a spider have?", "Spiders have eight legs"),
    "sky": ("Why is the sky blue during the day?", "Sunlight scatters off the air"),
    "hamlet": ("Who wrote the play called Hamlet?", "William Shakespeare wrote it"),
}


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def scripted_answer(body: dict) -> ScriptedReply:
    """The scripted LLM answers by topic, from the newest line of the transcript it is sent; offered a
    client's `get_weather` tool for a question about the weather, it calls it, then answers from its output."""
    if (weather := weather_answer(body)) is not None:
        return weather
    if (decision := decision_answer(body)) is not None:
        return decision
    last_line = body["messages"][-1]["content"].split("\n")[-1].lower()
    for key, (_, answer) in QUESTIONS.items():
        if key in last_line or (key == "spider" and "legs" in last_line):
            return ScriptedReply(text=answer + ".")
    return ScriptedReply(text="Let me think.")


def decision_answer(body: dict) -> ScriptedReply | None:
    """Decision questions (kame/backend/decide.py): a predicate is true if the conversation mentions France, a
    choice takes its first option, a score its last level; each with confidence 0.8."""
    if not body["messages"][0]["content"].startswith("You judge a live voice conversation"):
        return None
    asked = body["messages"][-1]["content"]
    answers = []
    for index, kind, options in re.findall(r"^(\d+)\. \[(\w+)\][^\n]*?(?:Options: (.*))?$", asked, re.M):
        if kind == "predicate":
            answer = "france" in asked.lower()
        else:
            values = [json.loads(part.split(" = ")[0]) for part in options.split("; ")]
            answer = values[0] if kind == "choice" else values[-1]
        answers.append({"index": int(index), "answer": answer, "confidence": 0.8})
    return ScriptedReply(text=json.dumps({"answers": answers}))


def weather_answer(body: dict) -> ScriptedReply | None:
    """A weather question: the `get_weather` call while the tool is offered, the answer once its output is in."""
    from kame.testing.openai_server import ScriptedToolCall

    results = [m["content"] for m in body["messages"] if m["role"] == "tool"]
    if results:
        return ScriptedReply(text=f"The weather: {results[-1]}.")
    offered = [t["function"]["name"] for t in body.get("tools") or () if body.get("tool_choice") != "none"]
    if "get_weather" in offered and "weather" in body["messages"][-1]["content"].lower():
        return ScriptedReply(text="", tool_calls=(ScriptedToolCall("get_weather", {"city": "Paris"},
                                                                   id=f"call_{uuid.uuid4().hex[:12]}"),))
    return None


@pytest.fixture(scope="session")
def scripted_llm():
    server = ScriptedOpenAIServer(scripted_answer)
    server.start_in_thread()
    yield server
    server.stop_thread()


@pytest.fixture(scope="session")
def shared_tandem_server(scripted_llm):
    """The real server on loopback: tiny-copy, Whisper tiny.en, the scripted LLM, 4 slots; one for
    the whole run (tests take it through `tandem_server`)."""
    from server.settings import ProfileSettings

    from .server_harness import running_server

    profiles = {"scripted": ProfileSettings(base_url=scripted_llm.base_url, model="scripted", api_key_env=None)}
    with running_server(asr="whisper", max_sessions=4, profiles=profiles, llm="scripted") as (url, services):
        yield url, services


@pytest.fixture
def tandem_server(shared_tandem_server):
    """The shared server once every slot is free. A session an earlier test closed gives its slot
    back only after its planner and ASR stream are closed, which takes longer on a loaded machine;
    without the wait, the next test's session could be refused (HTTP 503) as if the server were full."""
    from .server_harness import wait_until_all_slots_free

    wait_until_all_slots_free(shared_tandem_server[1], limit_s=30.0)
    return shared_tandem_server


@pytest.fixture(scope="session")
def voices(tmp_path_factory):
    from kame.testing.speech import speech

    cache = tmp_path_factory.mktemp("tts")
    return {key: speech(question, cache) for key, (question, _) in QUESTIONS.items()}


# ------------------------------------------------------------------ the parallel run, then the realtime one

# README's test command runs the suite twice: `-n auto -m "not realtime"` (a file per worker at a time,
# `--dist loadfile` in pyproject: a module's fixtures are set up once), then `-m realtime` in one process,
# where a test that promises real-time pace has the machine to itself. The slowest files of the parallel
# run go first (docs/benchmarks.md), so that none of them is its long tail; a file missing here only runs
# later, a stale entry costs nothing.
SLOWEST_FIRST = (
    "tests/test_training_e2e.py",
    "tests/test_training.py",
    "tests/test_recipe.py",
    "tests/test_eval.py",
    "tests/test_eval_robustness.py",
    "tests/test_tools_e2e.py",
    "tests/test_embedded_llm.py",
    "tests/test_training_data.py",
    "tests/test_hub_layouts.py",
    "tests/test_aec.py",
)


# and last: the realtime part's local Ray instance (tests/test_ray.py), whose processes go on shutting down for
# a while after its module: no other real-time test runs beside them (in a clean-clone run with a CPU hog, two
# real-time tests right after it skipped frames to live: 7 of a session's 75, 19 of 250)
LAST = ("tests/test_ray.py",)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core, at most 4 (each holds its own models and servers)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def pytest_collection_modifyitems(config, items):
    """The slowest files first (stable: a file's tests keep their order; every worker sorts the same way,
    which xdist checks). `gpu` tests run where CUDA is (scripts/gpu_bench.sh runs them); elsewhere they are
    skipped."""
    import torch

    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        if path in LAST:
            return len(SLOWEST_FIRST) + 1 + LAST.index(path)
        return SLOWEST_FIRST.index(path) if path in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=rank)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
