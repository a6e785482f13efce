"""`minivllm bench throughput`: continuous batching vs one-at-a-time vs HF static batch vs HF
sequential at several concurrency levels, plus the effect of prefix caching on TTFT."""

from __future__ import annotations

from pathlib import Path

from minivllm.bench.common import (
    chat_prompt_ids,
    greedy,
    hf_generate,
    hf_sequential,
    load_hf_oracle,
    median,
    precision_label,
    progress,
    run_engine,
    run_engine_sequential,
)
from minivllm.bench.machine import machine_line
from minivllm.bench.prompts import CHAT_PROMPTS, SYSTEM_PROMPT_WORDS
from minivllm.bench.report import plot_throughput, print_table, save_json

SEQUENTIAL_SAMPLE = 4  # one-at-a-time rates do not depend on the concurrency level: sample a few prompts


def bench_throughput(engine, args) -> int:
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    max_tokens = 16 if args.quick else args.max_tokens
    levels = [min(c, 4) for c in args.concurrency] if args.quick else args.concurrency
    prompts = chat_prompt_ids(engine.tokenizer, (CHAT_PROMPTS * 4)[: max(levels)])
    params = greedy(max_tokens)
    hf = None if args.skip_hf else load_hf_oracle(engine.loaded)
    progress("warm-up")
    run_engine(engine, prompts[:2], greedy(4), "warm-up", 2)
    seq_prompts = prompts[: 2 if args.quick else SEQUENTIAL_SAMPLE]
    progress(f"mini-vllm one at a time ({len(seq_prompts)} prompts)")
    ours_seq = run_engine_sequential(engine, seq_prompts, params, 1)
    hf_seq = None
    if hf is not None:
        hf_generate(hf, engine.tokenizer, prompts[:1], 4, "warm-up", 1)
        progress(f"HF generate sequential ({len(seq_prompts)} prompts)")
        hf_seq = hf_sequential(hf, engine.tokenizer, seq_prompts, max_tokens, 1)
    results = []
    for level in levels:
        batch = prompts[:level]
        progress(f"mini-vllm continuous batching, {level} concurrent")
        results.append(run_engine(engine, batch, params, "mini-vllm continuous batching", level))
        results.append(_relabel(ours_seq, level))
        if hf is not None:
            progress(f"HF generate static batch of {level}")
            results.append(hf_generate(hf, engine.tokenizer, batch, max_tokens, "HF generate static batch", level))
            results.append(_relabel(hf_seq, level))
    title = (
        f"{engine.loaded.name}, {precision_label(engine)}, chat prompts x {max_tokens} new tokens (greedy, ignore_eos)"
    )
    print_table(results, "throughput: " + title)
    print(machine_line())
    _print_ratios(results, levels)
    prefix = bench_prefix_cache(engine, max_tokens=8, count=4 if args.quick else 8)
    save_json(results, out_dir / "throughput.json", {"prefix_cache_ttft": prefix})
    print(f"plot: {plot_throughput(results, out_dir / 'throughput.png', 'throughput: ' + title)}")
    return 0


def _relabel(result, level):
    from dataclasses import replace

    return replace(result, concurrency=level) if result is not None else None


def _print_ratios(results, levels) -> None:
    print()
    for level in levels:
        by_mode = {r.mode: r for r in results if r is not None and r.concurrency == level}
        ours = by_mode.get("mini-vllm continuous batching")
        for other in ("HF generate static batch", "HF generate sequential", "mini-vllm one at a time"):
            if ours and other in by_mode:
                print(
                    f"{level:>3} concurrent: continuous batching is "
                    f"{ours.tokens_per_s / by_mode[other].tokens_per_s:.2f}x "
                    f"{other} (tokens/s)"
                )
        if ours and ours.decode_tokens_per_s:
            print(f"{level:>3} concurrent: decode throughput {ours.decode_tokens_per_s:.0f} tok/s")


def bench_prefix_cache(engine, max_tokens: int, count: int) -> dict:
    """TTFT of requests sharing a ~256-token system prompt, sent one after another, caching on vs off."""
    system = _system_prompt(engine.tokenizer, 256)
    prompts = chat_prompt_ids(engine.tokenizer, CHAT_PROMPTS[:count], system=system)
    ttft = {}
    original = engine.config.enable_prefix_caching
    for enabled in (True, False):
        engine.reconfigure(enable_prefix_caching=enabled)
        progress(f"shared system prompt ({len(prompts[0])} tokens), prefix caching {'on' if enabled else 'off'}")
        runs = [run_engine(engine, [p], greedy(max_tokens), "prefix", 1) for p in prompts]
        ttft[enabled] = median([r.ttft_s[0] for r in runs[1:]])  # the first request fills the cache
    engine.reconfigure(enable_prefix_caching=original)
    ratio = ttft[False] / ttft[True] if ttft[True] else float("nan")
    print(
        f"\nshared {len(prompts[0])}-token prompt prefix: median TTFT {ttft[True] * 1e3:.1f} ms with prefix caching, "
        f"{ttft[False] * 1e3:.1f} ms without -> {ratio:.2f}x faster"
    )
    return {"ttft_on_s": ttft[True], "ttft_off_s": ttft[False], "speedup": ratio, "prompt_tokens": len(prompts[0])}


def _system_prompt(tokenizer, min_tokens: int) -> str:
    text = SYSTEM_PROMPT_WORDS
    while tokenizer is not None and len(tokenizer.encode(text)) < min_tokens:
        text += SYSTEM_PROMPT_WORDS
    return text
