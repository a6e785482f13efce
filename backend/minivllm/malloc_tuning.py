"""glibc malloc settings that keep a CPU engine's per-step temporaries from page-faulting.

glibc serves allocations above a threshold with fresh mmaps and hands freed memory at the top of
its heap back to the OS. A decode step at 32 sequences allocates multi-MB tensors every step (the
[32, vocab] logits, K/V gathers, log-sum-exp temporaries); with the default policy each one was
faulted in page by page again: ~3,000 minor page faults per step on the dev box, 20-30% of the
step (sampling alone went from ~4 to ~14 ms). Raising the mmap threshold to its maximum (32 MiB)
and never trimming keeps freed memory in the heap for the next step: 0 faults per step. The
cost: the process holds on to its peak heap, which an inference server does anyway.

Loading is another matter: it converts tensors through many temporaries of a few MiB, which those
settings keep too. Measured on the default model, 300-340 MiB of a 1.3-1.4 GiB RSS was free heap
after start-up, all of it handed back by one `malloc_trim(0)` (RSS 1.32 -> 1.02 GiB eager, 1.40 ->
1.06 GiB compiled); the steps' own temporaries come back once and stay. RSS is what `ps` and a
container's memory limit count.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1  # from glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MAX_MMAP_THRESHOLD = 32 * 2**20  # glibc refuses more on 64-bit
NEVER_TRIM = 2**31 - 1


def keep_freed_memory_for_reuse() -> bool:
    """Applies the settings process-wide; False where they do not apply (not glibc, or turned off
    with MINIVLLM_NO_MALLOC_TUNING=1 for A/B comparisons)."""
    if not sys.platform.startswith("linux") or os.environ.get("MINIVLLM_NO_MALLOC_TUNING") == "1":
        return False
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    return mallopt(M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) == 1


def release_free_heap() -> bool:
    """Hands the heap's free pages back to the OS (after an engine build); whether anything was
    released (False where the C library has no malloc_trim)."""
    trim = _libc_function("malloc_trim")
    return bool(trim(0)) if trim is not None else False


def _libc_function(name: str):
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):  # another libc (musl has no mallopt)
        return None
