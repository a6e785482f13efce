"""What this machine's CPU is, from /proc/cpuinfo: part of the keys of the per-machine caches
(kernel choices, inductor's ISA probe)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpuinfo_field(name: str) -> str:
    """The first CPU's `name` line of /proc/cpuinfo ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
