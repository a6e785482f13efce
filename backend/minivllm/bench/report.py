"""Printing benchmark tables side by side and plotting them."""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict
from pathlib import Path

from minivllm.bench.common import RunResult, fmt, median, p90

HEADER = (
    f"{'mode':<34} {'conc':>4} {'reqs':>4} {'tok/s':>8} {'decode tok/s':>12} {'TTFT med':>9} "
    f"{'TTFT p90':>9} {'TPOT med':>9} {'TPOT p90':>9} {'KV blocks':>9}"
)


def row(r: RunResult) -> str:
    return (
        f"{r.mode:<34} {r.concurrency:>4} {r.num_requests:>4} {r.tokens_per_s:>8.1f} "
        f"{fmt(r.decode_tokens_per_s):>12} {fmt(median(r.ttft_s), 1e3, 0):>7}ms {fmt(p90(r.ttft_s), 1e3, 0):>7}ms "
        f"{fmt(median(r.tpot_s), 1e3, 1):>7}ms {fmt(p90(r.tpot_s), 1e3, 1):>7}ms {fmt(r.kv_blocks_used, 1, 0):>9}"
    )


def print_table(results: list[RunResult], title: str) -> None:
    print(f"\n== {title} ==")
    print(HEADER)
    print("-" * len(HEADER))
    for r in results:
        print(row(r))


def save_json(results: list[RunResult], path: Path, extra: dict | None = None) -> None:
    payload = {"runs": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results], **(extra or {})}
    path.write_text(json.dumps(payload, indent=2))


def plot_throughput(results: list[RunResult], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r.mode for r in results))
    levels = sorted({r.concurrency for r in results})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(modes), 1)
    for i, mode in enumerate(modes):
        for ax, value in ((axes[0], lambda r: r.tokens_per_s), (axes[1], lambda r: (median(r.tpot_s) or 0) * 1e3)):
            xs, ys = [], []
            for j, level in enumerate(levels):
                match = [r for r in results if r.mode == mode and r.concurrency == level]
                if match:
                    xs.append(j + i * width)
                    ys.append(value(match[0]))
            ax.bar(xs, ys, width=width, label=mode)
    for ax, label in (
        (axes[0], "generated tokens/s (higher is better)"),
        (axes[1], "median TPOT ms (lower is better)"),
    ):
        ax.set_xticks(
            [j + width * (len(modes) - 1) / 2 for j in range(len(levels))], [f"{c} concurrent" for c in levels]
        )
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def wrapped(title: str, width: int = 100) -> str:
    """A plot title in lines that fit the figure (its own line breaks kept)."""
    return "\n".join(part for line in title.split("\n") for part in textwrap.wrap(line, width) or [""])


def plot_paired_bars(
    levels: list[int],
    series: tuple[tuple[str, list[float]], ...],
    path: Path,
    title: str,
    decorate=None,
    ylabel: str = "decode tokens/s (median)",
) -> Path:
    """Side-by-side bars per concurrency level, one per setup (medians already taken); `decorate(ax, xs,
    offset)` may draw more before the legend (offset: the last bar's, from each level's x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = list(range(len(levels)))
    width = 0.8 / len(series)
    offsets = [width * (i - (len(series) - 1) / 2) for i in range(len(series))]
    for offset, (label, values) in zip(offsets, series):
        ax.bar([x + offset for x in xs], values, width=width, label=label)
    if decorate is not None:
        decorate(ax, xs, offsets[-1])
    ax.set_xticks(xs, [f"{level} concurrent" for level in levels])
    ax.set_ylabel(ylabel)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.3)  # headroom: the legend and the bars' labels never overlap
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(wrapped(title), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
