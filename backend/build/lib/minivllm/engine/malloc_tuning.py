"""glibc malloc settings that keep a CPU engine's per-step temporaries from page-faulting.

glibc serves allocations above a threshold with fresh mmaps and hands freed memory at the top of
its heap back to the OS. A decode step at 32 sequences allocates multi-MB tensors every step (the
[32, vocab] logits, K/V gathers, log-sum-exp temporaries); with the default policy each one was
faulted in page by page again: ~3,000 minor page faults per step on the dev box, 20-30% of the
step (sampling alone went from ~4 to ~14 ms). Raising the mmap threshold to its maximum (32 MiB)
and never trimming keeps freed memory in the heap for the next step: 0 faults per step. The
cost: the process holds on to its peak heap, which an inference server does anyway.
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
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # another libc (musl has no mallopt)
        return False
    return mallopt(M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) == 1
