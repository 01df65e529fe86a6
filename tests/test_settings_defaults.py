"""Each default is written once, in the library's frozen dataclasses; the server's settings read it from there."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
from pathlib import Path

import pytest

from kame.aec import EchoOptions
from kame.asr.kyutai_stt import SttOptions
from kame.asr.whisper import WhisperOptions
from kame.backend.breaker import CircuitBreakerLLM
from kame.backend.planner import PlannerConfig
from kame.backend.profiles import BackendProfile
from kame.frontend.runner import EngineRunner
from kame.runtime import KnowledgeOptions, RuntimeSettings
from kame.session import SessionConfig
from server.settings import ProfileSettings, ServerSettings

SETTINGS = Path(__file__).resolve().parents[1] / "server" / "settings.py"
LIBRARY = {"ServerSettings": (RuntimeSettings, SessionConfig), "PlannerSettings": (PlannerConfig,),
           "KnowledgeSettings": (PlannerConfig, KnowledgeOptions), "ProfileSettings": (BackendProfile,),
           "WhisperSettings": (WhisperOptions,), "KyutaiSttSettings": (SttOptions,), "EchoSettings": (EchoOptions,)}
RENAMED = {"batch_window_ms": "batch_window_s", "send_queue_messages": "output_frames", "limit": "knowledge_limit",
           "budget_tokens": "knowledge_budget_tokens"}
OWN = {"quantize", "stats_interval_s"}  # the server's own defaults on purpose: "none" for None, stats on


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("KAME_") or n == "OPENAI_API_KEY"]:
        monkeypatch.delenv(name)


def test_no_library_default_is_written_again_in_the_server_settings():
    for node in ast.parse(SETTINGS.read_text()).body:
        if not isinstance(node, ast.ClassDef) or node.name not in LIBRARY:
            continue
        names = {f.name for cls in LIBRARY[node.name] for f in dataclasses.fields(cls)
                 if f.default is not dataclasses.MISSING}
        for item in node.body:
            if not isinstance(item, ast.AnnAssign) or item.value is None:
                continue
            name = item.target.id
            value = item.value.args[0] if isinstance(item.value, ast.Call) and item.value.args else item.value
            if RENAMED.get(name, name) in names and name not in OWN:
                assert not isinstance(value, ast.Constant), f"{node.name}.{name}: read the library's default"


def test_server_defaults_are_the_librarys():
    settings = ServerSettings()
    runtime = settings.runtime_settings()
    assert runtime == dataclasses.replace(RuntimeSettings(), asr_options=runtime.asr_options)
    assert settings.asr_options() == {
        "whisper": {k: getattr(WhisperOptions(), k) for k in settings.whisper.model_dump()},
        "kyutai-stt": {k: getattr(SttOptions(), k) for k in settings.kyutai_stt.model_dump()}}
    assert settings.session_config() == SessionConfig(stats_interval_s=settings.stats_interval_s)
    assert settings.echo_options() == EchoOptions()
    assert BackendProfile("p", **ProfileSettings(model="m").model_dump()) == BackendProfile("p", None, "m")
    knowledge = ServerSettings(knowledge={"dir": "docs"}).knowledge_options()
    assert knowledge == KnowledgeOptions(Path("docs"))


def test_runner_defaults_are_the_runtimes():
    parameters = inspect.signature(EngineRunner).parameters
    runtime = RuntimeSettings()
    for name in ("jitter_frames", "batch_window_s", "max_pending_frames"):
        assert parameters[name].default == getattr(runtime, name), name


def test_breaker_defaults_are_the_runtimes():
    parameters = inspect.signature(CircuitBreakerLLM).parameters
    runtime = RuntimeSettings()
    assert parameters["threshold"].default == runtime.breaker_failures
    assert parameters["cooldown_s"].default == runtime.breaker_cooldown_s
