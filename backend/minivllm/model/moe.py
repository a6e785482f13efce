"""A sparse mixture-of-experts MLP block (Qwen3-MoE, Mixtral) in place of the dense MLP.

A router (a linear `gate`, [experts, hidden]) scores every expert for each token; a softmax over those
scores, the top `k` of them kept (renormalised to sum to 1 where the family does: Qwen3-MoE's
`norm_topk_prob`, always in Mixtral), weight the outputs of the chosen experts, each a gated MLP
(SwiGLU) of its own.

The grouped product: a step's token rows are sorted by the expert they chose, so each expert that any
row chose runs its gate|up and down products once, on all of its rows together (its weights are read
once a step, however many rows chose it), and the weighted results are added back onto their rows.
Experts no row chose are not read at all. The loop is over the active experts, never over tokens.
Each expert's products are ordinary linear modules (PackedLinear, or QuantLinear once its weights are
quantized: a GGUF's stacked expert tensors are sliced per expert at load). Where our kernels run every
expert's products (fp32 rows on a CPU), the whole block is one C++ call (`moe_experts`, decode_step.cpp: the
native decode step's own MoE code): a prefill chunk of 32 tokens touched ~110 experts a layer, each ~10 small
operators from Python here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.kernels.cpu import native
from minivllm.model.native_products import ABSENT, native_scales, native_weight, product_kind
from minivllm.model.packed_linear import PackedLinear


class NativeExperts(NamedTuple):
    """A MoE block's experts as the C++ call (`moe_experts`) takes them, in its argument order: every gate/up
    weight, every down weight, their int8 scales (ABSENT where a weight is not int8), and the two products' kinds."""

    gate_ups: list[torch.Tensor]
    downs: list[torch.Tensor]
    gate_up_scales: list[torch.Tensor]
    down_scales: list[torch.Tensor]
    kinds: list[int]


def expert_scales(product: nn.Module) -> torch.Tensor:
    """An expert product's int8 scales, which our kernels take beside its codes; ABSENT where none."""
    scales = native_scales(product)
    return ABSENT if scales is None else scales


class Expert(nn.Module):
    """One expert: a gated MLP (SwiGLU) with gate|up fused, as the dense MLP runs it."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = PackedLinear(hidden, 2 * intermediate, bias=False)
        self.down_proj = PackedLinear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top-k experts and their weights: a softmax over all experts (in fp32, as HF computes
    it), the k largest kept, renormalised to sum to 1 where asked; weights in the logits' dtype."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def grouped_experts(
    x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, experts: nn.ModuleList
) -> tuple[torch.Tensor, int]:
    """sum_j weights[t, j] * experts[chosen[t, j]](x[t]) for every row t, each chosen expert run once on
    all its rows; returns the result and how many distinct experts ran."""
    top_k = chosen.shape[1]
    order = chosen.reshape(-1).argsort(stable=True)  # (row, slot) pairs grouped by expert
    counts = torch.bincount(chosen.reshape(-1), minlength=len(experts)).tolist()  # one host sync a layer
    rows, slot_weights = order // top_k, weights.reshape(-1)[order].unsqueeze(1)
    out = torch.zeros_like(x)
    start = 0
    for expert, n in zip(experts, counts):
        if n:
            group = rows[start : start + n]
            out.index_add_(0, group, expert(x[group]) * slot_weights[start : start + n])
        start += n
    return out, sum(1 for n in counts if n)


class SparseMoE(nn.Module):
    """The MoE block: router, top-k, the grouped expert product. `touched`: distinct experts its last
    call ran (the step's StepFinished reports the sum over layers)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.gate = PackedLinear(hidden, num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(Expert(hidden, intermediate) for _ in range(num_experts))
        self.top_k, self.renormalize = top_k, renormalize
        self.touched = 0
        self._native: dict[tuple, NativeExperts | None] = {}  # native_plan's answers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.native_experts(x)
        if plan is not None:
            out, self.touched = torch.ops.minivllm_native.moe_experts(
                x.contiguous(), self.gate.weight, *plan, self.top_k, self.renormalize, False
            )
            return out
        weights, chosen = route(self.gate(x), self.top_k, self.renormalize)
        out, self.touched = grouped_experts(x, weights, chosen, self.experts)
        return out

    def native_experts(self, x: torch.Tensor) -> NativeExperts | None:
        """`native_plan` at x's row count where x is fp32 on a CPU, as are the router's weights; else None."""
        if x.device.type != "cpu" or x.dtype != torch.float32 or self.gate.weight.dtype != torch.float32:
            return None
        return self.native_plan(x.shape[0])

    def native_plan(self, rows: int) -> NativeExperts | None:
        """Every expert's weights as our kernels run them at `rows` rows, where those run every expert's products
        alike (one kind each in the C++ call); else None."""
        kinds = self._kinds(self.experts[0], rows)
        key = (rows, kinds)  # the first expert's kinds: kernel plans are fixed at load, its `native` flag may move
        if key not in self._native:
            self._native[key] = self._find_native(rows, kinds)
        return self._native[key]

    @staticmethod
    def _kinds(expert: Expert, rows: int) -> tuple[int | None, int | None]:
        return product_kind(expert.gate_up_proj, rows), product_kind(expert.down_proj, rows)

    def _find_native(self, rows: int, kinds: tuple) -> NativeExperts | None:
        if None in kinds or native.available() is not None:
            return None
        alike = all(self._kinds(e, rows) == kinds for e in self.experts)
        gate_ups = [native_weight(e.gate_up_proj) for e in self.experts]
        downs = [native_weight(e.down_proj) for e in self.experts]
        if not alike or None in (*gate_ups, *downs):
            return None
        gate_up_scales = [expert_scales(e.gate_up_proj) for e in self.experts]
        down_scales = [expert_scales(e.down_proj) for e in self.experts]
        return NativeExperts(gate_ups, downs, gate_up_scales, down_scales, list(kinds))
