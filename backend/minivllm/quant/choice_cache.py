"""The kernel choices timed on this machine, kept for the next load.

Why: two candidates within a few percent of each other (our fp32- and int8x2-activation kernels on a
[576x576] weight) swapped places from one start to the next on a noisy box. Then the same request
gave other tokens after a restart, and the compiled step, whose graph names its kernels, missed its
cache and compiled again (~20 s). A choice made once per machine is stable, and the next load skips
the timing (~2 s).

An entry is keyed by what the timing depends on: the CPU (model name, torch's capability, threads)
or the GPU, torch's version, the chooser's rules and the group's candidates. MINIVLLM_RETIME_KERNELS=1
times again and replaces the entry. A cache that cannot be read or written costs only the timing.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch

from minivllm.cache import cache_dir, read_json_entries, write_json_atomic
from minivllm.cpuinfo import cpu_model
from minivllm.env import env_flag
from minivllm.kernels.cpu.native import vnni_turned_off

log = logging.getLogger(__name__)

RULES = 4  # bump when the chooser's rules or buckets, or the kernels' relative speeds, change what a timing means
RETIME_ENV = "MINIVLLM_RETIME_KERNELS"


def path() -> Path:
    return cache_dir() / "kernel-choices.json"


def machine(device: torch.device) -> str:
    """What a timing on this machine depends on, as one string."""
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{cpu_model()} {torch.backends.cpu.get_cpu_capability()} threads={torch.get_num_threads()}"
        where += " no-vnni" if vnni_turned_off() else ""  # another kernel set: timed apart
    return f"rules {RULES} | torch {torch.__version__} | {where}"


def entry_key(device: torch.device, group: str, candidates: list[str], mode: str | None) -> str:
    text = f"{machine(device)} | {group} | {','.join(candidates)} | {mode or 'precise'}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def lookup(key: str) -> tuple[list[tuple[int, str]], dict[int, dict[str, float]]] | None:
    """The stored (plan, timings) for this key, unless MINIVLLM_RETIME_KERNELS asks to time again or
    the entry is malformed (then the caller times again and replaces it)."""
    if env_flag(RETIME_ENV):
        return None
    entry = _read().get(key)
    if entry is None:
        return None
    try:
        return _decode(entry)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        log.warning("ignoring a malformed kernel choice in %s (%r)", path(), exc)
        return None


def store(key: str, plan: list[tuple[int, str]], timings_ms: dict[int, dict[str, float]]) -> None:
    entries = _read()
    entries[key] = {
        "plan": [list(step) for step in plan],
        "timings_ms": {str(rows): t for rows, t in timings_ms.items()},
    }
    write_json_atomic(path(), entries)


def best_in_turns(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Each candidate's fastest of `rounds` runs (a run returns its seconds), the candidates taking turns: a busy
    spell on the machine slows one run of each, not every run of one, and the fastest run is what a candidate
    costs undisturbed. Timed one after another (medians), a compiler running beside a load once made torch's int4
    kernel with emulated bf16 look faster than ours on an AVX2 box, a choice then kept for every later load."""
    best = dict.fromkeys(runs, math.inf)
    for _ in range(rounds):
        for name, run in runs.items():
            best[name] = min(best[name], run())
    return best


def kept_or_timed(
    key: str, time, plan_from, usable=lambda plan: True
) -> tuple[list[tuple[int, str]], dict[int, dict[str, float]], bool]:
    """The plan this machine chose before under `key` (if `usable`), else `plan_from(time())`, kept for
    the next load. Returns (plan, timings in ms, whether it was kept from before)."""
    stored = lookup(key)
    if stored is not None and usable(stored[0]):
        return *stored, True
    timings = time()
    plan = plan_from(timings)
    store(key, plan, timings)
    return plan, timings, False


def _decode(entry: dict) -> tuple[list[tuple[int, str]], dict[int, dict[str, float]]]:
    plan = [(int(rows), str(name)) for rows, name in entry["plan"]]
    timings = {int(rows): {str(n): float(ms) for n, ms in t.items()} for rows, t in entry["timings_ms"].items()}
    return plan, timings


def _read() -> dict:
    return read_json_entries(path())
