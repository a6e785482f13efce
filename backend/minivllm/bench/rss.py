"""Peak resident memory (what `ps` and `top` show as RSS) of this process and of one child process,
and the line that splits this process's RSS by part.

Why a child's is polled: the kernel's records of a child's peak (`wait4`, `RUSAGE_CHILDREN`) start from
its parent's resident set at the fork, so a small child of this ~500 MiB process reads as ~500 MiB.
The child's own memory map's high-water mark (VmHWM in /proc/<pid>/status) is its alone; it is read
until the child exits (a peak within the last poll interval before exit can be missed).
"""

from __future__ import annotations

import resource
import subprocess
import threading
import time
from pathlib import Path

from minivllm.events.types import MemorySplit

POLL_S = 0.02


def own_peak_rss_bytes() -> int:
    """This process's largest resident set so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def high_water_rss_bytes(pid: int) -> int:
    """A live process's largest resident set so far (0 once it has exited, or without /proc)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def run_with_peak_rss(cmd: list[str], timeout_s: float | None = None) -> tuple[subprocess.CompletedProcess, int]:
    """`subprocess.run(cmd, capture_output=True, text=True)` that also returns the child's peak RSS in
    bytes. Raises subprocess.TimeoutExpired (after killing the child) past `timeout_s`."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    captured: dict[str, str] = {}
    readers = [
        threading.Thread(target=lambda name=name, stream=stream: captured.__setitem__(name, stream.read()), daemon=True)
        for name, stream in (("out", proc.stdout), ("err", proc.stderr))
    ]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout_s if timeout_s else None
    peak = 0
    while proc.poll() is None:
        peak = max(peak, high_water_rss_bytes(proc.pid))
        if deadline is not None and time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise subprocess.TimeoutExpired(cmd, timeout_s)
        time.sleep(POLL_S)
    for reader in readers:
        reader.join()
    return subprocess.CompletedProcess(cmd, proc.returncode, captured["out"], captured["err"]), peak


def split_line(split: MemorySplit | None) -> str:
    """The engine's latest RSS split (engine/memory_view.py, at most a few seconds old) as one line."""
    if split is None:
        return "RSS split: not measured"
    parts = ("weights", "kv_cache", "compiled", "torch", "libraries", "other")
    shown = ", ".join(f"{p} {_mib(getattr(split, p))}" for p in parts)
    return f"RSS split (MiB): {_mib(split.rss)} = {shown} (KV pool reserved {_mib(split.kv_reserved)})" + (
        " [named parts exceeded the RSS: other clamped to 0]" if split.clamped else ""
    )


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:.0f}"
