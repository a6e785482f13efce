"""`minivllm bench kv`: what each KV tier buys. Tokens per GiB of pool for each KV element type, and the
time to first token of a long prompt served cold, from the RAM prefix cache, from the disk tier, and
by a restarted engine reading the disk tier, with the greedy tokens of all four compared."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from minivllm.arith import ceil_div
from minivllm.bench.common import greedy, median, progress
from minivllm.bench.kv_window_cost import print_window_cost
from minivllm.bench.machine import machine_line
from minivllm.engine.config import KV_CACHE_DTYPES
from minivllm.engine.factory import engine_for
from minivllm.engine.outputs import OutputAccumulator

TIERS = ("cold", "RAM prefix hit", "disk hit", "after restart")
NEW_TOKENS = 16


@dataclass
class TierRun:
    ttft_s: list[float]
    tokens: list[list[int]]


def bench_kv(engine, args) -> int:
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(machine_line())
    _print_capacity(engine)
    prompt_tokens = args.prompt_tokens or (256 if args.quick else 2000)
    rounds = 1 if args.quick else args.rounds
    with tempfile.TemporaryDirectory(prefix="minivllm-kv-") as scratch:
        offload_dir = getattr(args, "kv_offload_dir", None) or scratch
        runs = _time_tiers(engine, offload_dir, prompt_tokens, rounds)
    _print_ttft(runs, prompt_tokens)
    _print_swap(engine, 96 if args.quick else 400, 48 if args.quick else 64)
    print_window_cost(engine, (128, 256) if args.quick else (256, 512, 1024))
    _plot(runs, out_dir / "kv_tiers.png", f"{engine.loaded.name}: TTFT of a {prompt_tokens}-token prompt by KV tier")
    return 0


def _print_capacity(engine) -> None:
    model, config = engine.loaded.config, engine.config
    print(f"\nKV capacity, {model.num_hidden_layers} layers x {model.num_key_value_heads} KV heads x {model.head_dim}:")
    print(f"  {'--kv-cache-dtype':<18} {'bytes/token':>12} {'tokens per GiB':>15}")
    for name in KV_CACHE_DTYPES:
        if name == "auto":
            continue
        one_gib = config.with_changes(kv_cache_dtype=name, num_blocks=None, kv_cache_memory="1GiB")
        blocks, _, pool_bytes = one_gib.kv_pool(model, engine.loaded.kv_auto_dtype)
        tokens = blocks * config.block_size
        print(f"  {name:<18} {pool_bytes / tokens:>12.0f} {tokens:>15,}")


def _time_tiers(engine, offload_dir: str, prompt_tokens: int, rounds: int) -> dict[str, TierRun]:
    """Each round a fresh random prompt, so "cold" is cold; the engines are built on the loaded model."""
    runs = {tier: TierRun([], []) for tier in TIERS}
    config = engine.config.with_changes(kv_offload_dir=offload_dir)
    vocab = engine.loaded.config.vocab_size
    for r in range(rounds):
        prompt = torch.randint(10, vocab - 10, (prompt_tokens,), generator=torch.Generator().manual_seed(r)).tolist()
        tiered = engine_for(engine.loaded, config)
        progress(f"round {r + 1}/{rounds}: cold prefill of {prompt_tokens} tokens")
        _record(runs["cold"], tiered, prompt)
        progress(f"round {r + 1}/{rounds}: the same prompt from the RAM prefix cache")
        _record(runs["RAM prefix hit"], tiered, prompt)
        tiered.close()  # every cached block on disk
        tiered.block_manager.reset_prefix_cache()  # RAM forgets: only the disk tier can serve it
        progress(f"round {r + 1}/{rounds}: from the disk tier")
        _record(runs["disk hit"], tiered, prompt)
        tiered.close()
        del tiered
        restarted = engine_for(engine.loaded, config)
        progress(f"round {r + 1}/{rounds}: a restarted engine (its index read from {offload_dir})")
        _record(runs["after restart"], restarted, prompt)
        restarted.close()
    return runs


def _record(into: TierRun, engine, prompt: list[int]) -> None:
    request_id = f"kv-{time.monotonic_ns()}"
    start = time.perf_counter()
    engine.add_request(request_id, prompt_token_ids=prompt, params=greedy(NEW_TOKENS))
    whole, first, final = OutputAccumulator(), None, None
    while engine.has_work():
        for out in map(whole.add, engine.step()):
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter() - start
            if out.finished:
                final = out
    into.ttft_s.append(first or float("nan"))
    into.tokens.append(list(final.outputs[0].token_ids) if final else [])


def _print_ttft(runs: dict[str, TierRun], prompt_tokens: int) -> None:
    cold = median(runs["cold"].ttft_s)
    print(f"\ntime to first token, a {prompt_tokens}-token prompt (median of {len(runs['cold'].ttft_s)} rounds):")
    print(f"  {'tier':<16} {'TTFT ms':>9} {'vs cold':>8}   greedy tokens")
    for tier, run in runs.items():
        ttft = median(run.ttft_s)
        same = "identical to cold" if run.tokens == runs["cold"].tokens else "DIFFER from cold"
        print(f"  {tier:<16} {ttft * 1e3:>9.1f} {cold / ttft:>7.1f}x   {same}")
    print("  (after restart: a new engine in this process; the files may still be in the OS page cache)")


def _print_swap(engine, prompt_tokens: int, new_tokens: int) -> None:
    """A pool that admits three of four prompts but cannot grow them all to the end: preempted requests
    recompute their context on resume, or, with the disk tier, read back the full blocks evicted meanwhile
    (where measured cheaper)."""
    tight = engine.config.with_changes(num_blocks=3 * ceil_div(prompt_tokens + 1, engine.config.block_size) + 2)
    vocab = engine.loaded.config.vocab_size
    prompts = [
        torch.randint(10, vocab - 10, (prompt_tokens,), generator=torch.Generator().manual_seed(100 + i)).tolist()
        for i in range(4)
    ]
    print(
        f"\npreemption on a tight pool ({tight.num_blocks} blocks; 4 requests, {prompt_tokens} + {new_tokens} tokens):"
    )
    print(f"  {'on resume':<22} {'wall s':>7} {'preemptions':>12} {'blocks read':>12}   greedy tokens")
    reference = None
    with tempfile.TemporaryDirectory(prefix="minivllm-swap-") as scratch:
        for label, config in (("recompute", tight), ("disk tier (swap)", tight.with_changes(kv_offload_dir=scratch))):
            progress(f"tight pool: {label}")
            sized = engine_for(engine.loaded, config)
            start = time.perf_counter()
            tokens = _run_all(sized, prompts, new_tokens)
            wall = time.perf_counter() - start
            reference = reference or tokens
            read = sized.disk_tier.cost.restored if sized.disk_tier.store is not None else 0
            same = "identical" if tokens == reference else "DIFFER"
            print(f"  {label:<22} {wall:>7.2f} {sized.scheduler.num_preemptions:>12} {read:>12}   {same}")


def _run_all(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    ids = [f"swap-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt_token_ids=prompt, params=greedy(new_tokens))
    whole, done = OutputAccumulator(), {}
    while engine.has_work():
        for out in map(whole.add, engine.step()):
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[i] for i in ids]


def _plot(runs: dict[str, TierRun], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    values = [median(run.ttft_s) * 1e3 for run in runs.values()]
    ax.barh(list(runs), values, color=["#999999", "#4c72b0", "#dd8452", "#55a868"])
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.0f} ms", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time to first token, ms (median)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")
