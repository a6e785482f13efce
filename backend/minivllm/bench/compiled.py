"""`minivllm bench compile`: decode throughput of the compiled step, and of the native step where the
model has one (4-bit weights on our kernels), against the same engine run eagerly (`--enforce-eager`'s
path); on CUDA, of CUDA graphs (with the Triton decode attention and with the portable one); side by
side in alternating rounds (medians: these machines are noisy), with each level's
weight-read floor: the bytes of weights one step reads over the streaming bandwidth measured on the
spot. One engine serves every side (the compiled and native steps are switched off and on), so the
weights, the KV pool and the prompts are the same."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from minivllm.bench.common import chat_prompt_ids, median, progress, run_engine
from minivllm.bench.machine import device_bandwidth_gbs, machine_line
from minivllm.bench.prompts import CHAT_PROMPTS
from minivllm.bench.report import plot_paired_bars
from minivllm.engine.api import LLMEngine
from minivllm.loader.install_quantized import streamed_bytes
from minivllm.model import attention
from minivllm.model.compiled import attach_compiled_step
from minivllm.model.cuda_graphs import DecodeGraphs
from minivllm.sampling.params import SamplingParams


@dataclass
class RoundsRun:
    """One concurrency level of a rounds benchmark (bench compile, bench pages): each mode's samples."""

    concurrency: int
    tok_s: dict[str, list[float]]  # per mode (MODES), one sample a round
    floor_ms: float  # the weight-read floor of one step at this concurrency

    def median(self, mode: str) -> float:
        return median(self.tok_s.get(mode, [])) or 0.0

    def ratio(self, mode: str) -> float | None:
        """`mode`'s throughput over the first mode's (the baseline: eager here)."""
        base, other = self.median(next(iter(self.tok_s))), self.median(mode)
        return other / base if base and other else None

    def step_ms(self, mode: str) -> float | None:
        tok_s = self.median(mode)
        return self.concurrency / tok_s * 1e3 if tok_s else None


# How each mode runs decode steps: (the compiled layer step on, the native step on)
MODES = {"eager": (False, False), "compiled": (True, False), "native": (True, True)}


def _use(engine: LLMEngine, mode: str, compiled, native_step) -> LLMEngine:
    """The engine, its model switched to `mode`."""
    on_compiled, on_native = MODES[mode]
    engine.loaded.model.compiled = compiled if on_compiled else None
    engine.loaded.model.native_step = native_step if on_native else None
    return engine


def bench_compile(engine: LLMEngine, args) -> int:
    if engine.runner.graphs is not None:
        return bench_graphs(engine, args)
    model = engine.loaded.model
    attach_compiled_step(model)  # none was built where the native step runs every decode step
    compiled, native_step = model.compiled, model.native_step
    if compiled is None or not compiled.active:
        raise SystemExit(
            f"bench compile compares the compiled step with eager, but this engine runs "
            f"{model.compilation()}: drop --enforce-eager"
        )
    modes = [m for m in MODES if m != "native" or native_step is not None]  # native: every product on our kernels
    out_dir, max_tokens, rounds, params, bandwidth = rounds_setup(args)
    try:
        if native_step is not None:  # the engine's warm-up ran natively: compile the graphs now, not in a timed run
            _use(engine, "compiled", compiled, native_step)
            engine.runner.warmed_up(engine.config.max_num_seqs, engine.max_model_len)
        runs = time_levels(
            model,
            args.concurrency,
            modes,
            lambda mode: _use(engine, mode, compiled, native_step),
            rounds,
            params,
            bandwidth,
        )
    finally:
        model.compiled, model.native_step = compiled, native_step
    title = (
        f"decode step modes vs eager: {engine.loaded.name} ({engine.loaded.quant.mode}), "
        f"{max_tokens} tokens per request (greedy), {rounds} round(s)"
    )
    _print(runs, modes, title, bandwidth)
    print(machine_line())
    write_runs(out_dir / "compile.json", runs, bandwidth)
    print(f"plot: {plot_compile(runs, modes, out_dir / 'compile.png', title)}")
    return 0


def bench_graphs(engine: LLMEngine, args) -> int:
    """On CUDA: decode steps replayed from CUDA graphs, of eager kernels and (where the layers
    compiled) of the compiled layers', against the same engine's eager steps; where the Triton decode
    attention serves the pool, also graphs of eager kernels with the portable attention instead
    ("sdpa graphs": gather + mask + SDPA), so one run compares the two attentions."""
    runner, model, device = engine.runner, engine.loaded.model, torch.device(engine.loaded.device)
    graphs, compiled, use_triton = runner.graphs, model.compiled, attention.USE_TRITON_DECODE
    variants = {"eager": None, "graphs": graphs}
    if compiled is not None and compiled.active:  # the engine's graphs hold the compiled layers: capture eager ones
        model.compiled = None
        variants["graphs"] = _eager_graphs(model, runner.kv_cache, graphs)
        variants["compiled graphs"] = graphs
    if attention.reads_pool_with_triton(runner.kv_cache.k[0]):
        variants = {
            "eager": None,
            "sdpa graphs": _portable_attention_graphs(model, runner.kv_cache, graphs),
            **{m: g for m, g in variants.items() if m != "eager"},
        }
    modes = list(variants)
    out_dir, max_tokens, rounds, params, bandwidth = rounds_setup(args, device)

    def use(mode: str) -> LLMEngine:
        runner.graphs = variants[mode]
        attention.USE_TRITON_DECODE = use_triton and mode != "sdpa graphs"  # steps no graph holds, alike
        return engine

    try:
        runs = time_levels(model, args.concurrency, modes, use, rounds, params, bandwidth)
    finally:
        runner.graphs, model.compiled, attention.USE_TRITON_DECODE = graphs, compiled, use_triton
    dtype, quant = str(engine.loaded.dtype).removeprefix("torch."), engine.loaded.quant.mode
    precision = dtype if quant in (dtype, "none") else f"{quant}, {dtype} activations"
    title = (
        f"CUDA graphs vs eager: {engine.loaded.name} ({precision}), {max_tokens} tokens per request "
        f"(greedy), {rounds} round(s)"
    )
    _print(
        runs,
        modes,
        title,
        bandwidth,
        "graphs: decode steps replayed from CUDA graphs, model/cuda_graphs.py; "
        "eager: every kernel launched from Python, prefill eager in every mode",
    )
    if "sdpa graphs" in modes:
        ratios = ", ".join(f"{_ratio(r, 'graphs', 'sdpa graphs')} at {r.concurrency}" for r in runs)
        print(
            f"(graphs: decode attention by the Triton kernel, kernels/triton/attention.py; sdpa graphs: by gather + "
            f"mask + SDPA; graphs / sdpa graphs: {ratios})"
        )
    print(machine_line(device))
    write_runs(out_dir / "graphs.json", runs, bandwidth)
    print(f"plot: {plot_compile(runs, modes, out_dir / 'graphs.png', title)}")
    return 0


def _eager_graphs(model, kv_cache, like: DecodeGraphs) -> DecodeGraphs:
    """Graphs of the model's eager kernels (model.compiled off) in `like`'s buckets, captured now."""
    return DecodeGraphs(model, kv_cache, like.row_sizes[-1], like.width_sizes[-1])


def _portable_attention_graphs(model, kv_cache, like: DecodeGraphs) -> DecodeGraphs:
    """`_eager_graphs` holding the gather + mask + SDPA decode attention instead of the Triton kernel
    (the switch is read at each graph's capture)."""
    was, attention.USE_TRITON_DECODE = attention.USE_TRITON_DECODE, False
    try:
        return _eager_graphs(model, kv_cache, like)
    finally:
        attention.USE_TRITON_DECODE = was


def _ratio(run: RoundsRun, mode: str, base: str) -> str:
    return f"{run.median(mode) / run.median(base):.2f}x" if run.median(base) and run.median(mode) else "-"


def rounds_setup(args, device: torch.device = torch.device("cpu")) -> tuple[Path, int, int, SamplingParams, float]:
    """What a rounds benchmark needs: its output folder (made), tokens per request, rounds, the greedy
    parameters, and the device's bandwidth measured now (for the floor)."""
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    max_tokens, rounds = (16, 1) if args.quick else (args.max_tokens, 3)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return out_dir, max_tokens, rounds, params, device_bandwidth_gbs(device)


def time_levels(
    model,
    levels: list[int],
    modes: list[str],
    engine_for: Callable[[str], LLMEngine],
    rounds: int,
    params: SamplingParams,
    bandwidth: float,
) -> list[RoundsRun]:
    """`time_rounds` at each concurrency level, each with its weight-read floor at `bandwidth` GB/s."""
    runs = []
    for level in levels:
        run = RoundsRun(level, {m: [] for m in modes}, streamed_bytes(model, level) / bandwidth / 1e6)
        time_rounds(engine_for, run, rounds, params)
        runs.append(run)
    return runs


def write_runs(path: Path, runs: list[RoundsRun], bandwidth: float) -> None:
    path.write_text(
        json.dumps(
            {
                "bandwidth_gbs": bandwidth,
                "runs": [{"concurrency": r.concurrency, **r.tok_s, "floor_ms": r.floor_ms} for r in runs],
            }
        )
    )


def time_rounds(engine_for: Callable[[str], LLMEngine], run: RoundsRun, rounds: int, params: SamplingParams) -> None:
    """`rounds` rounds at run's concurrency, each mode once a round on the engine `engine_for(mode)` sets up
    for it, the order reversed every other round: a drifting box favours no mode."""
    level, modes = run.concurrency, list(run.tok_s)
    # once a level: every mode's engine has the same model, so the same tokenizer
    prompts = chat_prompt_ids(engine_for(modes[0]).tokenizer, (CHAT_PROMPTS * 8)[:level])
    for r in range(rounds):
        order = modes if r % 2 == 0 else modes[::-1]
        progress(f"{level} concurrent, round {r + 1}/{rounds}: {', then '.join(order)}")
        for mode in order:
            result = run_engine(engine_for(mode), prompts, params, "compile", level)
            run.tok_s[mode].append(result.decode_tokens_per_s or 0.0)


def _print(
    runs: list[RoundsRun],
    modes: list[str],
    title: str,
    bandwidth: float,
    note: str = "native: every layer of a decode step in one C++ call, model/native_step.py",
) -> None:
    """Per level: each mode's tok/s, each faster mode's ratio to eager, and the fastest default's step
    against the weight-read floor (the default: the native step where there is one)."""
    default = modes[-1]
    print(f"\n== {title} ==")
    header = "".join(f"{m + ' tok/s':>{_width(m)}}" for m in modes) + "".join(
        f"{m + '/eager':>{_width(m) + 1}}" for m in modes[1:]
    )
    print(f"{'concurrency':>11}{header} {default + ' step':>14} {'weight-read floor':>18} {'step / floor':>13}")
    for r in runs:
        speeds = "".join(f"{r.median(m):>{_width(m)}.1f}" for m in modes)
        ratios = "".join(f"{(f'{r.ratio(m):.2f}x' if r.ratio(m) else '-'):>{_width(m) + 1}}" for m in modes[1:])
        step = r.step_ms(default) or 0.0
        print(
            f"{r.concurrency:>11}{speeds}{ratios} {step:>11.1f} ms {r.floor_ms:>15.1f} ms {step / r.floor_ms:>12.2f}x"
        )
    print(f"(floor: the bytes of weights one step reads / {bandwidth:.1f} GB/s streamed, measured now; {note})")


def _width(mode: str) -> int:
    """A mode's column width: its header and a space."""
    return max(15, len(mode) + 8)


def plot_compile(runs: list[RoundsRun], modes: list[str], path: Path, title: str) -> Path:
    default = modes[-1]

    def floor_labels(ax, xs, offset):  # the floor itself would dwarf the bars: say how far above it each step is
        for x, r in zip(xs, runs):
            ratio = (r.step_ms(default) or 0) / r.floor_ms
            ax.annotate(
                f"{ratio:.1f}x the\nweight-read floor",
                (x + offset, r.median(default)),
                ha="center",
                va="bottom",
                fontsize=7,
            )

    return plot_paired_bars(
        [r.concurrency for r in runs],
        tuple((m, [r.median(m) for r in runs]) for m in modes),
        path,
        title.replace(": ", ":\n", 1),
        floor_labels,
    )
