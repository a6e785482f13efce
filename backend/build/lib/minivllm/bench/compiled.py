"""`minivllm bench compile`: decode throughput of the compiled step against the same engine run
eagerly (`--enforce-eager`'s path), side by side in alternating rounds (medians: these machines are
noisy), with each level's weight-read floor: the bytes of weights one step reads over the streaming
bandwidth measured on the spot. One engine serves both sides (the compiled layer step is switched
off and on), so the weights, the KV pool and the prompts are the same."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from minivllm.bench.common import chat_prompt_ids, median, progress, run_engine
from minivllm.bench.machine import machine_line, streaming_bandwidth_gbs
from minivllm.bench.prompts import CHAT_PROMPTS
from minivllm.bench.report import plot_paired_bars
from minivllm.engine.llm_engine import LLMEngine
from minivllm.quant.install import streamed_bytes
from minivllm.sampling.params import SamplingParams


@dataclass
class CompileRun:
    concurrency: int
    eager_tok_s: list[float]
    compiled_tok_s: list[float]
    floor_ms: float  # the weight-read floor of one step at this concurrency

    @property
    def ratio(self) -> float | None:
        eager, compiled = median(self.eager_tok_s), median(self.compiled_tok_s)
        return compiled / eager if eager and compiled else None

    @property
    def compiled_step_ms(self) -> float | None:
        tok_s = median(self.compiled_tok_s)
        return self.concurrency / tok_s * 1e3 if tok_s else None


def bench_compile(engine: LLMEngine, args) -> int:
    compiled = engine.loaded.model.compiled
    if compiled is None or not compiled.active:
        raise SystemExit(f"bench compile compares the compiled step with eager, but this engine runs "
                         f"{engine.loaded.model.compilation()}: drop --enforce-eager")
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    max_tokens, rounds = (16, 1) if args.quick else (args.max_tokens, 3)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    bandwidth = streaming_bandwidth_gbs()
    runs = []
    for level in args.concurrency:
        prompts = chat_prompt_ids(engine.tokenizer, (CHAT_PROMPTS * 8)[:level])
        floor_ms = streamed_bytes(engine.loaded.model, level) / bandwidth / 1e6
        run = CompileRun(level, [], [], floor_ms)
        for r in range(rounds):
            progress(f"{level} concurrent, round {r + 1}/{rounds}: eager, then compiled")
            for side, samples in ((None, run.eager_tok_s), (compiled, run.compiled_tok_s)):
                engine.loaded.model.compiled = side
                samples.append(run_engine(engine, prompts, params, "compile", level).decode_tokens_per_s or 0.0)
        engine.loaded.model.compiled = compiled
        runs.append(run)
    title = (f"compiled decode step vs eager: {engine.loaded.name} ({engine.loaded.quant.mode}), "
             f"{max_tokens} tokens per request (greedy), {rounds} round(s)")
    _print(runs, title, bandwidth)
    print(machine_line())
    (out_dir / "compile.json").write_text(json.dumps({"bandwidth_gbs": bandwidth, "runs": [
        {"concurrency": r.concurrency, "eager": r.eager_tok_s, "compiled": r.compiled_tok_s, "floor_ms": r.floor_ms}
        for r in runs]}))
    print(f"plot: {plot_compile(runs, out_dir / 'compile.png', title)}")
    return 0


def _print(runs: list[CompileRun], title: str, bandwidth: float) -> None:
    print(f"\n== {title} ==")
    print(f"{'concurrency':>11} {'eager tok/s':>12} {'compiled tok/s':>15} {'ratio':>7} "
          f"{'compiled step':>14} {'weight-read floor':>18} {'step / floor':>13}")
    for r in runs:
        ratio = f"{r.ratio:.2f}x" if r.ratio else "-"
        step = r.compiled_step_ms or 0.0
        print(f"{r.concurrency:>11} {median(r.eager_tok_s) or 0:>12.1f} {median(r.compiled_tok_s) or 0:>15.1f} "
              f"{ratio:>7} {step:>11.1f} ms {r.floor_ms:>15.1f} ms {step / r.floor_ms:>12.2f}x")
    print(f"(floor: the bytes of weights one step reads / {bandwidth:.1f} GB/s streamed, measured now)")


def plot_compile(runs: list[CompileRun], path: Path, title: str) -> Path:
    def floor_labels(ax, xs):  # the floor itself would dwarf the bars: say how far above it each step is
        for x, r in zip(xs, runs):
            ratio = (r.compiled_step_ms or 0) / r.floor_ms
            ax.annotate(f"{ratio:.1f}x the\nweight-read floor", (x + 0.2, median(r.compiled_tok_s) or 0),
                        ha="center", va="bottom", fontsize=7)

    return plot_paired_bars([r.concurrency for r in runs], (
        ("eager", [median(r.eager_tok_s) or 0 for r in runs]),
        ("compiled", [median(r.compiled_tok_s) or 0 for r in runs])), path, title.replace(": ", ":\n", 1),
        floor_labels)
