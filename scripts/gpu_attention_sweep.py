"""The Triton decode-attention kernel's split settings against the gathered SDPA path, kernel time alone.

Each (setting, shape) call is captured in a CUDA graph of 20 calls and replayed (events, median of 5), so
launch overhead is out, as in the engine's graphed steps. Shapes: the embedded model's heads (9 / 3, D 64,
fp32 pool) and TinyLlama's (32 / 4, D 64, bf16 pool) at 1 / 8 / 32 sequences and 128 / 512 / 2,000 tokens.
Usage (GPU): PYTHONPATH=backend python3 scripts/gpu_attention_sweep.py [--dot-only]
The sweep ends with "BEST <min partition tokens> <programs per SM>": the defaults in kernels/triton/attention.py
came from it; `CUDA_COMPILE=0 scripts/gpu_check.sh` then benchmarks the engine with them.
Then, for TinyLlama's bf16 shape at the module's split defaults, the kernel's two ways to take its products
side by side: CUDA cores (fp32 broadcast sums) and tensor cores (tl.dot), each forced, against SDPA, with
each path's largest difference from SDPA's output. --dot-only prints only that table (seconds);
--dot-tiles times the dot path's tile / warps settings instead ("BEST DOT <tile tokens> <warps>": the
defaults in kernels/triton/attention.py came from it). --dot-model picks those two tables' heads (TinyLlama's
by default; also Llama-3-8B's, head dim 128, where the dot tile is half as many tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import math
import statistics
import sys

import torch

from minivllm.kernels.triton import attention as ta
from minivllm.model.attention import decode_context_mask, gathered_decode_attention

SETTINGS = [(256, 1), (128, 2), (64, 4), (32, 4), (64, 8), (32, 8)]  # (MIN_PARTITION_TOKENS, PROGRAMS_PER_SM)
MODELS = {"smollm2 9/3 fp32": (9, 3, 64, torch.float32), "tinyllama 32/4 bf16": (32, 4, 64, torch.bfloat16)}
BLOCK = 16
SHAPES = [(batch, ctx) for batch in (1, 8, 32) for ctx in (128, 512, 2000)]  # (sequences, tokens of context)
DOT_MODEL = "tinyllama 32/4 bf16"
# the dot path's own table may also take a head dim of 128 (Llama-3-8B's heads), where its tile is 64 tokens
DOT_MODELS = {**MODELS, "llama3-8b 32/8 D128 bf16": (32, 8, 128, torch.bfloat16)}
DEFAULT_SETTING = (ta.MIN_PARTITION_TOKENS, ta.PROGRAMS_PER_SM)  # the current best split, before the sweep


def graph_time_us(fn, calls: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(runs)


def inputs(heads, kv_heads, dim, dtype, batch, ctx):
    width = -(-ctx // BLOCK)
    width = 1 << (width - 1).bit_length()  # the graphs' power-of-two width buckets
    blocks = batch * width + 1
    k_pool = torch.randn(blocks, BLOCK, kv_heads, dim, device="cuda").to(dtype)
    v_pool = torch.randn_like(k_pool)
    tables = torch.randperm(blocks - 1, device="cuda")[: batch * width].view(batch, width)
    lens = torch.full((batch,), ctx, device="cuda")
    q = torch.randn(batch, heads, dim, device="cuda").to(dtype if dtype != torch.float32 else torch.float32)
    return q, k_pool, v_pool, tables, lens


def sweep_split_settings() -> None:
    print("setting: (min partition tokens, programs per SM); kernel us per call inside a CUDA graph")
    logs = {setting: 0.0 for setting in SETTINGS}  # sums of log times: the geometric means' order
    header = f"{'shape':<40}" + "".join(f"{str(s):>12}" for s in SETTINGS) + f"{'sdpa':>10}"
    for name, (heads, kv_heads, dim, dtype) in MODELS.items():
        print(f"\n== {name} ==\n{header}")
        for batch, ctx in SHAPES:
            q, k_pool, v_pool, tables, lens = inputs(heads, kv_heads, dim, dtype, batch, ctx)
            row = []
            for min_tokens, per_sm in SETTINGS:
                ta.MIN_PARTITION_TOKENS, ta.PROGRAMS_PER_SM = min_tokens, per_sm
                row.append(graph_time_us(lambda: ta.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.125)))
                logs[(min_tokens, per_sm)] += math.log(row[-1])
            sdpa = graph_time_us(sdpa_call(q, k_pool, v_pool, tables, lens))
            print(
                f"{f'B={batch} ctx={ctx} width={tables.shape[1] * BLOCK}':<40}"
                + "".join(f"{t:12.1f}" for t in row)
                + f"{sdpa:10.1f}"
            )
    best = min(logs, key=logs.get)
    print(f"\nBEST {best[0]} {best[1]}")  # the setting of the smallest geometric mean over every shape


def sdpa_call(q, k_pool, v_pool, tables, lens):
    """The gathered path (gather + mask + SDPA) on these inputs, as a call to time."""
    mask = decode_context_mask(lens, tables.shape[1] * BLOCK, q.dtype)
    return functools.partial(gathered_decode_attention, q, k_pool, v_pool, tables, mask, 0.125)


def compare_products(model: str = DOT_MODEL) -> float:
    """CUDA-core against tensor-core products, both forced, and SDPA: us per call, time / SDPA's time
    (below 1: faster than SDPA), largest abs difference from SDPA's output. Returns the dot path's geometric
    mean of time / SDPA's."""
    heads, kv_heads, dim, dtype = DOT_MODELS[model]
    ta.MIN_PARTITION_TOKENS, ta.PROGRAMS_PER_SM = DEFAULT_SETTING
    print(
        f"\n== {model}: CUDA cores vs tensor cores, split setting {DEFAULT_SETTING}, dot tile "
        f"{ta.DOT_TILE_TOKENS} tokens, {ta.DOT_NUM_WARPS} warps =="
    )
    print(
        f"{'shape':<28}{'cores us':>10}{'dot us':>10}{'sdpa us':>10}{'cores/sdpa':>12}{'dot/sdpa':>10}"
        f"{'cores diff':>12}{'dot diff':>10}"
    )
    logs = {"cores": 0.0, "dot": 0.0}
    for batch, ctx in SHAPES:
        q, k_pool, v_pool, tables, lens = inputs(heads, kv_heads, dim, dtype, batch, ctx)
        sdpa_path = sdpa_call(q, k_pool, v_pool, tables, lens)
        paths = {
            name: functools.partial(
                ta.paged_decode_attention, q, k_pool, v_pool, tables, lens, 0.125, tensor_cores=name == "dot"
            )
            for name in logs
        }
        sdpa, expected = graph_time_us(sdpa_path), sdpa_path().float()
        times = {name: graph_time_us(call) for name, call in paths.items()}
        diffs = {name: (call().float() - expected).abs().max().item() for name, call in paths.items()}
        for name in logs:
            logs[name] += math.log(times[name] / sdpa)
        print(
            f"{f'B={batch} ctx={ctx}':<28}{times['cores']:10.1f}{times['dot']:10.1f}{sdpa:10.1f}"
            f"{times['cores'] / sdpa:12.2f}{times['dot'] / sdpa:10.2f}{diffs['cores']:12.1e}{diffs['dot']:10.1e}"
        )
    means = {name: math.exp(log / len(SHAPES)) for name, log in logs.items()}
    print("geometric mean of time / sdpa: " + ", ".join(f"{name} {mean:.2f}" for name, mean in means.items()))
    return means["dot"]


DOT_TILES = [(tile, warps) for tile in (32, 64, 128) for warps in (2, 4, 8)]  # (DOT_TILE_TOKENS, DOT_NUM_WARPS)


def sweep_dot_tiles(model: str = DOT_MODEL) -> None:
    """The dot path's tile and warps: compare_products' geometric mean for each; the defaults came from it.
    (The tile is DOT_TILE_TOKENS at head dims up to 64 and shrinks with wider heads: launch_shape.)"""
    means = {}
    for ta.DOT_TILE_TOKENS, ta.DOT_NUM_WARPS in DOT_TILES:
        with contextlib.redirect_stdout(io.StringIO()):  # only the geometric mean, a line a setting
            means[(ta.DOT_TILE_TOKENS, ta.DOT_NUM_WARPS)] = mean = compare_products(model)
        print(f"dot tile {ta.DOT_TILE_TOKENS} tokens, {ta.DOT_NUM_WARPS} warps: time / sdpa {mean:.2f}", flush=True)
    best = min(means, key=means.get)
    print(f"BEST DOT {best[0]} {best[1]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--dot-only",
        action="store_true",
        help="only the CUDA-core vs tensor-core table (TinyLlama bf16), not the split sweep",
    )
    parser.add_argument(
        "--dot-tiles",
        action="store_true",
        help="only the dot path's tile / warps settings, one geometric mean each (a minute)",
    )
    parser.add_argument(
        "--dot-model",
        choices=list(DOT_MODELS),
        default=DOT_MODEL,
        help="the heads the two --dot tables take (default: %(default)s)",
    )
    args = parser.parse_args()
    if args.dot_tiles:
        sweep_dot_tiles(args.dot_model)
        return 0
    if not args.dot_only:
        sweep_split_settings()
    compare_products(args.dot_model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
