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
quantized: a GGUF's stacked expert tensors are sliced per expert at load).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model.packed_linear import PackedLinear


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = route(self.gate(x), self.top_k, self.renormalize)
        out, self.touched = grouped_experts(x, weights, chosen, self.experts)
        return out
