"""How much memory a new KV pool may take: what the device has available now, plus the pool it
replaces (freed first), less a reserve for the step's temporaries. Checked before the old pool is
touched, so an impossible size is a clear 400, not an allocator failure half-way through a rebuild."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from minivllm.engine.config import parse_memory

RESERVE_FRACTION = 0.10  # of what is available: logits, K/V gathers and the allocator's slack


class ConfigRejectedError(ValueError):
    """An engine setting that cannot be applied; `param` names it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def available_bytes(device: torch.device) -> int | None:
    """Free memory on `device` (None where it cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def process_rss_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 where it cannot be read)."""
    statm = Path("/proc/self/statm")
    if not statm.exists():
        return 0
    return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def check_pool_fits(
    new_bytes: int, current_bytes: int, device: torch.device, num_blocks: int, cap: str | int | None = None
) -> None:
    cap_bytes = parse_memory(cap) if cap is not None else None
    if cap_bytes is not None and new_bytes > cap_bytes:
        raise ConfigRejectedError(
            f"num_blocks {num_blocks} needs a {_gib(new_bytes)} KV pool, over this server's "
            f"cap of {_gib(cap_bytes)} (--max-kv-cache-memory)",
            "num_blocks",
        )
    free = available_bytes(device)
    if free is None:
        return
    budget = int((free + current_bytes) * (1 - RESERVE_FRACTION))
    if new_bytes > budget:
        raise ConfigRejectedError(
            f"num_blocks {num_blocks} needs a {_gib(new_bytes)} KV pool, but {_gib(budget)} is available for it "
            f"({_gib(free)} free on {device.type} plus the current {_gib(current_bytes)} pool, less a "
            f"{RESERVE_FRACTION:.0%} reserve)",
            "num_blocks",
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
