"""`minivllm bench structured`: decode throughput with a JSON-schema grammar against the same
requests unconstrained, side by side, in alternating rounds (medians: these machines are noisy).

Both sides generate exactly `max_tokens` tokens: the schema is an array that cannot close sooner
(`minItems`), so the batch stays full and the only difference is the mask. Also reported: the
grammar's own cost per step (fill + apply) and a schema's cold compile time."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

from minivllm.bench.common import chat_prompt_ids, median, progress, run_engine
from minivllm.bench.machine import machine_line
from minivllm.bench.prompts import CHAT_PROMPTS
from minivllm.bench.report import plot_paired_bars
from minivllm.engine.api import LLMEngine
from minivllm.sampling.params import SamplingParams
from minivllm.structured.params import StructuredOutputsParams

SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "age", "city"],
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0},
            "city": {"type": "string", "maxLength": 24},
        },
    },
}


@dataclass
class StructuredRun:
    concurrency: int
    free_tok_s: list[float]
    constrained_tok_s: list[float]

    @property
    def ratio(self) -> float | None:
        free, constrained = median(self.free_tok_s), median(self.constrained_tok_s)
        return constrained / free if free and constrained else None


def bench_structured(engine: LLMEngine, args) -> int:
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    max_tokens, rounds = (16, 1) if args.quick else (args.max_tokens, 3)
    free = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    constrained = replace(free, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    compile_ms = _cold_compile_ms(engine, constrained)
    runs = []
    for level in args.concurrency:
        prompts = chat_prompt_ids(engine.tokenizer, (CHAT_PROMPTS * 8)[:level])
        run_engine(engine, prompts[:2], replace(free, max_tokens=4), "warm-up", 2)
        run = StructuredRun(level, [], [])
        for r in range(rounds):
            progress(f"{level} concurrent, round {r + 1}/{rounds}: unconstrained, then the JSON schema")
            run.free_tok_s.append(run_engine(engine, prompts, free, "free", level).decode_tokens_per_s or 0.0)
            run.constrained_tok_s.append(
                run_engine(engine, prompts, constrained, "json", level).decode_tokens_per_s or 0.0
            )
        runs.append(run)
    title = f"structured outputs: {engine.loaded.name}, {max_tokens} tokens per request (greedy), {rounds} round(s)"
    _print(runs, title, compile_ms)
    print(machine_line())
    (out_dir / "structured.json").write_text(
        json.dumps(
            {
                "compile_ms": compile_ms,
                "runs": [
                    {"concurrency": r.concurrency, "free": r.free_tok_s, "constrained": r.constrained_tok_s}
                    for r in runs
                ],
            }
        )
    )
    print(f"plot: {plot_structured(runs, out_dir / 'structured.png', title)}")
    return 0


def _cold_compile_ms(engine: LLMEngine, params: SamplingParams) -> float:
    """A schema seen for the first time: grammar built and validated, then one matcher's first mask."""
    engine.grammars.compile(StructuredOutputsParams(regex="warm"))  # builds the tokenizer's trie first
    start = time.perf_counter()
    engine.grammars.compile(params.structured_outputs)
    return (time.perf_counter() - start) * 1e3


def _print(runs: list[StructuredRun], title: str, compile_ms: float) -> None:
    print(f"\n== {title} ==")
    print(f"{'concurrency':>11} {'unconstrained tok/s':>20} {'JSON schema tok/s':>18} {'ratio':>7}")
    for r in runs:
        ratio = f"{r.ratio:.2f}x" if r.ratio else "-"
        print(
            f"{r.concurrency:>11} {median(r.free_tok_s) or 0:>20.1f} {median(r.constrained_tok_s) or 0:>18.1f} "
            f"{ratio:>7}"
        )
    print(f"schema compile (cold, validated): {compile_ms:.1f} ms")


def plot_structured(runs: list[StructuredRun], path: Path, title: str) -> Path:
    return plot_paired_bars(
        [r.concurrency for r in runs],
        (
            ("unconstrained", [median(r.free_tok_s) or 0 for r in runs]),
            ("JSON schema", [median(r.constrained_tok_s) or 0 for r in runs]),
        ),
        path,
        title,
    )
