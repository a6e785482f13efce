"""`minivllm bench single`: single-stream greedy decode speed, this engine vs HF `generate`."""

from __future__ import annotations

from pathlib import Path

from minivllm.bench.common import (chat_prompt_ids, combine_runs, greedy, hf_generate, load_hf_oracle, median,
                                   progress, run_engine)
from minivllm.bench.prompts import CHAT_PROMPTS
from minivllm.bench.report import plot_throughput, print_table, save_json


def bench_single(engine, args) -> int:
    """Prompt by prompt, this engine then HF: on a noisy machine a slow spell hits both sides, so the
    per-prompt ratios (and their median) stay meaningful."""
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    count = 2 if args.quick else 5
    max_tokens = 16 if args.quick else args.max_tokens
    prompts = chat_prompt_ids(engine.tokenizer, CHAT_PROMPTS[:count])
    params = greedy(max_tokens)
    hf = None if args.skip_hf else load_hf_oracle(engine.loaded)
    progress("warm-up")
    run_engine(engine, prompts[:1], greedy(4), "warm-up", 1)
    if hf is not None:
        hf_generate(hf, engine.tokenizer, prompts[:1], 4, "warm-up", 1)
    ours, theirs = [], []
    for i, prompt in enumerate(prompts):
        progress(f"prompt {i + 1}/{count}: {max_tokens} tokens with mini-vllm" + (", then HF generate" if hf else ""))
        ours.append(run_engine(engine, [prompt], params, "seq", 1))
        if hf is not None:
            theirs.append(hf_generate(hf, engine.tokenizer, [prompt], max_tokens, "seq", 1))
    results = [combine_runs("mini-vllm single stream", 1, ours)]
    if theirs:
        results.append(combine_runs("HF generate sequential", 1, theirs))
    print_table(results, f"single-stream greedy decode, {engine.loaded.name}, {engine.info().dtype}, "
                         f"{count} chat prompts x {max_tokens} tokens")
    if theirs:
        ratios = [a.tokens_per_s / b.tokens_per_s for a, b in zip(ours, theirs)]
        print(f"\nspeed-up vs HF generate: {results[0].tokens_per_s / results[1].tokens_per_s:.2f}x tokens/s overall; "
              f"per prompt {' '.join(f'{r:.2f}x' for r in ratios)} (median {median(ratios):.2f}x)")
    save_json(results, out_dir / "single.json")
    plot = plot_throughput(results, out_dir / "single.png", "single-stream greedy decode")
    print(f"plot: {plot}")
    return 0
