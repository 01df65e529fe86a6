"""The peak memory of this process, for memory tests and benchmarks."""

from __future__ import annotations

from pathlib import Path


def peak_rss_bytes() -> int:
    """This process's peak RSS since its exec (VmHWM). Not ru_maxrss: a child's starts at its
    parent's, inherited over fork, so under pytest it would hide any smaller peak."""
    return int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) * 1024
