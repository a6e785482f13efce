"""How our native kernels run a model's weight products: each product's kind as decode_step.cpp numbers them, and
its weight as those kernels read it. Shared by the native decode step (native_step.py) and the MoE block's
native expert product (moe.py)."""

from __future__ import annotations

import torch

from minivllm.model.packed_linear import PackedLinear
from minivllm.quant.linear import QuantLinear
from minivllm.quant.matmul_paths import Int4Native, KQuantNative

# A product's kind, as decode_step.cpp numbers them: a 4-bit weight on our kernel by activation precision,
# an fp32 weight on our fp32 kernel, or a GGUF K-quant weight on ours by activation precision
Q4_KINDS = {"int8": 0, "int8x2": 1, "fp32": 2}
FP32_KIND = 3
KQUANT_KINDS = {"int8": 4, "int8x2": 5, "fp32": 6}


def product_kind(product: torch.nn.Module, rows: int) -> int | None:
    """How the native step runs this product at `rows` rows, as the eager step would; None when no
    native kernel would (torch's kernels, MKL)."""
    if isinstance(product, QuantLinear):
        kernel = product.kernel_for(rows)
        acts = kernel.name.split("/")[-1]
        if isinstance(kernel, KQuantNative):
            return KQUANT_KINDS.get(acts)
        return Q4_KINDS.get(acts) if isinstance(kernel, Int4Native) else None
    if isinstance(product, PackedLinear) and product.native:
        return FP32_KIND
    return None


def native_weight(product: torch.nn.Module) -> torch.Tensor | None:
    """The weight as our kernels read it: a 4-bit product's packed rows (its native candidates share
    them), an fp32 product's weight where our fp32 kernel serves it; else None."""
    if isinstance(product, QuantLinear):
        return next((k.packed for k in product.candidates if isinstance(k, (Int4Native, KQuantNative))), None)
    if isinstance(product, PackedLinear) and product.native:
        return product.weight.detach()
    return None
