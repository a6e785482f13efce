"""`minivllm bench spec`: speculative decoding against none, side by side in one run, for every
method and K, one stream and 8 concurrent, on free chat and on input-grounded work (answers that
repeat the prompt). Prints speedup, acceptance rate and mean accepted length; plots the speedups.

These machines are noisy (a run can be 25% off the next), so each setup is measured in pairs with
the engine without speculation, alternating, and its speedup is the median of the pairs' ratios."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from minivllm.bench.common import chat_prompt_ids, median, precision_label, progress, run_engine
from minivllm.bench.machine import machine_line
from minivllm.bench.prompts import CHAT_PROMPTS, GROUNDED_PROMPTS
from minivllm.engine.api import LLMEngine
from minivllm.engine.factory import engine_for
from minivllm.sampling.params import SamplingParams
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.factory import load_draft

CONCURRENT = 8
PAIRS = 2  # alternating (off, setup) measurements per setup, workload and concurrency


@dataclass
class SpecRun:
    setup: str
    workload: str
    concurrency: int
    tokens_per_s: float  # one stream: median decode rate per request; concurrent: all tokens / wall
    acceptance: float | None  # accepted / drafted tokens
    mean_accepted: float | None  # accepted drafts per verify step
    speedup: float = 1.0


def spec_grid(num_layers: int, draft_model: str, quick: bool) -> list[tuple[str, dict | None]]:
    """(label, config) for every setup; `disable_by_batch_size` stays at its default. "fixed"
    setups draft k tokens whenever they can (vLLM's behaviour); the others let the planner decide."""
    early, late = max(1, num_layers * 8 // 30), max(1, num_layers * 24 // 30)
    ngram = {"method": "ngram"}
    draft = {"method": "draft_model", "model": draft_model, "quantization": "int4"}
    fixed = {"adaptive": False}
    grid: list[tuple[str, dict | None]] = [("off", None)]
    grid += [(f"ngram k={k}", {**ngram, "num_speculative_tokens": k}) for k in ((4,) if quick else (2, 4, 6))]
    grid += [("ngram k=4 fixed", {**ngram, "num_speculative_tokens": 4, **fixed})]
    grid += [
        (f"draft {draft_model} int4 k={k}", {**draft, "num_speculative_tokens": k})
        for k in ((2,) if quick else (2, 3, 4))
    ]
    grid += [(f"draft {draft_model} int4 k=3 fixed", {**draft, "num_speculative_tokens": 3, **fixed})]
    # the seed project's grid: K in {2, 4} x an early and a late exit, drafting every step
    grid += [
        (
            f"early exit L{layer}/{num_layers} k={k} fixed",
            {"method": "early_exit", "exit_layer": layer, "num_speculative_tokens": k, **fixed},
        )
        for layer in ((early,) if quick else (early, late))
        for k in ((2,) if quick else (2, 4))
        if 1 <= layer < num_layers
    ]
    return grid


def bench_spec(engine: LLMEngine, args) -> int:
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    max_tokens = 24 if args.quick else args.max_tokens
    workloads = {
        "chat": chat_prompt_ids(engine.tokenizer, CHAT_PROMPTS[:CONCURRENT]),
        "grounded": chat_prompt_ids(engine.tokenizer, (GROUNDED_PROMPTS * 2)[:CONCURRENT]),
    }
    draft_spec = getattr(args, "draft_model", None) or "embedded"
    grid = spec_grid(engine.loaded.config.num_hidden_layers, draft_spec, args.quick)
    only = getattr(args, "only", None)
    if only:
        grid = [(label, config) for label, config in grid if label == "off" or label.split()[0] in only]
    drafts: dict[str, object] = {}
    runs: list[SpecRun] = []
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    singles, pairs = (1, 1) if args.quick else (2, PAIRS)
    warm_up = SamplingParams(temperature=0.0, max_tokens=4)
    run_engine(engine, workloads["chat"][:1], warm_up, "warm-up", 1)
    for label, config in grid:
        spec = SpeculativeConfig.parse(config)
        setup = (
            engine
            if spec is None
            else engine_for(engine.loaded, engine.config, speculative=spec, draft=_draft(spec, engine, drafts))
        )
        _fault_in(setup)
        run_engine(setup, workloads["chat"][:1], warm_up, "warm-up", 1)
        for workload, prompts in workloads.items():
            progress(
                f"{label}: {workload}, one stream ({singles} prompts) and {CONCURRENT} concurrent, "
                f"{pairs} pair(s) with speculation off"
            )
            for batches, concurrency in (([[p] for p in prompts[:singles]], 1), ([prompts], CONCURRENT)):
                runs.append(_paired(engine, setup, label, workload, batches, params, concurrency, pairs))
        del setup
    title = f"{engine.loaded.name} target, {precision_label(engine)}, greedy, {max_tokens} new tokens"
    _print(runs, title)
    (out_dir / "spec.json").write_text(
        json.dumps({"title": title, "machine": machine_line(), "runs": [r.__dict__ for r in runs]}, indent=2)
    )
    print(f"plot: {plot_spec(runs, out_dir / 'spec.png', 'speculative decoding: ' + title)}")
    return 0


def _fault_in(engine: LLMEngine) -> None:
    """Touch every page of a fresh engine's KV pool: its first writes would otherwise page-fault
    (the pool is allocated lazily), a cost the long-lived baseline engine no longer pays (it
    made setups that never drafted measure ~0.9x at 8 concurrent)."""
    for pool in (*engine.kv_cache.k, *engine.kv_cache.v):
        pool.zero_()


def _draft(spec: SpeculativeConfig | None, engine: LLMEngine, cache: dict):
    """Each draft model is loaded once for the whole grid."""
    if spec is None or spec.method != "draft_model":
        return None
    key = f"{spec.model}:{spec.quantization}"
    if key not in cache:
        progress(f"loading draft model {key}")
        cache[key] = load_draft(spec, engine.loaded, engine.config.max_model_len)
    return cache[key]


def _measure(
    engine: LLMEngine,
    label: str,
    workload: str,
    batches: list[list[list[int]]],
    params: SamplingParams,
    concurrency: int,
) -> SpecRun:
    before = engine.stats()
    results = [run_engine(engine, batch, params, label, concurrency) for batch in batches]
    after = engine.stats()
    if concurrency == 1:  # a stream's decode speed: what a chat user sees after the first token
        rate = median([1.0 / t for r in results for t in r.tpot_s if t > 0]) or 0.0
    else:
        rate = sum(r.generated_tokens for r in results) / sum(r.wall_s for r in results)
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    verifies = after.spec_num_drafts - before.spec_num_drafts
    return SpecRun(
        label,
        workload,
        concurrency,
        rate,
        accepted / drafted if drafted else None,
        accepted / verifies if verifies else None,
    )


def _paired(
    baseline: LLMEngine,
    setup: LLMEngine,
    label: str,
    workload: str,
    batches,
    params: SamplingParams,
    concurrency: int,
    pairs: int,
) -> SpecRun:
    """`pairs` alternating runs of the baseline and the setup: the setup's median run (its rate
    and acceptance) with the median of the pairs' speedups."""
    runs, ratios = [], []
    for _ in range(pairs):
        base = _measure(baseline, "off", workload, batches, params, concurrency)
        run = _measure(setup, label, workload, batches, params, concurrency)
        runs.append(run)
        ratios.append(run.tokens_per_s / base.tokens_per_s if base.tokens_per_s else float("nan"))
    middle = sorted(runs, key=lambda r: r.tokens_per_s)[len(runs) // 2]
    middle.speedup = median(ratios) or float("nan")
    return middle


def _print(runs: list[SpecRun], title: str) -> None:
    print(f"\n== speculative decoding: {title} ==")
    header = f"{'setup':<34} {'workload':<9} {'conc':>4} {'tok/s':>7} {'speedup':>8} {'accept':>7} {'acc/verify':>10}"
    print(header)
    print("-" * len(header))
    for r in sorted(runs, key=lambda r: (r.workload, r.concurrency)):
        acc = f"{r.acceptance:.0%}" if r.acceptance is not None else "-"
        mean = f"{r.mean_accepted:.2f}" if r.mean_accepted is not None else "-"
        print(
            f"{r.setup:<34} {r.workload:<9} {r.concurrency:>4} {r.tokens_per_s:>7.1f} {r.speedup:>7.2f}x "
            f"{acc:>7} {mean:>10}"
        )
    print(machine_line())
    for workload in sorted({r.workload for r in runs}):
        best = max((r for r in runs if r.workload == workload and r.concurrency == 1), key=lambda r: r.speedup)
        print(f"best one-stream setup on {workload}: {best.setup}, {best.speedup:.2f}x")


def plot_spec(runs: list[SpecRun], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r.workload, r.concurrency) for r in runs})
    setups = list(dict.fromkeys(r.setup for r in runs))
    fig, ax = plt.subplots(figsize=(12, 4.8))
    width = 0.8 / len(setups)
    for i, setup in enumerate(setups):
        ys = [
            next((r.speedup for r in runs if r.setup == setup and (r.workload, r.concurrency) == g), 0.0)
            for g in groups
        ]
        ax.bar([j + i * width for j in range(len(groups))], ys, width=width, label=setup, color=plt.cm.tab20(i % 20))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(
        [j + width * (len(setups) - 1) / 2 for j in range(len(groups))],
        [f"{w}, {c} {'stream' if c == 1 else 'concurrent'}" for w, c in groups],
    )
    ax.set_ylabel("decode speed vs no speculation (x)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
