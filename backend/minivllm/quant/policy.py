"""Which precision each tensor runs in: `--quantization {auto,none,int8,int4}`.

  auto   what the checkpoint holds: GGUF Q4_1 -> int4, Q8_0 -> int8, Q4_K/Q5_K/Q6_K in their own
         super-blocks (a K-quant LM head too: Q6_K in a Q4_K_M file), F32/F16/BF16 and safetensors
         in the model dtype; Q4_0 / Q5_0 moved exactly into int4 / int8 g32, other GGUF types
         re-rounded at read time to the nearest native format (gguf_tensors.py; the loader warns)
  none   everything dequantized to the model dtype (the HF-parity reference)
  int4   linear layers in 4 bits, asymmetric, groups of 32/64/128 along the input
  int8   linear layers in 8 bits, symmetric, one scale per output channel

The embedding and the LM head (one tensor when tied) are never taken below 8 bits: every logit
reads the whole head, and 4-bit heads cost the most quality for the least memory in llama.cpp's
and torchao's measurements, so int4/int8 both put them in per-channel int8 (auto keeps a GGUF Q8_0
table in its own blocks of 32: exactly the file's values). Norms stay in floats (576 values per
layer: nothing to gain).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from minivllm.quant.formats import (
    Int4Weight,
    Int8Weight,
    KQuantWeight,
    QuantizedWeight,
    concat_rows,
    quantize_int4,
    quantize_int8,
)

QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)
TABLE_NAMES = ("embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class QuantConfig:
    mode: str = "auto"
    group_size: int = 32  # int4 groups when quantizing at load
    kernel: str | None = None  # force one kernel for every quantized layer (tests, A/B benchmarks)

    def validate(self) -> QuantConfig:
        if self.mode not in QUANTIZATION_CHOICES:
            raise ValueError(f"unknown quantization {self.mode!r}; choose one of {', '.join(QUANTIZATION_CHOICES)}")
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {self.group_size}")
        return self


def fuse(parts: list[torch.Tensor | QuantizedWeight]) -> torch.Tensor | QuantizedWeight:
    """q|k|v or gate|up into one weight. Mixed formats (a GGUF with a Q6_K v next to Q4_1 q/k) are
    fused in floats; the policy then decides."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    if (
        any(isinstance(p, torch.Tensor) for p in parts)
        or len({type(p) for p in parts}) > 1
        or len({p.group_size for p in parts}) > 1
    ):
        return torch.cat([dequantize(p) for p in parts])
    return concat_rows(parts)


def dequantize(value: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else value.dequantize()


def apply_policy(
    state: Mapping[str, torch.Tensor | QuantizedWeight], config: QuantConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Model-named tensors in, the same names in the precision they will run in out."""
    return {name: _decide(name, value, config, dtype) for name, value in state.items()}


def _decide(name: str, value, config: QuantConfig, dtype: torch.dtype):
    is_matrix = name.endswith(".weight") and (name in TABLE_NAMES or "_proj." in name)
    if config.mode == "none" or not is_matrix:
        return dequantize(value).to(dtype)
    if name in TABLE_NAMES and isinstance(value, Int8Weight):
        return value  # GGUF Q8_0 stays in its own blocks: the lookup and our kernels take them as they are
    if config.mode == "auto":
        return value if not isinstance(value, torch.Tensor) else value.to(dtype)
    if name in TABLE_NAMES:
        return quantize_int8(name, dequantize(value))
    if config.mode == "int4":
        if isinstance(value, Int4Weight) and value.group_size == config.group_size:
            return value  # already stored this way (GGUF Q4_1 at group 32): no re-rounding
        return quantize_int4(name, dequantize(value), config.group_size)
    if isinstance(value, Int8Weight) and value.per_channel:
        return value
    return quantize_int8(name, dequantize(value))


def compounded_rounding_note(state: Mapping[str, torch.Tensor | QuantizedWeight], config: QuantConfig) -> str | None:
    """A warning where `int4` re-rounds weights the checkpoint already holds in 4 bits at another group
    size: a second 4-bit rounding on top of the first (the embedded model at g64: KL 0.99 nats against
    fp32, PPL 14.3 -> 28.7 in `bench quality`, where g32 keeps the file's values exactly)."""
    if config.mode != "int4":
        return None
    rerounded = [
        v.group_size for v in state.values() if isinstance(v, Int4Weight) and v.group_size != config.group_size
    ]
    if not rerounded:
        return None
    groups = sorted(set(rerounded))
    return (
        f"warning: {len(rerounded)} weight(s) stored in 4 bits (groups of {'/'.join(map(str, groups))}) "
        f"re-quantized to int4 g{config.group_size}: a second 4-bit rounding on top of the checkpoint's, "
        f"which costs far more quality than either alone; --quantization auto (or int4 with group {groups[0]}) "
        f"keeps the stored values"
    )


def describe_mode(state: Mapping[str, torch.Tensor | QuantizedWeight]) -> str:
    """A short human name for what the policy produced: 'int4 g32 + int8 embedding', 'none'."""
    kinds = sorted({k for n, v in state.items() if n not in TABLE_NAMES and "_proj." in n for k in _kinds(v)})
    table = {k for n, v in state.items() if n in TABLE_NAMES for k in _kinds(v)}
    text = "/".join(kinds) or "none"
    if table and table != set(kinds):
        text += f" (embedding and LM head: {'/'.join(sorted(table))})"
    return text


def _kinds(value) -> list[str]:
    """The formats a weight holds: one, or a K-quant weight's GGUF types (a fused q|k|v may hold two)."""
    return value.kinds if isinstance(value, KQuantWeight) else [_kind(value)]


def _kind(value) -> str:
    if isinstance(value, Int4Weight):
        return f"int4 g{value.group_size}"
    if isinstance(value, Int8Weight):
        return "int8" if value.per_channel else f"int8 g{value.group_size}"
    return str(value.dtype).removeprefix("torch.")
