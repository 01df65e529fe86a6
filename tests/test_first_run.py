"""The first run on a fresh machine: `kame serve` with no flags, offline, no GPU, no API key."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from .conftest import words
from .server_harness import free_port

ROOT = Path(__file__).resolve().parents[1]


def wait_healthy(port: int, process: subprocess.Popen, limit_s: float = 300) -> dict:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"kame serve exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
                return json.loads(response.read())
        except OSError:
            time.sleep(0.5)
    pytest.fail("kame serve did not become healthy")


@pytest.mark.realtime  # the conversation runs at real-time pace
@pytest.mark.skipif(torch.cuda.is_available(), reason="the offline first run is the no-GPU path")
def test_kame_serve_with_no_flags_works_offline(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "KAME_LLM", "KAME_FRONTEND")}
    env |= {"KAME_PORT": str(port), "HF_HUB_OFFLINE": "1"}
    kame = str(Path(sys.executable).parent / "kame")
    log = tmp_path / "serve.log"
    with log.open("w") as log_file:
        server = subprocess.Popen([kame, "serve"], env=env, stdout=log_file, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        health = wait_healthy(port, server)
        assert (health["frontend"], health["asr"], health["llm"]) == ("tiny-copy", "whisper", "embedded")
        client = subprocess.run(
            [kame, "client", "--url", f"ws://127.0.0.1:{port}/api/chat", "--input",
             str(ROOT / "tests" / "fixtures" / "question.wav"), "--output", str(tmp_path / "answer.wav"),
             "--tail", "8", "--json"], capture_output=True, text=True, timeout=180, env=env)
        assert client.returncode == 0, client.stderr
        lines = [json.loads(line) for line in client.stdout.splitlines()]
        events = [line["event"] for line in lines if line["type"] == "event"]
        finals = [e for e in events if e["type"] == "transcript" and e["final"]]
        assert finals and words(finals[0]["text"]) == words("What is the capital of France?")
        answers = [e for e in events if e["type"] == "llm" and e["phase"] == "done"]
        assert answers and all(e["backend"] == "embedded" for e in answers)
        assert any(e["type"] == "oracle" and e["op"] == "reset" for e in events)
        spoken = lines[-1]["assistant_text"]
        assert spoken and set(words(spoken)) & set(words(answers[-1]["answer"]))  # the LLM's words, spoken
    finally:
        server.send_signal(signal.SIGINT)
        try:
            code = server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            code = None
    output = log.read_text()
    assert code == 0, output[-3000:]
    assert "untrained demo" in output and "no OPENAI_API_KEY" in output
    # every model is warm before the port opens: the engine, the ASR, the embedded LLM
    stages = ["engine warm", "ASR warm", "embedded LLM loaded", "ready: ws://"]
    assert all(stage in output for stage in stages), output[:3000]
    assert [output.index(stage) for stage in stages] == sorted(output.index(stage) for stage in stages)
