"""Per-layer products at TinyLlama-1.1B's shapes, side by side in one run: GGUF Q4_K / Q6_K on our K-quant
kernels, the same weights dequantized to fp32 (what a Q4_K_M file ran as before those kernels: our fp32 kernel
and torch's F.linear), and our Q4_1 kernel, at 1 and 8 rows, each path at each of its activation precisions.
Prints each one's median time and the weight bytes it streams per second, next to the streaming bandwidth
measured now (bench/machine.py). Every path rotates through enough copies of its weight to overflow the
last-level cache, so a call reads its weight from memory as a decode step does.

    .venv/bin/python scripts/bench_kquant.py [--rows 1 8] [--repeats 30] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from minivllm.bench.machine import machine_line, streaming_bandwidth_gbs
from minivllm.kernels.cpu import native
from minivllm.quant import matmul_paths
from minivllm.quant.formats import KQUANT_BYTES, KQuantWeight, quantize_int4

SHAPES = [(2048, 2048), (2048, 5632), (5632, 2048), (256, 2048)]  # (out N, in K): q/o, down, gate/up, k/v
ROTATION_BYTES = 256 * 2**20  # each path's copies together: well past any last-level cache


def random_kquant(kind: str, n: int, k: int, rng: np.random.Generator) -> KQuantWeight:
    """Valid random super-blocks (finite fp16 scales, any codes): gguf-py has no K-quant quantizer."""
    blocks = rng.integers(0, 256, (n, k // 256, KQUANT_BYTES[kind]), dtype=np.uint8)
    d = (rng.random((n, k // 256)) * 0.01 + 1e-3).astype(np.float16).view(np.uint8).reshape(n, k // 256, 2)
    if kind == "Q6_K":
        blocks[..., 208:210] = d
    else:
        blocks[..., 0:2] = d
        blocks[..., 2:4] = d
    return KQuantWeight([(kind, torch.from_numpy(blocks.reshape(n, -1)))])


def timed(calls: list, x: torch.Tensor, repeats: int) -> float:
    """Median seconds of one call, cycling through `calls` (one per weight copy)."""
    for call in calls[:2]:
        call(x)
    samples = []
    for i in range(repeats):
        call = calls[i % len(calls)]
        start = time.perf_counter()
        call(x)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def paths(n: int, k: int, rng: np.random.Generator):
    """(name, weight bytes, one callable per copy) for every path on this shape."""

    def copies(nbytes: int) -> int:
        return max(2, ROTATION_BYTES // nbytes)

    for kind in ("Q4_K", "Q6_K"):
        packed = [
            matmul_paths.pack_kquant(random_kquant(kind, n, k, rng))
            for _ in range(copies(n * k // 256 * KQUANT_BYTES[kind]))
        ]
        for acts in matmul_paths.NATIVE_ACTS:
            yield f"{kind} kquant/{acts}", packed[0].nbytes, [matmul_paths.KQuantNative(p, n, acts) for p in packed]
    int4 = quantize_int4("w", torch.randn(n, k) * 0.05, 32)
    q41 = [matmul_paths.Int4Native(int4.packed.clone(), "int8") for _ in range(copies(int4.packed.nbytes))]
    for acts in matmul_paths.NATIVE_ACTS:
        yield f"Q4_1 int4avx2/{acts}", int4.packed.nbytes, [matmul_paths.Int4Native(q.packed, acts) for q in q41]
    dense = [torch.randn(n, k) * 0.05 for _ in range(copies(n * k * 4))]
    yield "fp32 (dequantized) F.linear", n * k * 4, [lambda x, w=w: F.linear(x, w) for w in dense]
    yield (
        "fp32 (dequantized) native",
        n * k * 4,
        [lambda x, w=w: torch.ops.minivllm_native.f32_linear(x, w) for w in dense],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    assert native.available() is None, native.available()
    print(machine_line())
    bandwidth = streaming_bandwidth_gbs()
    print(f"{'shape NxK':>11} {'rows':>4} {'path':<30} {'ms':>8} {'GB/s':>6} {'of stream':>9} {'vs Q4_1':>7}")
    rng = np.random.default_rng(0)
    for n, k in SHAPES:
        found = list(paths(n, k, rng))
        for rows in args.rows:
            x = torch.randn(rows, k)
            times = {name: (nbytes, timed(calls, x, args.repeats)) for name, nbytes, calls in found}
            q41 = times["Q4_1 int4avx2/int8"][1]
            for name, (nbytes, seconds) in times.items():
                gbs = nbytes / seconds / 1e9
                print(
                    f"{n:>5}x{k:<5} {rows:>4} {name:<30} {seconds * 1e3:8.3f} {gbs:6.1f} {gbs / bandwidth:8.0%} "
                    f"{seconds / q41:6.2f}x"
                )
        del found


if __name__ == "__main__":
    main()
