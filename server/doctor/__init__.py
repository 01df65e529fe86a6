"""`kame doctor`: what `kame serve` would do on this machine (device, models, memory, LLM endpoints),
told before any download or long wait. One line per check; exit code 1 if any check fails.
This module is the command; each group of lines has a module of its own (machine, models, sessions, llm)."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from server.doctor.check import Check
from server.doctor.llm import llm_checks
from server.doctor.machine import probe_machine, quantize_checks
from server.doctor.models import Hub, asr_checks, frontend_check
from server.doctor.sessions import sessions_check

if TYPE_CHECKING:  # the parser is built without torch (`kame --help` loads no model code)
    from server.settings import ServerSettings


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
