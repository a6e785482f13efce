"""The Triton decode-attention kernel's split settings against the gathered SDPA path, kernel time alone.

Each (setting, shape) call is captured in a CUDA graph of 20 calls and replayed (events, median of 5), so
launch overhead is out, as in the engine's graphed steps. Shapes: the embedded model's heads (9 / 3, D 64,
fp32 pool) and TinyLlama's (32 / 4, D 64, bf16 pool) at 1 / 8 / 32 sequences and 128 / 512 / 2,000 tokens.
Usage (GPU): PYTHONPATH=backend python3 scripts/gpu_attention_sweep.py
It ends with "BEST <min partition tokens> <programs per SM>": the defaults in model/triton_attention.py came
from it; `CUDA_COMPILE=0 scripts/gpu_check.sh` then benchmarks the engine with them.
"""

from __future__ import annotations

import math
import statistics
import sys

import torch

from minivllm.model import triton_attention as ta
from minivllm.model.attention import decode_context_mask, gathered_decode_attention

SETTINGS = [(256, 1), (128, 2), (64, 4), (32, 4), (64, 8), (32, 8)]  # (MIN_PARTITION_TOKENS, PROGRAMS_PER_SM)
MODELS = {"smollm2 9/3 fp32": (9, 3, 64, torch.float32), "tinyllama 32/4 bf16": (32, 4, 64, torch.bfloat16)}
BLOCK = 16


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


def main() -> int:
    print("setting: (min partition tokens, programs per SM); kernel us per call inside a CUDA graph")
    logs = {setting: 0.0 for setting in SETTINGS}  # sums of log times: the geometric means' order
    header = f"{'shape':<40}" + "".join(f"{str(s):>12}" for s in SETTINGS) + f"{'sdpa':>10}"
    for name, (heads, kv_heads, dim, dtype) in MODELS.items():
        print(f"\n== {name} ==\n{header}")
        for batch in (1, 8, 32):
            for ctx in (128, 512, 2000):
                q, k_pool, v_pool, tables, lens = inputs(heads, kv_heads, dim, dtype, batch, ctx)
                row = []
                for min_tokens, per_sm in SETTINGS:
                    ta.MIN_PARTITION_TOKENS, ta.PROGRAMS_PER_SM = min_tokens, per_sm
                    row.append(graph_time_us(lambda: ta.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.125)))
                    logs[(min_tokens, per_sm)] += math.log(row[-1])
                mask = decode_context_mask(lens, tables.shape[1] * BLOCK, q.dtype)
                sdpa = graph_time_us(lambda: gathered_decode_attention(q, k_pool, v_pool, tables, mask, 0.125))
                print(f"{f'B={batch} ctx={ctx} width={tables.shape[1] * BLOCK}':<40}"
                      + "".join(f"{t:12.1f}" for t in row) + f"{sdpa:10.1f}")
    best = min(logs, key=logs.get)
    print(f"\nBEST {best[0]} {best[1]}")  # the setting of the smallest geometric mean over every shape
    return 0


if __name__ == "__main__":
    sys.exit(main())
