"""`minivllm bench pages`: decode throughput with the weights on 2 MiB transparent huge pages (as the
loader leaves them where Linux offers huge pages, loader/huge_pages.py) against the same model with
its weights on 4 KiB pages (`MINIVLLM_NO_HUGE_PAGES=1`): two engines in one process, alternating
rounds, medians (these machines are noisy), each level's weight-read floor beside them."""

from __future__ import annotations

import os

from minivllm.bench.common import progress
from minivllm.bench.compiled import RoundsRun, rounds_setup, time_levels, write_runs
from minivllm.bench.machine import machine_line
from minivllm.bench.report import plot_paired_bars
from minivllm.engine.api import LLMEngine
from minivllm.loader.huge_pages import thp_mode
from minivllm.loader.weights import NO_HUGE_PAGES_ENV

SMALL, HUGE = "4 KiB pages", "2 MiB pages"


def bench_pages(engine: LLMEngine, args) -> int:
    if not engine.loaded.quant.huge_page_bytes:
        raise SystemExit(
            f"bench pages compares weights on huge pages with 4 KiB ones, but this engine's weights "
            f"are on 4 KiB pages (transparent huge pages: {thp_mode() or 'unavailable'}; "
            f"{NO_HUGE_PAGES_ENV}={os.environ.get(NO_HUGE_PAGES_ENV, '')!r})"
        )
    progress("loading the model again, its weights left on 4 KiB pages")
    engines = {SMALL: _small_pages_engine(args), HUGE: engine}
    out_dir, max_tokens, rounds, params, bandwidth = rounds_setup(args)
    runs = time_levels(
        engine.loaded.model, args.concurrency, list(engines), engines.__getitem__, rounds, params, bandwidth
    )
    title = (
        f"weights on 2 MiB vs 4 KiB pages: {engine.loaded.name} ({engine.loaded.quant.mode}), "
        f"{max_tokens} tokens per request (greedy), {rounds} round(s)"
    )
    _print(runs, title, bandwidth)
    print(machine_line())
    write_runs(out_dir / "pages.json", runs, bandwidth)
    plot = plot_paired_bars(
        [r.concurrency for r in runs],
        tuple((m, [r.median(m) for r in runs]) for m in engines),
        out_dir / "pages.png",
        title.replace(": ", ":\n", 1),
    )
    print(f"plot: {plot}")
    return 0


def _small_pages_engine(args) -> LLMEngine:
    from minivllm.engine_args import build_engine

    before = os.environ.get(NO_HUGE_PAGES_ENV)
    os.environ[NO_HUGE_PAGES_ENV] = "1"
    try:
        return build_engine(args)
    finally:
        if before is None:
            del os.environ[NO_HUGE_PAGES_ENV]
        else:
            os.environ[NO_HUGE_PAGES_ENV] = before


def _print(runs: list[RoundsRun], title: str, bandwidth: float) -> None:
    print(f"\n== {title} ==")
    print(
        f"{'concurrency':>11}{SMALL + ' tok/s':>19}{HUGE + ' tok/s':>19}{'huge / small':>14}"
        f"{'step on huge pages':>20}{'weight-read floor':>19}{'step / floor':>14}"
    )
    for r in runs:
        step = r.step_ms(HUGE) or 0.0
        ratio = f"{r.ratio(HUGE):.2f}x" if r.ratio(HUGE) else "-"
        print(
            f"{r.concurrency:>11}{r.median(SMALL):>19.1f}{r.median(HUGE):>19.1f}{ratio:>14}"
            f"{step:>17.1f} ms{r.floor_ms:>16.1f} ms{step / r.floor_ms:>13.2f}x"
        )
    print(
        f"(floor: the bytes of weights one step reads / {bandwidth:.1f} GB/s streamed, measured now; "
        f"huge pages: loader/huge_pages.py)"
    )
