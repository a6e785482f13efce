"""Rotary position embeddings: the default schedule and Llama 3's frequency-dependent scaling.

The cos/sin tables are computed once in fp32 for every position up to the model's length and
indexed by each token's position, so a flattened batch of tokens from many sequences costs one
gather, whatever their positions.
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


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = default_inv_freq(head_dim, theta)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        return llama3_inv_freq(inv_freq, scaling or {})
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, llama3)")


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        # On the CPU even where the model is built on the meta device (the loader): these tables are
        # not in a checkpoint, and meta tensors' arithmetic would import torch's compiler (~70 MiB).
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)  # HF layout: first half / second half, not interleaved
        self.register_buffer("cos", angles.cos(), persistent=False)
        # rotate_half(x) * sin == swap_halves(x) * [-sin, +sin]: the sign lives in the table, so a
        # rotation is one roll and three elementwise ops instead of slices, neg and cat. A roll, not
        # a reshape and flip: reshaping a row slice asks whether the row count is 1 (compiled.py).
        signed_sin = angles.sin()
        signed_sin[:, : head_dim // 2].neg_()
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
        """x: [tokens, heads, head_dim]; rotates every head of every token by its own position.
        Bit-identical to HF's `x * cos + rotate_half(x) * sin` (negation is exact)."""
        swapped = x.roll(x.shape[-1] // 2, -1)
        return x * cos + swapped * signed_sin
