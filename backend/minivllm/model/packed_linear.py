"""Linear layers with MKL-packed weight copies for the batch sizes continuous batching produces.

On a CPU, a plain fp32 `F.linear` with a skinny input (8-64 rows: one decode token per running
sequence) runs at a fraction of the machine's GEMM peak. MKL can pre-pack a weight for a given
row count once, after which the same product runs several times faster (measured ~3.5x at 32 rows
on the 2-core dev box; `minivllm bench throughput` shows the end-to-end effect). A packed copy only
serves its exact row count, so a batch is padded up to the next bucket (4, 8, 16 or 32 rows;
measured on the dev box for the SmolLM2 shapes at 8 rows: plain 53 ms, padded to 16 25 ms, an
8-row pack 17 ms per step's worth of GEMMs). One or two rows (a stream or two) are memory-bound
GEMVs where packing does not help, and longer prefill chunks are already efficient plainly. The packed
copies cost memory (one per bucket), so the buckets are chosen from the model size.

Our own fp32 kernel (`kernels/cpu/f32_matmul.cpp`, one weight row at a time, read front to back) is
the other candidate, timed against MKL at load (`choose_fp32_kernel`; kept per machine like the
quantized kernels' choices) because MKL picks slow code paths on AMD CPUs (measured on a Zen 4 box:
plain sgemv at 10.5 GB/s of 28 at one row, packed products at 4-7 GB/s from 4 to 32 rows; ours
27 GB/s at one row and 0.4-0.7x packed MKL's time at 4-32 rows). Where ours wins the decode rows it
serves every row count, prefill chunks included (0.9-1.4x MKL's time there), and nothing is packed
(no copies: ~1.5 GiB less for the embedded model in fp32). All or nothing: it sums each row in one
fixed order, alone or in any batch, so a token's bits do not depend on what shared its step or on
whether its prompt came from the prefix cache; with MKL for some row counts and ours for others they
would.
"""

from __future__ import annotations

import functools
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.console import progress
from minivllm.kernels.cpu import native
from minivllm.quant import choice_cache

MIN_PACKED_ROWS = 3
PREFILL_ROWS = 64  # a prefill chunk's row count, for timing
PREFILL_SLOWDOWN = 1.5  # how much slower than MKL our kernel may be at prefill and still be chosen
TIMING_PASSES = 5  # passes each, in turns; the best one counts
PACK_MEMORY_BUDGET = 3 * 2**30  # bytes of packed copies, all buckets together


def packing_supported(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


def choose_buckets(weight_bytes: int) -> tuple[int, ...]:
    """As many buckets as the memory budget allows, the most useful (32) first."""
    chosen: list[int] = []
    for bucket in (32, 16, 8, 4):
        if weight_bytes * (len(chosen) + 1) <= PACK_MEMORY_BUDGET:
            chosen.append(bucket)
    return tuple(sorted(chosen))


class PackedLinear(nn.Linear):
    """nn.Linear (no bias) that uses our fp32 kernel (`native`), else a packed copy when the batch
    fits a bucket."""

    packs: dict[int, torch.Tensor]
    native: bool = False

    def pack(self, buckets: tuple[int, ...]) -> None:
        with torch.no_grad():
            self.packs = {b: torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(), b) for b in sorted(buckets)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packs = getattr(self, "packs", None) or {}
        if not packs and not self.native:
            return F.linear(x, self.weight)
        return packed_linear(x, list(packs.values()), list(packs), self.weight, self.native)


@torch.library.custom_op("minivllm::packed_linear", mutates_args=())
def packed_linear(
    x: torch.Tensor, packs: list[torch.Tensor], buckets: list[int], weight: torch.Tensor, use_native: bool
) -> torch.Tensor:
    """x @ weight.T through our fp32 kernel (`use_native`), else the packed copy of the smallest
    bucket that holds x's rows (padded up to it), else plainly. One opaque operator, the path picked
    inside: a compiled graph then stays dynamic in the row count, where branching in Python gave each
    bucket a graph of its own (15 decode graphs in fp32, a cold compile of ~190 s). Inductor's own
    lowering of `mkl::_mkl_linear` would also need the packed weight frozen into the graph as a
    constant, and the compiled step takes every layer's weights as inputs (one graph for all layers)."""
    rows = x.shape[0]
    if use_native:  # set only once the native kernels are loaded (pack_model)
        return torch.ops.minivllm_native.f32_linear(x.contiguous(), weight)
    fitting = next(((b, pack) for b, pack in zip(buckets, packs) if b >= rows), None)  # buckets ascend
    if rows < MIN_PACKED_ROWS or fitting is None:
        return F.linear(x, weight)
    bucket, pack = fitting
    padded = F.pad(x, (0, 0, 0, bucket - rows)) if bucket != rows else x
    return torch.ops.mkl._mkl_linear(padded, pack, weight, None, bucket)[:rows]


@packed_linear.register_fake
def _(x, packs, buckets, weight, use_native):
    return x.new_empty(x.shape[0], weight.shape[0])


def pack_model(model: nn.Module) -> tuple[int, ...]:
    """Pack every PackedLinear of the model; returns the buckets used (empty when unsupported)."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not layers or not packing_supported(layers[0].weight):
        return ()
    if choose_fp32_kernel(layers):  # ours serves every row count: no packed copies
        for layer in layers:
            layer.native = True
        return ()
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    buckets = choose_buckets(weight_bytes)
    for layer in layers:
        layer.pack(buckets)
    return buckets


def native_fp32_usable(layers: list[PackedLinear]) -> bool:
    return (
        all(
            layer.weight.device.type == "cpu"
            and layer.weight.dtype == torch.float32
            and layer.weight.shape[1] % native.BLOCK == 0
            for layer in layers
        )
        and native.available() is None
    )


FP32_KERNEL_ENV = "MINIVLLM_FP32_KERNEL"  # "native" or "mkl": no timing (near-equal timings flip on a busy box)


def choose_fp32_kernel(layers: list[PackedLinear]) -> bool:
    """Whether our fp32 kernel serves these layers: timed against MKL on the model's largest weights,
    streamed as a step streams them. It must win at one row (against plain F.linear) and at 8 rows
    (against an 8-row packed copy), and be at most PREFILL_SLOWDOWN behind F.linear at a prefill chunk.
    $MINIVLLM_FP32_KERNEL names the choice instead."""
    if not native_fp32_usable(layers):
        return False
    forced = os.environ.get(FP32_KERNEL_ENV, "")
    if forced:
        if forced not in ("native", "mkl"):
            raise ValueError(f"{FP32_KERNEL_ENV}={forced!r}: expected 'native' or 'mkl'")
        progress(f"fp32 linears: {'our kernel' if forced == 'native' else 'MKL'} (${FP32_KERNEL_ENV}), not timed")
        return forced == "native"
    largest = max(layer.weight.numel() for layer in layers)
    weights = [layer.weight.detach() for layer in layers if layer.weight.numel() == largest][:8]
    key = choice_cache.entry_key(
        torch.device("cpu"), f"fp32 linear {tuple(weights[0].shape)} x{len(weights)}", ["f32_linear", "mkl"], None
    )
    plan, timings_ms, kept = choice_cache.kept_or_timed(
        key, lambda: _time_ours_and_mkl(weights), lambda ms: [(0, "f32_linear" if _ours_wins(ms) else "mkl")]
    )
    name = plan[0][1]
    how = "as timed on this machine before" if kept else "timed now"
    progress(
        f"fp32 linears ({how}; ms for {len(weights)} weights {tuple(weights[0].shape)}, ours vs MKL): "
        + ", ".join(f"{rows} rows {t['f32_linear']:.2f} vs {t['mkl']:.2f}" for rows, t in sorted(timings_ms.items()))
        + (": our kernel serves every row count" if name == "f32_linear" else ": MKL serves them")
    )
    return name == "f32_linear"


def _time_ours_and_mkl(weights: list[torch.Tensor]) -> dict[int, dict[str, float]]:
    """ms for one pass over the weights: at one row against plain F.linear, at 8 rows against an
    8-row packed copy, at a prefill chunk against plain F.linear: each its best pass, the two taking turns
    (choice_cache.best_in_turns)."""
    packed = {id(w): torch.ops.mkl._mkl_reorder_linear_weight(w, 8) for w in weights}
    mkl8 = lambda x, w: torch.ops.mkl._mkl_linear(x, packed[id(w)], w, None, 8)  # noqa: E731
    timings = {}
    for rows, mkl in ((1, F.linear), (8, mkl8), (PREFILL_ROWS, F.linear)):
        products = {"f32_linear": torch.ops.minivllm_native.f32_linear, "mkl": mkl}
        runs = {name: functools.partial(_time_products, weights, rows, p) for name, p in products.items()}
        timings[rows] = {name: 1e3 * s for name, s in choice_cache.best_in_turns(runs, TIMING_PASSES).items()}
    return timings


def _ours_wins(ms: dict[int, dict[str, float]]) -> bool:
    return (
        all(ms[rows]["f32_linear"] <= ms[rows]["mkl"] for rows in (1, 8))
        and ms[PREFILL_ROWS]["f32_linear"] <= PREFILL_SLOWDOWN * ms[PREFILL_ROWS]["mkl"]
    )


def _time_products(weights: list[torch.Tensor], rows: int, product) -> float:
    """Seconds of one pass of `product` over every weight (each read once: from memory)."""
    x = torch.randn(rows, weights[0].shape[1])
    with torch.no_grad():
        start = time.perf_counter()
        for w in weights:
            product(x, w)
        return time.perf_counter() - start
