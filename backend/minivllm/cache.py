"""Where build artifacts persist between runs (inductor's kernels, our native extension)."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


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


def read_json(path: Path):
    """A cache file's JSON value; None when it is missing or damaged (then the caller measures or
    converts again and rewrites it whole)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s (%s)", path, exc)
        return None


def read_json_entries(path: Path) -> dict:
    """A cache file's {key: entry} mapping; {} when it is missing, damaged or not a mapping."""
    entries = read_json(path)
    return entries if isinstance(entries, dict) else {}


def write_json_atomic(path: Path, entries: dict) -> None:
    """Writes the file under a temporary name, then renames it: a reader sees the old file or the new
    one. A folder that cannot be written costs only the caching (a warning)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=f".{path.stem}-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f)
        os.replace(staging, path)
    except OSError as exc:
        log.warning("cannot write %s (%s); the next start measures again", path, exc)
