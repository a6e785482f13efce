"""Linear layers with MKL-packed weight copies for the batch sizes continuous batching produces.

On a CPU, a plain fp32 `F.linear` with a skinny input (8-64 rows: one decode token per running
sequence) runs at a fraction of the machine's GEMM peak. MKL can pre-pack a weight for a given
row count once, after which the same product runs several times faster (measured ~3.5x at 32 rows
on the 2-core dev box; `minivllm bench throughput` shows the end-to-end effect). A packed copy only
serves its exact row count, so a batch is padded up to the next bucket (4, 8, 16 or 32 rows;
measured on the dev box for the SmolLM2 shapes at 8 rows: plain 53 ms, padded to 16 25 ms, an
8-row pack 17 ms per step's worth of GEMMs). One or two rows (a stream or two) are memory-bound
GEMVs where packing does not help, and longer prefill chunks are already efficient plainly. The packed copies cost memory (one per bucket), so the buckets are chosen
from the model size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MIN_PACKED_ROWS = 3
PACK_MEMORY_BUDGET = 3 * 2**30  # bytes of packed copies, all buckets together


def packing_supported(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"))


def choose_buckets(weight_bytes: int) -> tuple[int, ...]:
    """As many buckets as the memory budget allows, the most useful (32) first."""
    chosen: list[int] = []
    for bucket in (32, 16, 8, 4):
        if weight_bytes * (len(chosen) + 1) <= PACK_MEMORY_BUDGET:
            chosen.append(bucket)
    return tuple(sorted(chosen))


class PackedLinear(nn.Linear):
    """nn.Linear (no bias) that uses a packed copy when the batch fits a bucket."""

    packs: dict[int, torch.Tensor]

    def pack(self, buckets: tuple[int, ...]) -> None:
        with torch.no_grad():
            self.packs = {b: torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(), b) for b in sorted(buckets)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packs = getattr(self, "packs", None)
        if not packs:
            return F.linear(x, self.weight)
        return packed_linear(x, list(packs.values()), list(packs), self.weight)


@torch.library.custom_op("minivllm::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packs: list[torch.Tensor], buckets: list[int], weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through the packed copy of the smallest bucket that holds x's rows (padded up to
    it), else plainly. One opaque operator, the bucket picked inside: a compiled graph then stays
    dynamic in the row count, where branching in Python gave each bucket a graph of its own (15 decode
    graphs in fp32, a cold compile of ~190 s). Inductor's own lowering of `mkl::_mkl_linear` would
    also need the packed weight frozen into the graph as a constant, and the compiled step takes every
    layer's weights as inputs (one graph for all layers)."""
    rows = x.shape[0]
    fitting = next(((b, pack) for b, pack in zip(buckets, packs) if b >= rows), None)  # buckets ascend
    if rows < MIN_PACKED_ROWS or fitting is None:
        return F.linear(x, weight)
    bucket, pack = fitting
    padded = F.pad(x, (0, 0, 0, bucket - rows)) if bucket != rows else x
    return torch.ops.mkl._mkl_linear(padded, pack, weight, None, bucket)[:rows]


@packed_linear.register_fake
def _(x, packs, buckets, weight):
    return x.new_empty(x.shape[0], weight.shape[0])


def pack_model(model: nn.Module) -> tuple[int, ...]:
    """Pack every PackedLinear of the model; returns the buckets used (empty when unsupported)."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not layers or not packing_supported(layers[0].weight):
        return ()
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    buckets = choose_buckets(weight_bytes)
    for layer in layers:
        layer.pack(buckets)
    return buckets
