"""Inductor's check of the CPU's vector instruction sets, answered from the cache after the first start.

Why: before its first kernel, inductor checks every vector ISA the CPU reports (AVX2, AVX-512, VNNI,
...) by compiling a small library with that ISA's flags and loading it in a fresh Python process,
in every process: 1.4 s of a ~14 s warm start on an AVX-512 box (three probes). The answer depends
only on the CPU, the C++ compiler and torch, so the first start keeps it per machine; when every ISA
passed, later starts tell inductor so (`cpp.vec_isa_ok = True`, the same answer without the probes).
When one failed, nothing is kept and inductor probes as usual. A user's own TORCHINDUCTOR_VEC_ISA_OK
always wins.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import torch

from minivllm.cache import cache_dir, read_json_entries, write_json_atomic
from minivllm.cpuinfo import cpu_model, cpuinfo_field


def path() -> Path:
    return cache_dir() / "vec-isa.json"


def machine_key() -> str:
    """The CPU (name and flags), the compiler (its path and modification time) and torch's version."""
    compiler = shutil.which("g++") or shutil.which("c++") or ""
    stamp = Path(compiler).stat().st_mtime_ns if compiler else 0
    text = f"{torch.__version__} | {cpu_model()} | {_cpu_flags()} | {compiler} {stamp}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def use_kept_probe() -> bool:
    """Skips inductor's probes when this machine's first start found every ISA working; else lets them
    run and keeps their answer. Returns whether the probes were skipped."""
    from torch._inductor import config

    if config.cpp.vec_isa_ok is not None:  # the user's choice (TORCHINDUCTOR_VEC_ISA_OK)
        return False
    key, entries = machine_key(), read_json_entries(path())
    if entries.get(key) == "all":
        config.cpp.vec_isa_ok = True
        return True
    if _every_isa_passes():
        write_json_atomic(path(), entries | {key: "all"})
    return False


def _every_isa_passes() -> bool:
    """Runs inductor's probes now (it would at the first compile; their results stay cached in this
    process) and compares what passed with what the CPU reports."""
    from torch._inductor import config, cpu_vec_isa

    passed = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    with config.patch({"cpp.vec_isa_ok": True}):  # every ISA the CPU reports, none built
        reported = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list.__wrapped__()]
    return bool(reported) and passed == reported


def _cpu_flags() -> str:
    return hashlib.sha256(cpuinfo_field("flags").encode()).hexdigest()[:16]
