"""Server settings: defaults < config file (TOML) < KAME_* env vars < CLI flags, validated once."""

from __future__ import annotations

import ipaddress
import os
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from kame.backend.planner import DEFAULT_SYSTEM_PROMPT, PlannerConfig
from kame.backend.profiles import DEFAULT_PROFILES, BackendProfile
from kame.errors import KameError
from kame.runtime import KnowledgeOptions, RuntimeSettings
from kame.session import SessionConfig
from kame.tools.config import ToolConfig


class SettingsError(KameError):
    """A bad setting; the message names the key."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ProfileSettings(BaseModel):
    """An LLM backend profile in the config file ([profiles.NAME])."""

    model_config = ConfigDict(extra="forbid")
    base_url: str | None = None
    model: str
    api_key_env: str | None = "OPENAI_API_KEY"
    connect_timeout_s: float = Field(3.0, gt=0)
    first_token_timeout_s: float = Field(5.0, gt=0)
    token_timeout_s: float = Field(3.0, gt=0)
    max_tokens: int = Field(120, gt=0)
    temperature: float = Field(0.3, ge=0, le=2)
    kind: Literal["openai", "embedded"] = "openai"  # embedded: `model` is a .gguf file or model directory
    tools: bool = True  # offer the session's tools (false for an endpoint that refuses the `tools` field)


class PlannerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    min_new_words: int = Field(2, ge=1)
    restart_on_final: bool = True
    max_restarts: int = Field(5, ge=1)
    restart_window_s: float = Field(2.0, gt=0)
    backoff_initial_s: float = Field(0.5, ge=0)
    backoff_max_s: float = Field(10.0, ge=0)
    max_concurrent_streams: int = Field(4, ge=1)  # LLM streams that may run at once; the newest that speaks wins
    keep_agreeing_oracle: bool = True  # a newer answer that repeats the oracle extends it instead of restarting it
    max_history_turns: int = Field(20, ge=1, le=1000)  # conversation turns kept in the LLM's prompt
    max_tool_rounds: int = Field(3, ge=1, le=10)  # tool-call rounds per LLM attempt (then it must answer)


class KnowledgeSettings(BaseModel):
    """[knowledge] (or `--knowledge DIR`): a folder of documents the backend LLM answers from."""

    model_config = ConfigDict(extra="forbid")
    dir: Path | None = None  # None: no knowledge base
    index_path: Path | None = None  # keep the index in this SQLite file between runs; None: in memory
    limit: int = Field(4, ge=1, le=50)  # passages per LLM attempt ...
    budget_tokens: int = Field(400, ge=50, le=8000)  # ... within about this many tokens of the system message
    watch_interval_s: float = Field(5.0, ge=0)  # re-index changed files this often; 0: only on SIGHUP
    tool: bool = True  # also offer the `search_knowledge` tool to models that call tools


class WhisperSettings(BaseModel):
    """[whisper]: the whisper ASR's streaming (kame.asr.whisper.WhisperOptions)."""

    model_config = ConfigDict(extra="forbid")
    decode_interval_s: float = Field(0.5, gt=0, le=5)  # re-decode the utterance after this much new audio
    vad_threshold: float = Field(0.5, gt=0, lt=1)  # Silero speech probability that counts as speech
    min_silence_s: float = Field(0.6, gt=0, le=5)  # silence that ends an utterance
    max_utterance_s: float = Field(20.0, gt=1, le=30)  # an utterance is finalised at this length


class RealtimeSettings(BaseModel):
    """[realtime]: how /v1/realtime maps the front-end's continuous speech onto responses (docs/realtime.md)."""

    model_config = ConfigDict(extra="forbid")
    quiet_s: float = Field(0.6, ge=0.16, le=5)  # a response closes after this long without speech
    activity: Literal["text", "text+audio"] = "text"  # what counts as speech: text tokens, or also audio energy
    energy_dbfs: float = Field(-40.0, ge=-90, le=0)  # with "text+audio": frame level that counts as speech
    response_timeout_s: float = Field(5.0, gt=0, le=60)  # a response.create the model does not answer: done empty
    tool_timeout_s: float = Field(15.0, gt=0, le=120)  # a client function's output awaited this long, then an error


class KyutaiSttSettings(BaseModel):
    """[kyutai_stt]: Kyutai's STT (kame.asr.kyutai_stt.SttOptions)."""

    model_config = ConfigDict(extra="forbid")
    eot_head: int = Field(2, ge=0)  # which extra head predicts the end of a turn (Kyutai's STT 1B: 2)
    eot_threshold: float = Field(0.5, gt=0, lt=1)  # end-of-turn probability that ends an utterance
    # a checkpoint without that head: a pause this long ends the turn
    min_silence_s: float = Field(0.6, gt=0, le=5)
    vad_threshold: float = Field(0.5, gt=0, lt=1)  # Silero speech probability that counts as speech


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KAME_", env_nested_delimiter="__", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8998, ge=0, le=65535)
    frontend: str | None = None  # None: SakanaAI/kame with a GPU, else the offline demo tiny-copy
    device: Literal["auto", "cpu", "cuda"] = "auto"
    quantize: Literal["none", "int8"] = "none"  # int8: the front-end LM in int8 weights (CUDA, bitsandbytes)
    max_sessions: int | None = Field(None, ge=1, le=512)  # None: 4 on a CPU, 32 on a GPU
    asr: Literal["whisper", "kyutai-stt", "none"] | None = None  # None: kyutai-stt with a GPU, else whisper
    asr_model: str | None = None
    llm: str | None = None  # a session's default backend profile; None: openai if OPENAI_API_KEY is set, else embedded
    llm_base_url: str | None = None  # with llm_model: an ad-hoc profile named "custom", made the default
    llm_model: str | None = None
    llm_api_key_env: str = "OPENAI_API_KEY"
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    profiles: dict[str, ProfileSettings] = Field(default_factory=dict)  # added to / replacing the built-ins
    planner: PlannerSettings = Field(default_factory=PlannerSettings)
    whisper: WhisperSettings = Field(default_factory=WhisperSettings)
    kyutai_stt: KyutaiSttSettings = Field(default_factory=KyutaiSttSettings)
    realtime: RealtimeSettings = Field(default_factory=RealtimeSettings)
    tools: dict[str, ToolConfig] = Field(default_factory=dict)  # [tools.NAME]; none: the LLM is offered no tools
    knowledge: KnowledgeSettings = Field(default_factory=KnowledgeSettings)
    replica: str | None = Field(None, exclude=True)  # set by `kame serve --ray` in each replica: its stable id
    # auto: eager on a CPU, tick on a GPU; tick: one batched step per 80 ms frame for every session;
    # eager: a step as soon as a frame arrives (docs/architecture.md, "The frame clock")
    engine_clock: Literal["auto", "tick", "eager"] = "auto"
    jitter_frames: int = Field(3, ge=0)  # input frames a live session may hold at a step before it skips to live
    batch_window_ms: float = Field(20.0, ge=0, le=80)  # eager clock: how long a ready session waits for the others
    engine_threads: int | None = Field(None, ge=1)  # torch threads of the engine thread; None: 1 on CPU
    max_pending_frames: int = Field(25, ge=1)  # hard cap of a session's input frame queue (oldest dropped)
    # processes for the sessions' Opus (server/codec_process.py); None: one per 32 engine slots
    codec_processes: int | None = Field(None, ge=1)
    send_queue_messages: int = Field(64, ge=4)  # output messages buffered per session (oldest audio dropped)
    max_message_bytes: int = Field(1 << 20, ge=1024)
    stats_interval_s: float = Field(1.0, gt=0)  # how often a session gets a stats event
    # access and limits (docs/security.md)
    auth_tokens: list[SecretStr] = Field(default_factory=list)  # accepted bearer tokens; empty: no auth
    require_auth: bool | None = None  # None: required when `host` is not a loopback address
    allowed_origins: list[str] = Field(default_factory=list)  # browser origins; empty: the server's own; "*": any
    max_session_s: float = Field(3600.0, gt=0)  # a session is closed after this long
    idle_timeout_s: float = Field(60.0, gt=0)  # ... or after this long without a client message
    max_connections_per_ip: int = Field(8, ge=1)
    max_messages_per_s: float = Field(200.0, gt=0)  # a client sending more for 5 s in a row is closed
    send_timeout_s: float = Field(10.0, gt=0)  # a client that does not read for this long is closed
    asr_stall_s: float = Field(10.0, gt=0)  # ASR this far behind: the session goes on without it
    breaker_failures: int = Field(5, ge=1)  # LLM failures in a row (per profile) that open its circuit ...
    breaker_cooldown_s: float = Field(30.0, gt=0)  # ... for this long
    shutdown_timeout_s: float = Field(10.0, ge=0)  # on SIGTERM, sessions get this long to finish
    record_dir: Path | None = None  # keep every session's audio and events here (privacy: off by default)

    @property
    def auth_required(self) -> bool:
        return self.require_auth if self.require_auth is not None else not is_loopback(self.host)

    @model_validator(mode="after")
    def _check_auth(self) -> ServerSettings:
        if self.auth_required and not self.auth_tokens:
            raise ValueError(
                f"host {self.host} is reachable from the network, so clients must authenticate: set "
                "--auth-token TOKEN (or auth_tokens in the config, KAME_AUTH_TOKENS='[\"...\"]'), or "
                "require_auth = false to let anyone in")
        return self

    @model_validator(mode="after")
    def _check_llm(self) -> ServerSettings:
        if (self.llm_base_url is None) != (self.llm_model is None) and self.llm_model is None:
            raise ValueError("llm_base_url needs llm_model too")
        if self.llm_model is None and self.llm is not None and self.llm not in self.all_profiles():
            raise ValueError(f"llm: unknown backend profile {self.llm!r}; known: {', '.join(self.all_profiles())}")
        return self

    def all_profiles(self) -> dict[str, BackendProfile]:
        profiles = dict(DEFAULT_PROFILES)
        for name, p in self.profiles.items():
            profiles[name] = BackendProfile(name, **p.model_dump())
        if self.llm_model is not None:
            profiles["custom"] = BackendProfile("custom", self.llm_base_url, self.llm_model, self.llm_api_key_env)
        return profiles

    @property
    def default_profile(self) -> str:
        return self.default_profile_and_reason()[0]

    def default_profile_and_reason(self) -> tuple[str, str]:
        if self.llm_model is not None:
            return "custom", "--llm-base-url/--llm-model were given"
        if self.llm is not None:
            return self.llm, "chosen in the settings"
        if os.environ.get("OPENAI_API_KEY"):
            return "openai", "OPENAI_API_KEY is set"
        return "embedded", "no OPENAI_API_KEY: the small in-process model (a demo; set a key or --llm for real answers)"

    def resolved_codec_processes(self, slots: int) -> int:
        """Opus processes: as set, else one per 32 engine slots (64 sessions' Opus took ~0.55 of a core in
        all on this project's CPU: docs/benchmarks.md, "The host side")."""
        return self.codec_processes or max(1, -(-slots // 32))

    def planner_config(self) -> PlannerConfig:
        return PlannerConfig(system_prompt=self.system_prompt, knowledge_limit=self.knowledge.limit,
                             knowledge_budget_tokens=self.knowledge.budget_tokens, **self.planner.model_dump())

    def knowledge_options(self) -> KnowledgeOptions | None:
        k = self.knowledge
        if k.dir is None:
            return None
        return KnowledgeOptions(k.dir, k.index_path, k.watch_interval_s or None, k.tool)

    def runtime_settings(self) -> RuntimeSettings:
        """The library runtime's part of the settings."""
        return RuntimeSettings(
            frontend=self.frontend, device=self.device, quantize=None if self.quantize == "none" else self.quantize,
            max_sessions=self.max_sessions, asr=self.asr,
            asr_model=self.asr_model, asr_options=self.asr_options(), profiles=self.all_profiles(),
            default_profile=self.default_profile,
            planner=self.planner_config(), engine_clock=self.engine_clock, jitter_frames=self.jitter_frames,
            batch_window_s=self.batch_window_ms / 1000, max_pending_frames=self.max_pending_frames,
            engine_threads=self.engine_threads, breaker_failures=self.breaker_failures,
            breaker_cooldown_s=self.breaker_cooldown_s, tools=dict(self.tools), knowledge=self.knowledge_options())

    def asr_options(self) -> dict[str, dict]:
        """Each ASR engine's own settings, by engine name."""
        return {"whisper": self.whisper.model_dump(), "kyutai-stt": self.kyutai_stt.model_dump()}

    def session_config(self, **overrides: object) -> SessionConfig:
        """A session's settings: the server's, with what the client asked for."""
        defaults = {"output_frames": self.send_queue_messages, "stats_interval_s": self.stats_interval_s,
                    "asr_stall_s": self.asr_stall_s}
        return SessionConfig(**(defaults | overrides))

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _TomlSource(settings_cls)


class _TomlSource(PydanticBaseSettingsSource):
    """The config file named by `load_settings` (lowest priority after the defaults)."""

    data: dict = {}

    def get_field_value(self, field, field_name):  # pragma: no cover - __call__ is used instead
        return self.data.get(field_name), field_name, False

    def __call__(self) -> dict:
        return dict(_TomlSource.data)


def read_config_file(path: str | Path) -> dict:
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise SettingsError(f"config file {path} does not exist") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SettingsError(f"config file {path} is not valid TOML: {exc}") from exc


def load_settings(config_file: str | Path | None = None, **cli: object) -> ServerSettings:
    """Build the settings once: defaults < `config_file` < KAME_* env < `cli` (None values ignored)."""
    _TomlSource.data = read_config_file(config_file) if config_file else {}
    knowledge_dir = cli.pop("knowledge_dir", None)  # --knowledge DIR: over [knowledge] dir, the rest kept
    if knowledge_dir is not None:
        table = cli.get("knowledge") or _TomlSource.data.get("knowledge") or {}
        cli["knowledge"] = {**table, "dir": knowledge_dir}
    try:
        return ServerSettings(**{k: v for k, v in cli.items() if v is not None})
    except ValidationError as exc:
        error = exc.errors()[0]
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        key = ".".join(str(p) for p in error.get("loc", ()))
        if not key:  # a check across keys: its message names them
            raise SettingsError(f"settings: {message}") from exc
        shown = "(hidden)" if key.startswith("auth_tokens") else repr(error.get("input"))
        raise SettingsError(f"setting {key}: {message} (got {shown})") from exc
    finally:
        _TomlSource.data = {}
