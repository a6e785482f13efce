"""Where build artifacts persist between runs (inductor's kernels, our native extension)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$MINIVLLM_CACHE_DIR, else ~/.cache/minivllm."""
    return Path(os.environ.get("MINIVLLM_CACHE_DIR") or Path.home() / ".cache" / "minivllm")


def route_compiler_cache() -> None:
    """Send inductor's kernels to our cache folder unless the user chose theirs. It must run before
    anything asks torch for its cache folder: the first ask writes torch's default (/tmp, lost at a
    reboot and outside a container's volume) into TORCHINDUCTOR_CACHE_DIR for the whole process, and
    merely importing the quantization code asks."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))


def compiler_cache_dir() -> str:
    """Where inductor keeps its kernels in this process (as routed above, or as the user set it)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    return inductor_cache_dir()
