"""`minivllm bench sampler`: what choosing the next token costs per decode step, our batched sampler next
to Hugging Face `generate()`'s sampling (its logits processors, softmax and `torch.multinomial`), on
the same logits: the model's real next-token distributions over the chat prompts, at each concurrency
and for the dashboard's sampling presets. Both sides must keep the same tokens: the bench also checks,
row by row, that our truncation (top-k, top-p, min-p) leaves exactly the tokens HF's warpers leave."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from minivllm.bench.common import chat_prompt_ids, median, progress
from minivllm.bench.machine import machine_line
from minivllm.bench.prompts import CHAT_PROMPTS
from minivllm.bench.report import plot_paired_bars
from minivllm.sampling.params import SamplingParams
from minivllm.sampling.sampler import Sampler, SamplingRow

# the dashboard's presets (frontend/src/core/openai.ts) and its chat default (temperature 0.7)
PRESETS = {
    "greedy": {"temperature": 0.0},
    "temperature 0.7": {"temperature": 0.7},
    "balanced": {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.05},
    "creative": {"temperature": 1.1, "top_p": 0.95, "min_p": 0.02, "repetition_penalty": 1.1},
}
ROUNDS = 15
TAIL_POSITIONS = 6  # next-token distributions taken from the end of each prompt


@dataclass
class SamplerTiming:
    preset: str
    rows: int
    ours_ms: float
    hf_ms: float
    same_kept_tokens: float  # share of rows where our truncation keeps exactly HF's tokens


def bench_sampler(engine, args) -> int:
    from minivllm.engine.scoring import forward_prefills

    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    levels = [min(c, 4) for c in args.concurrency] if args.quick else list(args.concurrency)
    progress("computing real next-token distributions over the chat prompts")
    prompts = chat_prompt_ids(engine.tokenizer, CHAT_PROMPTS)
    with torch.inference_mode():
        logits = torch.cat([lg[-TAIL_POSITIONS:] for lg in forward_prefills(engine.loaded, prompts)])
    contexts = [p for p in prompts for _ in range(TAIL_POSITIONS)]
    results = []
    for rows in levels:
        batch = _rows_of(logits, rows)
        history = [contexts[i % len(contexts)] for i in range(rows)]
        for name, preset in PRESETS.items():
            progress(f"{rows} rows, {name}")
            results.append(_time_preset(name, SamplingParams(**preset), batch, history, args.quick))
    _print(results)
    print(machine_line())
    (out_dir / "sampler.json").write_text(json.dumps([r.__dict__ for r in results], indent=1))
    print(f"results: {out_dir / 'sampler.json'}")
    print(f"plot: {_plot(results, levels, out_dir / 'sampler.png')}")
    return 0


def _rows_of(logits: torch.Tensor, rows: int) -> torch.Tensor:
    """`rows` real distributions (repeated when there are fewer), contiguous like a step's logits."""
    return logits[torch.arange(rows) % logits.shape[0]].contiguous()


def _time_preset(
    name: str, params: SamplingParams, logits: torch.Tensor, history: list[list[int]], quick: bool
) -> SamplerTiming:
    rows = [SamplingRow(params, h, []) for h in history]
    processors = hf_processors(params)
    input_ids = padded_history(history)
    sampler = Sampler()
    ours, theirs = [], []
    for _ in range(3 if quick else ROUNDS):  # alternating, medians: the machines are noisy
        ours.append(_timed(lambda: sampler(logits, rows)))
        theirs.append(_timed(lambda: hf_sample(processors, input_ids, logits, params)))
    same = kept_tokens_agree(logits, rows, processors, input_ids) if not params.is_greedy else 1.0
    return SamplerTiming(name, len(rows), median(ours) or 0.0, median(theirs) or 0.0, same)


def padded_history(history: list[list[int]]) -> torch.Tensor:
    """The ids HF's repetition penalty looks at, as one tensor: each row padded with its own first token,
    which leaves the set of tokens it has seen (all the penalty reads) as ours."""
    width = max(len(h) for h in history)
    return torch.tensor([h + [h[0]] * (width - len(h)) for h in history])


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def hf_processors(params: SamplingParams):
    """HF generate()'s processors for these parameters, in its order."""
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    processors = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.is_greedy:
        return processors
    if params.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k > 0:
        processors.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        processors.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        processors.append(MinPLogitsWarper(params.min_p))
    return processors


def hf_sample(processors, input_ids: torch.Tensor, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    scores = processors(input_ids, logits)
    if params.is_greedy:
        return scores.argmax(dim=-1)
    return torch.multinomial(scores.softmax(dim=-1), 1).squeeze(1)


def kept_tokens_agree(logits: torch.Tensor, rows: list[SamplingRow], processors, input_ids: torch.Tensor) -> float:
    """The share of rows where our processed distribution and HF's keep the same tokens."""
    ours = torch.isfinite(Sampler.truncated(Sampler().processed(logits, rows), rows))
    theirs = torch.isfinite(processors(input_ids, logits.clone()))
    return float((ours == theirs).all(dim=-1).float().mean())


def _print(results: list[SamplerTiming]) -> None:
    print(
        "\n== choosing the next tokens of one decode step: mini-vllm's sampler vs HF generate()'s "
        "(processors + softmax + multinomial), same logits =="
    )
    print(f"{'rows':>5} {'preset':<16} {'mini-vllm ms':>13} {'HF ms':>9} {'speed-up':>9} {'same kept tokens':>17}")
    for r in results:
        print(
            f"{r.rows:>5} {r.preset:<16} {r.ours_ms:>13.2f} {r.hf_ms:>9.2f} {r.hf_ms / r.ours_ms:>8.1f}x "
            f"{r.same_kept_tokens:>16.0%}"
        )
    print("(mini-vllm also returns each token's log-prob; medians of alternating rounds)")


def _plot(results: list[SamplerTiming], levels: list[int], path: Path) -> Path:
    sampled = [r for r in results if r.preset == "balanced"]
    return plot_paired_bars(
        levels,
        (
            ("mini-vllm", [r.ours_ms for r in sampled]),
            ("HF generate()", [r.hf_ms for r in sampled]),
        ),
        path,
        "sampling one decode step, the 'balanced' preset (T 0.7, top-k 40, top-p 0.9, min-p 0.05, repetition 1.05)",
        ylabel="ms per step (median, lower is faster)",
    )
