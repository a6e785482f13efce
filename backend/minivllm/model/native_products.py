"""How our native kernels run a model's weight products: each product's kind as decode_step.cpp numbers them, and
its weight as those kernels read it. Shared by the native decode step (native_step.py) and the MoE block's
native expert product (moe.py)."""

from __future__ import annotations

import torch

from minivllm.model.packed_linear import PackedLinear
from minivllm.quant.linear import QuantLinear
from minivllm.quant.matmul_paths import Int4Native, Int8Native, KQuantNative

# A product's kind, as decode_step.cpp numbers them: a 4-bit weight on our kernel by activation precision,
# an fp32 weight on our fp32 kernel, a GGUF K-quant weight on ours by activation precision, or an int8 weight
# (its scales passed beside it) on ours by activation precision
Q4_KINDS = {"int8": 0, "int8x2": 1, "fp32": 2}
FP32_KIND = 3
KQUANT_KINDS = {"int8": 4, "int8x2": 5, "fp32": 6}
INT8_KINDS = {"int8": 7, "int8x2": 8, "fp32": 9}
NATIVE_KINDS = {Int4Native: Q4_KINDS, KQuantNative: KQUANT_KINDS, Int8Native: INT8_KINDS}
ABSENT = torch.empty(0)  # an optional tensor the C++ calls take as not given (a piece, an expert's scales)


def product_kind(product: torch.nn.Module, rows: int) -> int | None:
    """How the native step runs this product at `rows` rows, as the eager step would; None when no
    native kernel would (torch's kernels, MKL)."""
    if isinstance(product, QuantLinear):
        kernel = product.kernel_for(rows)
        return NATIVE_KINDS.get(type(kernel), {}).get(kernel.name.split("/")[-1])
    if isinstance(product, PackedLinear) and product.native:
        return FP32_KIND
    return None


def native_weight(product: torch.nn.Module) -> torch.Tensor | None:
    """The weight as our kernels read it: a 4-bit product's packed rows (its native candidates share
    them), an int8 product's codes, an fp32 product's weight where our fp32 kernel serves it; else None."""
    if isinstance(product, QuantLinear):
        kernel = next((k for k in product.candidates if type(k) in NATIVE_KINDS), None)
        return None if kernel is None else kernel.q if isinstance(kernel, Int8Native) else kernel.packed
    if isinstance(product, PackedLinear) and product.native:
        return product.weight.detach()
    return None


def native_scales(product: torch.nn.Module) -> torch.Tensor | None:
    """An int8 product's scales, which our kernels take beside its codes (per row or per block of 32); else None."""
    if isinstance(product, QuantLinear):
        return next((k.scale for k in product.candidates if isinstance(k, Int8Native)), None)
    return None
