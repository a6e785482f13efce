"""A loaded model's weights moved onto transparent huge pages (2 MiB), where Linux offers them.

Why: a decode step streams every weight once (~100 MB for the embedded 4-bit model, ~540 MB in fp32)
through 4 KiB pages: tens of thousands of TLB misses a step. On huge pages the embedded model's 4-bit
products at one row ran 10-14% faster (in-process A/B, docs/ARCHITECTURE.md). Linux usually gives huge
pages only to memory that asks for them (transparent_hugepage "madvise"), and torch's allocator never
asks; so after loading, the weights are copied into one anonymous mapping that asks (MADV_HUGEPAGE)
before anything touches it, and every tensor viewing them is pointed there in place (`set_`), so the
modules, kernels and views holding them need no change. One storage at a time: the load's peak grows by
the largest weight, not by the model.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch

HUGE_PAGE = 2 * 2**20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MADV_HUGEPAGE = 14  # linux/mman.h
ALIGN = 64  # each moved storage starts on a cache line, as the allocator's did


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), None where unknown."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def move_to_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Moves the CPU storages of `tensors` into one huge-page mapping; every live tensor viewing one of
    them follows (same values, shapes and strides). Returns the bytes moved: 0 where huge pages are off
    (not Linux, THP "never") or the mapping cannot ask for them."""
    if sys.platform != "linux" or thp_mode() not in ("always", "madvise"):
        return 0
    storages = _distinct_storages(tensors)
    offsets, total = {}, 0
    for ptr, storage in storages.items():
        offsets[ptr], total = total, total + -(-storage.nbytes() // ALIGN) * ALIGN
    arena = _huge_page_bytes(total) if total else None
    if arena is None:
        return 0
    viewers = _live_viewers(storages)
    target, base = arena.untyped_storage(), arena.storage_offset()
    with torch.no_grad():
        for ptr in list(storages):
            storage = storages.pop(ptr)  # dropped as soon as its viewers move: one weight's copy at a time
            start = offsets[ptr]
            arena[start : start + storage.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            del storage
            for t in viewers.pop(ptr):
                t.set_(target, (base + start) // t.element_size() + t.storage_offset(), t.shape, t.stride())
    return total


def _distinct_storages(tensors: Iterable[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    storages: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if _storage_ptr(t) is not None and t.untyped_storage().nbytes():
            storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
    return storages


def _live_viewers(storages: dict[int, torch.UntypedStorage]) -> dict[int, list[torch.Tensor]]:
    """Every live tensor object on one of `storages`, by storage: the modules' own, their kernels' and
    any view of them (a view left on the old storage would keep it alive and read 4 KiB pages)."""
    viewers: dict[int, list[torch.Tensor]] = defaultdict(list)
    for obj in gc.get_objects():  # type(obj), not isinstance: a lazy module proxy warns when asked its __class__
        if issubclass(type(obj), torch.Tensor) and (ptr := _storage_ptr(obj)) in storages:
            viewers[ptr].append(obj)
    return viewers


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:  # a compiler's fake or functional tensor has no real storage to ask about
        return t.untyped_storage().data_ptr() if t.device.type == "cpu" and t.layout == torch.strided else None
    except (RuntimeError, NotImplementedError):
        return None


def _huge_page_bytes(size: int) -> torch.Tensor | None:
    """`size` bytes (uint8) starting on a 2 MiB boundary of a fresh anonymous mapping advised to take
    huge pages; None if the advice is refused. The tensor keeps the mapping alive."""
    mapping = mmap.mmap(-1, -(-size // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    if (
        libc.madvise(ctypes.c_void_p(whole.data_ptr() + start), ctypes.c_size_t(whole.numel() - start), MADV_HUGEPAGE)
        != 0
    ):
        return None
    return whole[start : start + size]
