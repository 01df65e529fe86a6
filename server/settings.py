"""Server settings: defaults < config file (TOML) < KAME_* env vars < CLI flags, validated once. The defaults
are the library's (its frozen dataclasses: RuntimeSettings, PlannerConfig, ...), read from there; a table that
holds a dataclass's options ([planner], [whisper], ...) is built from its fields, bounds included."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import tomllib
import typing
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, create_model, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from kame.aec import EchoOptions
from kame.asr.kyutai_stt import SttOptions
from kame.asr.whisper import WhisperOptions
from kame.backend.planner import PlannerConfig
from kame.backend.profiles import DEFAULT_PROFILES, BackendProfile
from kame.errors import KameError
from kame.opus import PEER_PTIME_MS, VOICE_COMPLEXITY
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


def _options_table(options: type, *, leave_out: tuple[str, ...] = ()) -> type[BaseModel]:
    """A config-file table of the fields of `options` (a library dataclass, where each field's type, bounds and
    default are written once) but those in `leave_out` (set elsewhere, or not settings); other keys are refused."""
    names = {f.name for f in dataclasses.fields(options)}
    if unknown := set(leave_out) - names:  # a renamed field would otherwise turn up in the users' schema
        raise TypeError(f"{options.__name__} has no field {', '.join(sorted(unknown))}")
    hints = typing.get_type_hints(options, include_extras=True)
    fields = {f.name: (hints[f.name], ... if f.default is dataclasses.MISSING else f.default)
              for f in dataclasses.fields(options) if f.name not in leave_out}
    return create_model(f"{options.__name__}Table", __config__=ConfigDict(extra="forbid"), **fields)


class ProfileSettings(_options_table(BackendProfile, leave_out=("name",))):
    """An LLM backend profile in the config file ([profiles.NAME]; the name is the table's)."""

    base_url: str | None = None  # a profile of the library has none: a config file's may leave it out


class PlannerSettings(_options_table(PlannerConfig, leave_out=(
        "system_prompt", "knowledge_limit", "knowledge_budget_tokens"))):  # settings of their own, outside [planner]
    """[planner]: when the planner starts LLM streams (kame.backend.planner.PlannerConfig)."""


class KnowledgeSettings(BaseModel):
    """[knowledge] (or `--knowledge DIR`): a folder of documents the backend LLM answers from."""

    model_config = ConfigDict(extra="forbid")
    dir: Path | None = None  # None: no knowledge base
    index_path: Path | None = KnowledgeOptions.index_path  # keep the index in this SQLite file; None: in memory
    limit: int = Field(PlannerConfig.knowledge_limit, ge=1, le=50)
    budget_tokens: int = Field(PlannerConfig.knowledge_budget_tokens, ge=50, le=8000)
    watch_interval_s: float = Field(KnowledgeOptions.watch_interval_s, ge=0)  # 0: re-index on SIGHUP only
    tool: bool = KnowledgeOptions.tool


class WhisperSettings(_options_table(WhisperOptions, leave_out=(
        "model", "device", "compute_type", "language", "preroll_s", "coalesce"))):  # --asr-model, --device; internal
    """[whisper]: the whisper ASR's streaming (kame.asr.whisper.WhisperOptions)."""

    @model_validator(mode="after")
    def _check_pause(self) -> WhisperSettings:
        ask = self.eot_ask_s or self.min_silence_s
        if not self.eot_tail_s <= ask < self.eot_fallback_s:
            raise ValueError(f"the pauses must grow: eot_tail_s ({self.eot_tail_s}) <= eot_ask_s ({ask}) "
                             f"< eot_fallback_s ({self.eot_fallback_s})")
        return self


class RealtimeSettings(BaseModel):
    """[realtime]: how /v1/realtime maps the front-end's continuous speech onto responses (docs/realtime.md)."""

    model_config = ConfigDict(extra="forbid")
    quiet_s: float = Field(0.6, ge=0.16, le=5)  # a response closes after this long without speech
    activity: Literal["text", "text+audio"] = "text"  # what counts as speech: text tokens, or also audio energy
    energy_dbfs: float = Field(-40.0, ge=-90, le=0)  # with "text+audio": frame level that counts as speech
    response_timeout_s: float = Field(5.0, gt=0, le=60)  # a response.create the model does not answer: done empty
    tool_timeout_s: float = Field(15.0, gt=0, le=120)  # a client function's output awaited this long, then an error
    # GPT-Live: the assistant's audio goes out as zeros after this long without a word from the front-end, as
    # GPT-Live's own silence (server/live/silence.py); 0: as the front-end makes it
    live_zero_silence_s: float = Field(1.0, ge=0, le=10)
    # GPT-Live over WebRTC: libopus's effort encoding the assistant's voice (0-10; 10 takes 1.5-1.9x 5's CPU)
    webrtc_opus_complexity: int = Field(VOICE_COMPLEXITY, ge=0, le=10)
    # GPT-Live over WebRTC: the packet time asked of the peer (a=ptime); 40 halves 20's packets, for ~10 ms of delay
    webrtc_uplink_ptime_ms: int = Field(PEER_PTIME_MS, ge=20, le=60, multiple_of=20)  # 20, 40 or 60


class PhoneSettings(BaseModel):
    """[phone]: calls from carriers' media streams (docs/telephony.md)."""

    model_config = ConfigDict(extra="forbid")
    # the server as carriers reach it (behind a proxy or a tunnel), e.g. https://voice.example.com: the
    # stream URL in the TwiML and the URL a webhook's signature covers; None: the request's own host
    public_url: str | None = None
    # Twilio signs its webhooks with the account's auth token; set, the Twilio routes check every webhook and
    # open a stream only with the token its TwiML carried. Unset, they are open on a loopback host only
    twilio_auth_token: SecretStr | None = None
    # Telnyx, Vonage and Plivo open the stream URL the application wrote (Telnyx's stream_url, Vonage's NCCO
    # websocket uri, Plivo's <Stream>): set, /<carrier>/media opens only for ?stream_token=<this secret> (Telnyx:
    # or its stream_auth_token). Unset, the route is open on a loopback host only
    telnyx_stream_token: SecretStr | None = None
    vonage_stream_token: SecretStr | None = None
    plivo_stream_token: SecretStr | None = None
    lead_frames: int = Field(2, ge=1, le=12)  # the assistant's audio sent ahead of what the caller heard, 80 ms each
    keypad_to_llm: bool = True  # keypad digits reach the LLM as the caller's words (a call's `keypad=off`: not)


class SipSettings(BaseModel):
    """[sip]: KAME as a SIP endpoint, with OpenAI's call control (`kame serve --sip`; docs/telephony.md)."""

    model_config = ConfigDict(extra="forbid")
    listen: str | None = None  # HOST:PORT for SIP over UDP and TCP (e.g. 0.0.0.0:5060); None: no SIP
    # SIP over TLS on tls_port (default: the listen port + 1) with this certificate chain and key (PEM files)
    tls_certificate: str | None = None
    tls_key: str | None = None
    tls_port: int | None = Field(None, ge=1, le=65535)
    public_host: str | None = None  # the address in Contact and SDP (behind NAT); None: the local one toward the peer
    # who may send an INVITE (addresses or networks): a trunk's or a PBX's; anyone else gets 403 before anything runs
    allow_from: list[str] = Field(default_factory=lambda: ["127.0.0.0/8", "::1/128"])
    # OpenAI's incoming-call webhooks posted here (the application accepts over REST); None: every call allowed in
    # is answered at once with the server's default session
    webhook_url: str | None = None
    webhook_secret: SecretStr | None = None  # whsec_...: the Standard Webhooks signature (unsigned without it)
    webhook_events: list[Literal["realtime.call.incoming", "live.transport.incoming"]] = Field(
        default_factory=lambda: ["realtime.call.incoming", "live.transport.incoming"])
    ring_timeout_s: float = Field(30.0, gt=0, le=300)  # a call nobody accepts by then is declined (480)
    dial_timeout_s: float = Field(60.0, gt=0, le=300)  # an outbound call not answered by then is cancelled
    # the codecs a call may use (an inbound call gets the first the caller offers of them; an outbound call
    # offers them in this order); G.722 (wideband, 16 kHz) needs PyAV
    codecs: list[Literal["PCMU", "PCMA", "G722"]] = Field(default_factory=lambda: ["PCMU", "PCMA", "G722"])
    rtp_host: str | None = None  # where RTP binds (default: the listen host)
    rtp_port_min: int = Field(0, ge=0, le=65535)  # RTP ports (even ones) from this range; 0: any free port
    rtp_port_max: int = Field(0, ge=0, le=65535)
    rtp_timeout_s: float = Field(30.0, gt=0)  # no RTP this long (not on hold): the call is ended
    jitter_ms: int = Field(60, ge=20, le=400)  # the jitter buffer's depth at the start (it adapts up to 200 ms)
    requests_per_s: float = Field(20.0, gt=0)  # SIP requests per source address (a burst of 3x): beyond, dropped
    # the trunks outbound calls (GPT-Live's SIP transport) may go to without TLS (a PBX on this network): host[:port]
    trusted_trunks: list[str] = Field(default_factory=list)


class EchoSettings(_options_table(EchoOptions)):
    """[echo]: echo cancellation of telephone sessions (kame.aec.EchoOptions; docs/echo.md)."""


class KyutaiSttSettings(_options_table(SttOptions, leave_out=("model", "device", "max_sessions"))):  # set elsewhere
    """[kyutai_stt]: Kyutai's STT (kame.asr.kyutai_stt.SttOptions)."""


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KAME_", env_nested_delimiter="__", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8998, ge=0, le=65535)
    frontend: str | None = RuntimeSettings.frontend
    device: Literal["auto", "cpu", "cuda"] = RuntimeSettings.device
    quantize: Literal["none", "int8"] = "none"  # int8: the front-end LM in int8 weights (CUDA, bitsandbytes)
    max_sessions: int | None = Field(RuntimeSettings.max_sessions, ge=1, le=512)
    asr: Literal["whisper", "kyutai-stt", "none"] | None = RuntimeSettings.asr
    asr_model: str | None = RuntimeSettings.asr_model
    llm: str | None = None  # a session's default backend profile; None: openai if OPENAI_API_KEY is set, else embedded
    llm_base_url: str | None = None  # with llm_model: an ad-hoc profile named "custom", made the default
    llm_model: str | None = None
    llm_api_key_env: str = "OPENAI_API_KEY"
    system_prompt: str = PlannerConfig.system_prompt
    profiles: dict[str, ProfileSettings] = Field(default_factory=dict)  # added to / replacing the built-ins
    planner: PlannerSettings = Field(default_factory=PlannerSettings)
    whisper: WhisperSettings = Field(default_factory=WhisperSettings)
    kyutai_stt: KyutaiSttSettings = Field(default_factory=KyutaiSttSettings)
    realtime: RealtimeSettings = Field(default_factory=RealtimeSettings)
    echo: EchoSettings = Field(default_factory=EchoSettings)
    phone: PhoneSettings = Field(default_factory=PhoneSettings)
    sip: SipSettings = Field(default_factory=SipSettings)
    tools: dict[str, ToolConfig] = Field(default_factory=dict)  # [tools.NAME]; none: the LLM is offered no tools
    knowledge: KnowledgeSettings = Field(default_factory=KnowledgeSettings)
    voices_dir: Path | None = RuntimeSettings.voices_dir  # PersonaPlex .pt voices; None: the checkpoint's own
    replica: str | None = Field(None, exclude=True)  # set by `kame serve --ray` in each replica: its stable id
    engine_clock: Literal["auto", "tick", "eager"] = RuntimeSettings.engine_clock
    jitter_frames: int = Field(RuntimeSettings.jitter_frames, ge=0)
    batch_window_ms: float = Field(RuntimeSettings.batch_window_s * 1000, ge=0, le=80)
    engine_threads: int | None = Field(RuntimeSettings.engine_threads, ge=1)
    engine_compact: bool = RuntimeSettings.engine_compact
    kv_cache: Literal["auto", "model", "int8"] = RuntimeSettings.kv_cache
    # front processes sharing one engine process (server/fronts.py); 0: one process holds everything
    fronts: int = Field(0, ge=0, le=64)
    max_pending_frames: int = Field(RuntimeSettings.max_pending_frames, ge=1)
    # processes for the sessions' Opus (server/codec_process.py); None: one per 32 engine slots
    codec_processes: int | None = Field(None, ge=1)
    send_queue_messages: int = Field(SessionConfig.output_frames, ge=4)
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
    asr_stall_s: float = Field(SessionConfig.asr_stall_s, gt=0)
    breaker_failures: int = Field(RuntimeSettings.breaker_failures, ge=1)
    breaker_cooldown_s: float = Field(RuntimeSettings.breaker_cooldown_s, gt=0)
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
        all on this project's CPU: docs/benchmarks-history.md, "The host side")."""
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
        """The library runtime's part of the settings: its fields of the same name, and these converted."""
        same = {f.name: getattr(self, f.name) for f in dataclasses.fields(RuntimeSettings)
                if f.name in type(self).model_fields}
        return RuntimeSettings(**same | dict(
            quantize=None if self.quantize == "none" else self.quantize, asr_options=self.asr_options(),
            profiles=self.all_profiles(), default_profile=self.default_profile, planner=self.planner_config(),
            batch_window_s=self.batch_window_ms / 1000, tools=dict(self.tools), knowledge=self.knowledge_options()))

    def echo_options(self) -> EchoOptions:
        return EchoOptions(**self.echo.model_dump())

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
    end_of_turn = cli.pop("end_of_turn", None)  # --end-of-turn: [whisper] end_of_turn (merged with the rest)
    if end_of_turn is not None:
        cli["whisper"] = {**(cli.get("whisper") or {}), "end_of_turn": end_of_turn}
    sip_listen = cli.pop("sip_listen", None)  # --sip HOST:PORT: [sip] listen (the rest of [sip] kept)
    if sip_listen is not None:
        cli["sip"] = {**(cli.get("sip") or _TomlSource.data.get("sip") or {}), "listen": sip_listen}
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
        shown = "(hidden)" if key.startswith("auth_tokens") or "token" in key else repr(error.get("input"))
        raise SettingsError(f"setting {key}: {message} (got {shown})") from exc
    finally:
        _TomlSource.data = {}
