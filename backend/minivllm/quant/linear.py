"""A linear layer and an embedding over quantized weights.

A QuantLinear holds its candidate kernels until the chooser has timed them, then keeps only the
ones its plan uses. The plan is a short list of (max rows, kernel): the forward pass looks the row
count up in it, so the choice costs one comparison or two per call and nothing is measured on the
hot path.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.kernels.cpu import native
from minivllm.quant.formats import Int4Weight, Int8Weight, KQuantWeight, QuantizedWeight, quantize_int8
from minivllm.quant.matmul_paths import Kernel, candidates


class QuantLinear(nn.Module):
    def __init__(
        self,
        name: str,
        weight: QuantizedWeight,
        device: torch.device,
        dtype: torch.dtype,
        kernels: list[Kernel] | None = None,
    ):
        super().__init__()
        self.name = name
        self.out_features, self.in_features = weight.shape
        self.format = _format_name(weight)
        self.candidates = kernels if kernels is not None else candidates(weight, device, dtype)
        self.plan: list[tuple[int, Kernel]] = [(2**62, self.candidates[0])]

    def set_plan(self, plan: list[tuple[int, str]]) -> None:
        """Choose kernels by name per row bucket (ascending max rows); unused candidates are dropped."""
        by_name = {k.name: k for k in self.candidates}
        missing = [n for _, n in plan if n not in by_name]
        if missing:
            raise ValueError(f"{self.name}: no kernel {missing[0]!r}; available: {sorted(by_name)}")
        self.plan = [(rows, by_name[n]) for rows, n in plan]
        self.plan[-1] = (2**62, self.plan[-1][1])

    def force(self, kernel_name: str) -> None:
        self.set_plan([(2**62, kernel_name)])

    def drop_unused(self) -> None:
        self.candidates = [k for k in self.candidates if any(k is used for _, used in self.plan)]

    def kernel_for(self, rows: int) -> Kernel:
        for max_rows, kernel in self.plan:
            if rows <= max_rows:
                return kernel
        return self.plan[-1][1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel_for(x.shape[0])(x)

    def stored_tensors(self) -> list[torch.Tensor]:
        return [t for k in self.candidates for t in k.tensors()]

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.format}, plan={self.plan_summary()}"

    def plan_summary(self) -> str:
        return ", ".join(f"<={rows if rows < 2**62 else 'any'}: {k.name}" for rows, k in self.plan)


class QuantEmbedding(nn.Module):
    """Looks rows up in int8 form and scales them: the table never exists in floats. Scales are per
    row or per group (GGUF's Q8_0 keeps its own blocks). For a tied LM head the int8 values are
    shared with the head's int8 kernels (one copy)."""

    def __init__(self, weight: QuantizedWeight, device: torch.device, dtype: torch.dtype):
        super().__init__()
        if isinstance(weight, Int4Weight):  # an int8 table is exact enough and lookups stay simple
            weight = quantize_int8("embedding", weight.dequantize(), None)
        self.q = weight.q.to(device)
        self.scale = weight.scale.to(device)  # [N, groups]
        self.group_size = weight.group_size
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = self.q.shape
        # one native call (embedding.cpp) instead of six small operators, the same bits
        self.looks_up_natively = (
            self.q.device.type == "cpu"
            and dtype == torch.float32
            and self.scale.dtype in (torch.float32, torch.float16)
            and self.q.is_contiguous()
            and self.scale.is_contiguous()
            and native.available() is None
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.looks_up_natively:
            return native.int8_embedding(ids, self.q, self.scale)
        q = self.q[ids].to(self.dtype).view(*ids.shape, -1, self.group_size)
        return (q * self.scale[ids, :, None].to(self.dtype)).flatten(-2)

    def as_weight(self) -> Int8Weight:
        """The table as a weight whose kernels share its storage (a tied LM head)."""
        return Int8Weight(self.q, self.scale, self.group_size)

    def stored_tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scale]


class KQuantEmbedding(nn.Module):
    """A K-quant table (a Q4_K_M file's token_embd is Q4_K) kept in its super-blocks: a lookup dequantizes
    only its rows (gguf-py's arithmetic: the file's values exactly). A tied LM head shares the blocks."""

    def __init__(self, weight: KQuantWeight, dtype: torch.dtype):
        super().__init__()
        self.weight, self.dtype = weight, dtype
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.rows(ids.flatten().cpu()).dequantize(self.dtype)
        return rows.view(*ids.shape, self.embedding_dim).to(ids.device)

    def as_weight(self) -> KQuantWeight:
        return self.weight

    def stored_tensors(self) -> list[torch.Tensor]:
        return [data for _, data in self.weight.parts]


def _format_name(weight: QuantizedWeight) -> str:
    if isinstance(weight, KQuantWeight):
        return "+".join(dict.fromkeys(weight.kinds))  # "Q4_K", "Q4_K+Q6_K" (a fused q|k|v)
    if isinstance(weight, Int4Weight):
        return f"int4 g{weight.group_size}"
    return "int8 per-channel" if weight.per_channel else f"int8 g{weight.group_size}"
