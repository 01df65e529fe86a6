"""`kame doctor`'s device lines: the device kame serve would run on, its free memory, and whether the
front-end's int8 quantization works there."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from server.doctor.check import Check, gb

if TYPE_CHECKING:
    import torch

    from server.settings import ServerSettings


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
    return Machine(True, device, free, Check("ok", "device", f"cuda: {name}, {gb(free)} free of {gb(total)}"))


def _cpu(device: torch.device) -> Machine:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    free = available_ram()
    ram = f"{gb(free)} of RAM available" if free is not None else "available RAM unknown"
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
