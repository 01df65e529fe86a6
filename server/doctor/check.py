"""What `kame doctor` reports: one `Check` per line, and how its numbers read (GB, MB, parameter counts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Level = Literal["ok", "warn", "FAIL"]


@dataclass(frozen=True)
class Check:
    level: Level
    name: str
    text: str


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def size(n: float) -> str:
    return gb(n) if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def count(n: float) -> str:
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'G' else 1}f} {unit}"
    return str(int(n))
