"""Where build artifacts persist between runs (inductor's kernels, our native extension)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$MINIVLLM_CACHE_DIR, else ~/.cache/minivllm."""
    return Path(os.environ.get("MINIVLLM_CACHE_DIR") or Path.home() / ".cache" / "minivllm")
