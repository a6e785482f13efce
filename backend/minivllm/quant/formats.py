"""Quantized weight formats, independent of any kernel.

Int4Weight and Int8Weight describe a linear weight W [out, in] ("N rows of K inputs") in groups along the input
dimension, the layout GGUF and torch's CPU/CUDA 4-bit kernels share:

  Int4Weight   W[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g],  q in 0..15,   g = k // group
  Int8Weight   W[n, k] = q[n, k] * scale[n, g],                      q in -127..127

A GGUF Q4_1 block (w = d*q + m) is an Int4Weight with scale = d and zero = m + 8d, exactly; a Q8_0
block is an Int8Weight with group 32. `group_size == in_features` means one group per row
(per-channel). GGUF's K-quants (Q4_K, Q5_K, Q6_K: super-blocks of 256 with 6- or 8-bit sub-block
scales) fit neither without re-rounding, so a KQuantWeight keeps their blocks as the file stores them.
Formats are row-concatenable, which is how q|k|v and gate|up are fused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class QuantizationError(ValueError):
    """A weight cannot be quantized as asked (e.g. its input size is not a multiple of the group)."""


BLOCK = 32  # weights per stored 4-bit block (GGUF's Q4_1)
_BLOCK_BYTES = 20  # an fp16 d, an fp16 m and 16 bytes of nibbles


@dataclass
class Int4Weight:
    """Stored as Q4_1 rows, the layout our 4-bit kernels read: per row fp16 d[K/32], fp16 m[K/32], then
    16 bytes of nibbles per block (element j of a block is byte j's low nibble, element j + 16 its high
    one), w = d*q + m. A GGUF Q4_1 tensor is its file bytes regrouped, with no unpacking: one byte per
    weight held while loading the embedded model was ~100 MiB of the load's peak. A group wider than 32
    repeats its d and m in each block. `q`, `scale` and `zero` are computed on demand (torch's kernels,
    CUDA, dequantizing): nothing keeps a second form."""

    packed: torch.Tensor  # uint8 [N, K/32 * 20]
    group_size: int
    bits = 4

    @classmethod
    def from_values(cls, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group_size: int) -> Int4Weight:
        """q [N, K] in 0..15; scale (d) and minimum (m) [N, K / group], fp16 values (as fp32 or fp16)."""
        n, k = q.shape
        repeat = group_size // BLOCK
        halves = torch.cat([scale.repeat_interleave(repeat, dim=1), minimum.repeat_interleave(repeat, dim=1)], dim=1)
        blocks = q.reshape(n, k // BLOCK, BLOCK).to(torch.uint8)
        nibbles = (blocks[..., :16] | (blocks[..., 16:] << 4)).reshape(n, -1)
        return cls(torch.cat([halves.to(torch.float16).view(torch.uint8), nibbles], dim=1), group_size)

    @property
    def shape(self) -> tuple[int, int]:
        rows, row_bytes = self.packed.shape
        return rows, row_bytes // _BLOCK_BYTES * BLOCK

    @property
    def q(self) -> torch.Tensor:
        """uint8 [N, K], values 0..15."""
        n, k = self.shape
        nibbles = self.packed[:, 4 * (k // BLOCK) :].reshape(n, k // BLOCK, 16)
        return torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(n, k)

    @property
    def scale(self) -> torch.Tensor:
        """float32 [N, K / group]: d."""
        return self._halves(0)

    @property
    def zero(self) -> torch.Tensor:
        """float32 [N, K / group]: m + 8d, so that w = (q - 8) * scale + zero (torch's int4 form)."""
        return self._halves(1) + 8 * self.scale

    def _halves(self, which: int) -> torch.Tensor:
        blocks = self.shape[1] // BLOCK
        values = self.packed[:, 2 * blocks * which : 2 * blocks * (which + 1)].contiguous().view(torch.float16)
        return values[:, :: self.group_size // BLOCK].float()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scale = self.scale.repeat_interleave(self.group_size, dim=1)
        zero = self.zero.repeat_interleave(self.group_size, dim=1)
        return ((self.q.float() - 8) * scale + zero).to(dtype)

    def rows(self, index: torch.Tensor) -> Int4Weight:
        return Int4Weight(_take_rows(self.packed, index), self.group_size)


@dataclass
class Int8Weight:
    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # [N, K // group]: float32, or float16 as GGUF's Q8_0 holds them
    group_size: int
    bits = 8

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def per_channel(self) -> bool:
        return self.group_size == self.q.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scale.repeat_interleave(self.group_size, dim=1)).to(dtype)

    def rows(self, index: torch.Tensor) -> Int8Weight:
        return Int8Weight(_take_rows(self.q, index), self.scale[index], self.group_size)


KQUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K")  # the GGML K-quant types our kernels read, in their native numbering
SUPER_BLOCK = 256  # weights per K-quant super-block
KQUANT_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes per super-block


@dataclass
class KQuantWeight:
    """GGUF K-quant rows as the file stores them (super-blocks of 256, layouts in native/kquant_matmul.cpp),
    in parts stacked by rows, each of one type: a fused q|k|v may hold a Q6_K v under a Q4_K q and k, and
    keeps every part's bytes rather than meeting in floats. Dequantized by gguf-py, the reference the
    kernels are tested against."""

    parts: list[tuple[str, torch.Tensor]]  # (GGML type name, uint8 [rows, K/256 * KQUANT_BYTES[type]])
    group_size = SUPER_BLOCK

    @property
    def shape(self) -> tuple[int, int]:
        kind, data = self.parts[0]
        return sum(d.shape[0] for _, d in self.parts), data.shape[1] // KQUANT_BYTES[kind] * SUPER_BLOCK

    @property
    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.parts]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from gguf import GGMLQuantizationType, quants

        return torch.cat(
            [torch.from_numpy(quants.dequantize(data.numpy(), GGMLQuantizationType[kind])) for kind, data in self.parts]
        ).to(dtype)

    def rows(self, index: torch.Tensor) -> KQuantWeight:
        """Rows by index from a one-part weight (the loader's Q/K un-permutation, an embedding's lookup)."""
        if len(self.parts) != 1:
            raise QuantizationError("row selection applies to a K-quant weight of one part")
        kind, data = self.parts[0]
        return KQuantWeight([(kind, _take_rows(data, index))])


QuantizedWeight = Int4Weight | Int8Weight | KQuantWeight


def _take_rows(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    # numpy's take on 1-byte rows is ~10x faster than torch's integer indexing of uint8/int8
    return torch.from_numpy(values.numpy().take(index.numpy(), axis=0))


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Fuse weights that share an input (q|k|v, gate|up) into one."""
    first = parts[0]
    if any(type(p) is not type(first) or p.group_size != first.group_size for p in parts):
        raise QuantizationError(
            "cannot fuse weights of different quantized formats: "
            + ", ".join(f"{type(p).__name__}(group {p.group_size})" for p in parts)
        )
    if isinstance(first, Int4Weight):
        return Int4Weight(torch.cat([p.packed for p in parts]), first.group_size)
    if isinstance(first, KQuantWeight):
        return KQuantWeight([part for p in parts for part in p.parts])
    return Int8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), first.group_size)


def _check_groups(name: str, weight: torch.Tensor, group_size: int) -> None:
    if weight.dim() != 2 or weight.shape[1] % group_size:
        raise QuantizationError(
            f"cannot quantize {name} of shape {tuple(weight.shape)} with group size {group_size}: "
            f"its input dimension ({weight.shape[-1]}) is not a multiple of the group size; "
            f"choose a group size that divides it or --quantization none"
        )


def quantize_int4(name: str, weight: torch.Tensor, group_size: int) -> Int4Weight:
    """Asymmetric round-to-nearest in groups along the input dimension (min/max per group). The
    minimum and the step are fp16 values, as in GGUF's Q4_1 (rounded outward, so the grid still
    covers the group): the native kernels store them in fp16 and then compute exactly this weight."""
    _check_groups(name, weight, group_size)
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    low = _to_half(low, rounding=-1)
    scale = _to_half(((high - low) / 15).clamp(min=_HALF_TINY), rounding=+1)
    q = ((groups - low[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    return Int4Weight.from_values(q.reshape(n, k), scale, low, group_size)


_HALF_TINY = 2.0**-24  # the smallest positive fp16 value


def _to_half(values: torch.Tensor, rounding: int) -> torch.Tensor:
    """fp16-representable values (as fp32), rounded down (rounding=-1) or up (+1)."""
    half = values.half()
    off = half.float() > values if rounding < 0 else half.float() < values
    toward = torch.full_like(half, rounding * float("inf"))
    return torch.where(off, torch.nextafter(half, toward), half).float()


def quantize_int8(name: str, weight: torch.Tensor, group_size: int | None = None) -> Int8Weight:
    """Symmetric round-to-nearest; per output channel unless a group size is given."""
    group_size = group_size or weight.shape[-1]
    _check_groups(name, weight, group_size)
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // group_size, group_size)
    scale = (groups.abs().amax(-1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = (groups / scale[..., None]).round_().clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.reshape(n, k), scale, group_size)


def to_per_channel(weight: Int8Weight) -> Int8Weight:
    """Requantize a grouped int8 weight (GGUF Q8_0) with one scale per row: the form torch's int8
    kernels take. The error is at most half a row-scale step; `bench quality` measures its effect."""
    if weight.per_channel:
        return weight
    return quantize_int8("(per-channel)", weight.dequantize(), None)


def weight_bytes(weight: QuantizedWeight | torch.Tensor) -> int:
    """Bytes of the stored format (int4 counted packed two to a byte)."""
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    if isinstance(weight, Int4Weight):
        return weight.packed.numel()
    if isinstance(weight, KQuantWeight):
        return sum(data.numel() for _, data in weight.parts)
    values = weight.q.numel() * weight.bits // 8
    return values + weight.scale.numel() * weight.scale.element_size()
