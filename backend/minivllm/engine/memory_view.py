"""Where the process's RSS goes: weights, KV pool, compiled kernels, torch, other libraries, the rest.

Each part is measured, not estimated, from Linux's view of this process (engine/proc_maps.py):
- weights and the KV pool: the resident pages of their tensors' address ranges (/proc/self/pagemap),
  so an mmapped file or an untouched pool counts only what is in RAM; a storage shared by two tensors
  (tied embeddings) counts once. MKL-packed copies are opaque: counted at their weight's size.
- compiled, torch, libraries: the Rss of the .so mappings in /proc/self/smaps, by path.
- other: RSS (the sum of every mapping's Rss) less the above, never below 0 (`clamped` says so).
Reading smaps and pagemap costs 20-50 ms (500 mappings once torch is loaded; most of it the kernel
writing smaps), so a measurement is kept for `INTERVAL_S` and the next one taken on a worker thread:
no engine step waits for it (only the very first is taken inline). The view holds addresses, never
the tensors, so a dropped pool is freed (its pages then read as not resident). On CUDA the weights and
pool sit in device memory and count 0 here (`kv_reserved` still reports the pool's allocation).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import torch

from minivllm.cache import cache_dir
from minivllm.engine.memory_budget import process_rss_bytes
from minivllm.engine.proc_maps import Mapping, read_smaps, resident_bytes
from minivllm.events.types import MemorySplit
from minivllm.loader.install_quantized import stored_bytes, weight_tensors
from minivllm.model.attention import KVCache

INTERVAL_S = 5.0
LIBRARY_PARTS = ("compiled", "torch", "libraries")


class MemoryView:
    """The split for one model and KV pool, measured at most every `interval_s` seconds."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache | None, interval_s: float = INTERVAL_S):
        self.weight_ranges, self.packed_bytes = _weight_ranges(model)
        pool = [*kv_cache.k, *kv_cache.v] if kv_cache is not None else []
        self.kv_ranges = _cpu_ranges(pool)
        self.kv_reserved = kv_cache.num_bytes if kv_cache is not None else 0
        self.interval_s = interval_s
        self._last: tuple[float, MemorySplit] | None = None
        self.refresh: threading.Thread | None = None  # the measurement under way, if any

    def latest(self, now: float) -> MemorySplit:
        """The latest split; past `interval_s` seconds (engine time) since it was asked for, the next
        one starts on a worker thread and this call still returns the previous one."""
        if self._last is None:
            self._last = (now, self.measure())
        elif now - self._last[0] >= self.interval_s and not (self.refresh and self.refresh.is_alive()):
            self._last = (now, self._last[1])  # the interval restarts now: one refresh at a time
            self.refresh = threading.Thread(target=self._measure_into_last, args=(now,), daemon=True)
            self.refresh.start()
        return self._last[1]

    def _measure_into_last(self, now: float) -> None:
        self._last = (now, self.measure())

    def measure(self) -> MemorySplit:
        start = time.perf_counter()
        mappings = read_smaps()
        weights = resident_bytes(self.weight_ranges)
        kv = resident_bytes(self.kv_ranges)
        if mappings is None or weights is None or kv is None:
            return MemorySplit(rss=process_rss_bytes(), kv_reserved=self.kv_reserved)
        split = split_mappings(mappings, weights + self.packed_bytes, kv, code_dirs(), torch_dir())
        split.kv_reserved = self.kv_reserved
        split.cost_ms = (time.perf_counter() - start) * 1e3
        return split


def split_mappings(
    mappings: list[Mapping], weights: int, kv_cache: int, code_folders: tuple[str, ...], torch_folder: str
) -> MemorySplit:
    """The split of `mappings`' resident bytes, given the weights' and pool's resident bytes (pure)."""
    rss = sum(m.rss for m in mappings)
    parts = dict.fromkeys(LIBRARY_PARTS, 0)
    for m in mappings:
        kind = library_kind(m.path, code_folders, torch_folder)
        if kind is not None:
            parts[kind] += m.rss
    named = weights + kv_cache + sum(parts.values())
    return MemorySplit(
        rss=rss, weights=weights, kv_cache=kv_cache, **parts, other=max(0, rss - named), clamped=named > rss
    )


def library_kind(path: str, code_folders: tuple[str, ...], torch_folder: str) -> str | None:
    """Which library part a mapped file belongs to: shared objects only (None for anything else)."""
    if not path.startswith("/") or ".so" not in os.path.basename(path):
        return None
    if path.startswith(code_folders):
        return "compiled"
    return "torch" if path.startswith(torch_folder) else "libraries"


def code_dirs() -> tuple[str, ...]:
    """Where compiled kernels live: our cache (inductor's and the native extension's there by
    default), inductor's and torch extensions' own folders where a user moved them, and Triton's."""
    user = os.environ.get("USER") or str(os.getuid())
    folders = [
        cache_dir(),
        os.environ.get("TORCHINDUCTOR_CACHE_DIR") or Path(tempfile.gettempdir()) / f"torchinductor_{user}",
        os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions",
        os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache",  # CUDA: Triton's launchers
    ]
    return tuple(str(Path(f).resolve()) + os.sep for f in folders)


def torch_dir() -> str:
    return str(Path(torch.__file__).parent.resolve()) + os.sep


def _weight_ranges(model: torch.nn.Module) -> tuple[list[tuple[int, int]], int]:
    """The weights' distinct CPU storages as address ranges, and the bytes no range shows (MKL packs)."""
    tensors = weight_tensors(model)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return _cpu_ranges(tensors), stored_bytes(model) - sum(storages.values())


def _cpu_ranges(tensors) -> list[tuple[int, int]]:
    ranges = set()
    for t in tensors:
        if t.device.type == "cpu" and t.layout == torch.strided:
            storage = t.untyped_storage()
            ranges.add((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return sorted(ranges)
