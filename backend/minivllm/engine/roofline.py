"""This machine's two walls for a step: streaming bandwidth (bytes/s) and the products' peak rate (FLOP/s).

Measured on each of a machine's first READINGS starts (~0.1-0.2 s on a quiet CPU, ~1 s on a saturated one,
and a 128 MiB buffer's worth of peak RSS), before the engine serves, and kept at each rate's best in the cache
folder beside the kernel choices, keyed like them by the CPU (model, capability, threads) or the GPU and
torch's version; later starts read it. Several readings at different times, because one taken in a busy
moment would otherwise stand for good (a 2-core box kept 20 GB/s where it streams 30-33, and the dashboard
drew its memory floor 1.5x too slow); a reading at every start would cost every start that peak (the
embedded model's start peaked at 607 MiB instead of 475). Engines built one after another in a process
(tests) measure once. MINIVLLM_RETIME_KERNELS=1 starts the readings afresh.

Methods: bandwidth is a full read of a buffer past most L3 caches (a sum over 128 MiB on a CPU, a
device-to-device copy counted as read + write on a GPU). Peak is a square fp32 matmul (bf16 on a GPU)
through torch's BLAS: our int8-dot kernels can beat it on a CPU with VNNI, so the compute floor it gives
is an estimate, not a bound. Each rate is the best of a few runs and of the kept readings: a floor is the
optimistic bound, so a busy moment's slower runs should not set it.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minivllm.cache import cache_dir, read_json_entries, write_json_atomic
from minivllm.cpuinfo import cpu_model
from minivllm.env import env_flag

log = logging.getLogger(__name__)

BUFFER_BYTES = 128 * 2**20
MATMUL_SIZE = {"cpu": 512, "cuda": 4096}
REPEATS = 3
READINGS = 3  # starts that measure before the kept best stands
REMEASURE_ENV = "MINIVLLM_RETIME_KERNELS"


@dataclass(frozen=True)
class MachineRates:
    bandwidth_gbs: float  # GB/s streamed
    peak_gflops: float  # GFLOP/s of a large product


_in_process: dict[str, MachineRates] = {}


def machine_rates(device: torch.device | str) -> MachineRates:
    """This machine's rates: this process's, else the kept best once it has READINGS readings, else one
    measured now and raised to the kept best."""
    device = torch.device(device)
    key = _machine_key(device)
    if key in _in_process and not env_flag(REMEASURE_ENV):
        return _in_process[key]
    kept, readings = (None, 0) if env_flag(REMEASURE_ENV) else _read(key)
    if kept is None or readings < READINGS:
        kept, readings = _best(measure(device), kept), readings + 1
        entries = read_json_entries(_path())
        entries[key] = {"bandwidth_gbs": kept.bandwidth_gbs, "peak_gflops": kept.peak_gflops, "readings": readings}
        write_json_atomic(_path(), entries)
    _in_process[key] = kept
    return kept


def _best(now: MachineRates, kept: MachineRates | None) -> MachineRates:
    """Each rate's best of two readings: a floor is the optimistic bound."""
    if kept is None:
        return now
    return MachineRates(max(now.bandwidth_gbs, kept.bandwidth_gbs), max(now.peak_gflops, kept.peak_gflops))


def measure(device: torch.device) -> MachineRates:
    if device.type == "cuda":
        src = torch.ones(BUFFER_BYTES // 4, device=device)
        dst = torch.empty_like(src)
        bandwidth = 2 * BUFFER_BYTES / _best_seconds(lambda: dst.copy_(src), device) / 1e9
        dtype = torch.bfloat16
    else:
        buffer = torch.ones(BUFFER_BYTES // 4)  # written: its pages are faulted in already
        bandwidth = BUFFER_BYTES / _best_seconds(buffer.sum, device, warm=False) / 1e9
        dtype = torch.float32
    n = MATMUL_SIZE["cuda" if device.type == "cuda" else "cpu"]
    a = torch.randn(n, n, device=device, dtype=dtype)
    peak = 2 * n**3 / _best_seconds(lambda: a @ a, device) / 1e9
    return MachineRates(round(bandwidth, 2), round(peak, 1))


def _best_seconds(fn: Callable[[], object], device: torch.device, warm: bool = True) -> float:
    """The fastest of REPEATS runs of `fn`, after one untimed run if `warm` (lazy init, packing)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if warm:
        fn()
        sync()
    runs = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        sync()
        runs.append(time.perf_counter() - start)
    return max(min(runs), 1e-9)


def _path():
    return cache_dir() / "machine-rates.json"


def _machine_key(device: torch.device) -> str:
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{cpu_model()} {torch.backends.cpu.get_cpu_capability()} threads={torch.get_num_threads()}"
    text = f"torch {torch.__version__} | {where} | {BUFFER_BYTES} | {MATMUL_SIZE}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _read(key: str) -> tuple[MachineRates | None, int]:
    """The kept rates and how many readings they are the best of (an entry from before counting: one)."""
    entry = read_json_entries(_path()).get(key)
    try:
        rates = MachineRates(float(entry["bandwidth_gbs"]), float(entry["peak_gflops"]))
        readings = int(entry.get("readings", 1))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None, 0
    return (rates, readings) if rates.bandwidth_gbs > 0 and rates.peak_gflops > 0 else (None, 0)
