"""What a benchmark number should be read against: the CPU's vector capability as torch sees it,
the thread count, and the streaming bandwidth measured on the spot (a single decode stream is
bound by reading the weights, so this bandwidth sets its ceiling)."""

from __future__ import annotations

import statistics
import time

import torch

BANDWIDTH_BUFFER_BYTES = 256 * 2**20  # well past any L3 cache


def cpu_capability() -> str:
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # very old torch
        return "unknown"


def streaming_bandwidth_gbs(repeats: int = 5) -> float:
    """GB/s of a full read of a large buffer (a sum over 256 MiB), median of `repeats`."""
    buffer = torch.ones(BANDWIDTH_BUFFER_BYTES // 4)
    buffer.sum()  # fault the pages in
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        runs.append(time.perf_counter() - start)
    return BANDWIDTH_BUFFER_BYTES / statistics.median(runs) / 1e9


def device_bandwidth_gbs(device: torch.device, repeats: int = 5) -> float:
    """A decode step's bandwidth ceiling on `device`: the CPU's streamed read, or on a GPU a
    device-to-device copy of 1 GiB (bytes read + written), median of `repeats`, timed by events."""
    if device.type != "cuda":
        return streaming_bandwidth_gbs(repeats)
    src = torch.ones(2**28, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    runs = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * 4 / statistics.median(runs) / 1e9


def machine_line(device: torch.device | None = None) -> str:
    from minivllm.loader.huge_pages import thp_mode

    # huge pages: the weights sit on them only where the kernel offers them (loader/huge_pages.py)
    line = (
        f"machine: CPU capability {cpu_capability()}, {torch.get_num_threads()} threads, "
        f"streaming bandwidth {streaming_bandwidth_gbs():.1f} GB/s (measured now), "
        f"transparent huge pages: {thp_mode() or 'unavailable'}"
    )
    if device is not None and device.type == "cuda":
        line += (
            f"; GPU {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
            f"copy bandwidth {device_bandwidth_gbs(device):.0f} GB/s (measured now)"
        )
    return line
