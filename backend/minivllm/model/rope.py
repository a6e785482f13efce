"""Rotary position embeddings: the default schedule, linear scaling, Llama 3's frequency-dependent scaling
and Phi-3's LongRoPE, over a whole head or its leading `rotary_dim` dimensions (`partial_rotary_factor`).

The cos/sin tables are computed once in fp32 for every position up to the model's length and
indexed by each token's position, so a flattened batch of tokens from many sequences costs one
gather, whatever their positions.

LongRoPE has two sets of per-frequency factors: short ones for contexts up to the pretraining length
(`original_max_position_embeddings`), long ones past it. transformers picks them per forward pass by the
longest position in it, which a KV cache cannot follow (keys rotated with short factors stay cached).
The rule here is llama.cpp's, one set per loaded model by its context length: long factors where the
model is loaded for more than the pretraining length, short ones otherwise. That equals transformers
for every sequence up to the pretraining length in the first case, and for every sequence past it in
the second. Both scale cos and sin by the attention factor, as transformers does.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (theta**exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 rope scaling: long wavelengths are slowed by `factor`, short ones kept, a smooth
    blend in between (the published recipe, identical to transformers' `llama3` rope type)."""
    factor = scaling["factor"]
    low_factor = scaling.get("low_freq_factor", 1.0)
    high_factor = scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_len / low_factor
    high_freq_wavelen = old_len / high_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_factor) / (high_factor - low_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def longrope_inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any], max_positions: int) -> torch.Tensor:
    """Phi-3's LongRoPE: each frequency divided by its factor, long ones where the model is loaded for
    more than the pretraining length (module docstring)."""
    long = max_positions > scaling["original_max_position_embeddings"]
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32, device="cpu")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    return 1.0 / (factors * theta**exponents)


def inverse_frequencies(
    rotary_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int
) -> tuple[torch.Tensor, float]:
    """The inverse frequencies and the factor cos and sin are scaled by."""
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return default_inv_freq(rotary_dim, theta), 1.0
    if rope_type == "llama3":
        return llama3_inv_freq(default_inv_freq(rotary_dim, theta), scaling or {}), 1.0
    if rope_type == "linear":  # positions divided by `factor` (Gemma 3's global layers)
        return default_inv_freq(rotary_dim, theta) / scaling["factor"], 1.0
    if rope_type == "longrope":
        return longrope_inv_freq(rotary_dim, theta, scaling or {}, max_positions), scaling["attention_factor"]
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3, longrope)")


class RotaryEmbedding(torch.nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        rotary_dim: int | None = None,
    ):
        super().__init__()
        rotary_dim = rotary_dim or head_dim
        self.partial = rotary_dim < head_dim  # only a head's leading dims rotate: the tables are that wide
        # On the CPU even where the model is built on the meta device (the loader): these tables are
        # not in a checkpoint, and meta tensors' arithmetic would import torch's compiler (~70 MiB).
        inv_freq, attention_factor = inverse_frequencies(rotary_dim, theta, scaling, max_positions)
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)  # HF layout: first half / second half, not interleaved
        self.register_buffer("cos", angles.cos() * attention_factor, persistent=False)
        # rotate_half(x) * sin == swap_halves(x) * [-sin, +sin]: the sign lives in the table, so a
        # rotation is one roll and three elementwise ops instead of slices, neg and cat. A roll, not
        # a reshape and flip: reshaping a row slice asks whether the row count is 1 (compiled.py).
        signed_sin = angles.sin() * attention_factor
        signed_sin[:, : rotary_dim // 2].neg_()
        self.register_buffer("signed_sin", signed_sin, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for a step's positions, [tokens, 1, head_dim]: looked up once, used by
        every layer."""
        # index_select, not indexing: the same rows without Python's advanced-indexing path (~10-25 us
        # a call in a decode step whose weights have just evicted the caches)
        return (
            self.cos.index_select(0, positions).unsqueeze(1).to(dtype),
            self.signed_sin.index_select(0, positions).unsqueeze(1).to(dtype),
        )

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim]; rotates every head of every token by its own position (its
        leading dimensions where the tables are narrower: partial rotary). Bit-identical to HF's
        `x * cos + rotate_half(x) * sin` (negation is exact)."""
        rotary_dim = cos.shape[-1]
        if rotary_dim < x.shape[-1]:
            rotated = RotaryEmbedding.rotate(x[..., :rotary_dim], cos, signed_sin)
            return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
        swapped = x.roll(rotary_dim // 2, -1)
        return x * cos + swapped * signed_sin
