"""`minivllm bench single`: single-stream greedy decode speed, this engine vs HF `generate`."""

from __future__ import annotations

from pathlib import Path

from minivllm.bench.common import (chat_prompt_ids, greedy, hf_sequential, load_hf_oracle, progress,
                                   run_engine_sequential)
from minivllm.bench.prompts import CHAT_PROMPTS
from minivllm.bench.report import plot_throughput, print_table, save_json


def bench_single(engine, args) -> int:
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    count = 2 if args.quick else 5
    max_tokens = 16 if args.quick else args.max_tokens
    prompts = chat_prompt_ids(engine.tokenizer, CHAT_PROMPTS[:count])
    params = greedy(max_tokens)
    progress("warm-up")
    run_engine_sequential(engine, prompts[:1], greedy(4), 1)
    progress(f"mini-vllm: {count} prompts x {max_tokens} tokens, one at a time")
    results = [run_engine_sequential(engine, prompts, params, 1)]
    results[0].mode = "mini-vllm single stream"
    hf = None if args.skip_hf else load_hf_oracle(engine.loaded)
    if hf is not None:
        from minivllm.bench.common import hf_generate

        hf_generate(hf, engine.tokenizer, prompts[:1], 4, "warm-up", 1)
        progress(f"HF generate: {count} prompts x {max_tokens} tokens, one at a time")
        results.append(hf_sequential(hf, engine.tokenizer, prompts, max_tokens, 1))
    print_table(results, f"single-stream greedy decode, {engine.loaded.name}, {engine.info().dtype}, "
                         f"{count} chat prompts x {max_tokens} tokens")
    if len(results) == 2:
        ours, theirs = results
        print(f"\nspeed-up vs HF generate: {ours.tokens_per_s / theirs.tokens_per_s:.2f}x tokens/s, "
              f"{(theirs.decode_tokens_per_s or 0) and (ours.decode_tokens_per_s or 0) / theirs.decode_tokens_per_s:.2f}x decode")
    save_json(results, out_dir / "single.json")
    plot = plot_throughput(results, out_dir / "single.png", "single-stream greedy decode")
    print(f"plot: {plot}")
    return 0
