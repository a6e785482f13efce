"""K/V rows quantized to 8 bits (`--kv-cache-dtype int8` / `fp8_e4m3`), a scale per token and KV head.

Layout: a quantized pool is [blocks, block_size, kv_heads, head_dim + 2] of int8 (or float8_e4m3fn);
each head's row is its head_dim quantized values, then its fp16 scale in the last two bytes
(value = q * scale, scale = the row's absmax / 127, or / 448 for fp8). Why a scale per token rather
than per block: appending a token into a partly filled block never touches the rows already there
(a per-block scale would have to rescale them once a larger value arrives, rounding them twice), each
row keeps its own range (an outlier token coarsens no other), and it costs 2 bytes a head row: 66
bytes against fp16's 128 at head_dim 64, 1.94x the tokens. Why inside the row: the pool stays one
tensor per layer, so every path that carries pools (the model, the compiled and native steps, CUDA
graphs, copy-on-write) carries the scales with no new plumbing; only the readers dequantize.

Rows are rotated before they are quantized (`rotate`, a Walsh-Hadamard transform of each head, its own
inverse): a few channels of this model's keys are several times larger than the rest, and a row's
absmax scale fit to them left the others a few steps each; rotated, every channel carries a share of
them (QuaRot's trick). Measured on the embedded model (320 tokens read back 32 a step, KL(fp32 pool ||
this)): 4.2e-3 unrotated, 1.2e-3 rotated. Attention is unchanged by the rotation (q.k = Rq.Rk, and the
weighted sum of rotated V rows is the rotated output): kernels reading the pool rotate the queries and
their output (attention.decode_attention, decode_step.cpp); the torch readers get rows rotated back here.
"""

from __future__ import annotations

import torch

# the largest quantized magnitude per pool dtype: int8 keeps -127..127 (symmetric), fp8 e4m3 its finite max
QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_BYTES = 2  # the fp16 scale at the end of each head row
# the scale's range in fp16: its smallest subnormal (an all-zero row) to its largest finite value
_SCALE_MIN, _SCALE_MAX = 2.0**-24, 65504.0


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANT_MAX


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one head's row in a pool of `dtype`: head_dim, plus the scale's bytes if quantized."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def head_dim_of(pool: torch.Tensor) -> int:
    """The head size a pool holds (its last dimension less the scale's bytes, if quantized)."""
    return pool.shape[-1] - (SCALE_BYTES if is_quantized(pool.dtype) else 0)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] -> fp32 x times the orthonormal Walsh-Hadamard matrix, in blocks of the largest
    power of two dividing head_dim (all of it for 64 or 128): its own inverse. Butterflies in the order
    decode_step.cpp takes them, so both give the same bits."""
    dim = x.shape[-1]
    n = dim & -dim
    x = x.float().unflatten(-1, (dim // n, n))
    h = 1
    while h < n:
        pairs = x.unflatten(-1, (n // (2 * h), 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return (x * n**-0.5).flatten(-2)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) -> [..., head_dim + 2] rows of `dtype` with their fp16 scales,
    rotated (`rotate`). The values are divided by the scale as stored (rounded to fp16), so a row's error
    is its own rounding only: |Rx - q * scale| <= scale / 2 (int8). decode_step.cpp computes the same bits."""
    top = QUANT_MAX[dtype]
    x = rotate(x)
    scale = (x.abs().amax(-1, keepdim=True) / top).clamp(_SCALE_MIN, _SCALE_MAX).to(torch.float16)
    q = (x / scale.float()).clamp(-top, top)
    q = q.round().to(dtype) if dtype == torch.int8 else q.to(dtype)
    return torch.cat([q, scale.view(dtype)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., head_dim + 2] quantized rows -> [..., head_dim] of `dtype`, rotated back."""
    return rotate(stored_values(rows)).to(dtype)


def stored_values(rows: torch.Tensor) -> torch.Tensor:
    """[..., head_dim + 2] quantized rows -> fp32 [..., head_dim] as stored (rotated): what a kernel reads."""
    values, scale = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:].contiguous().view(torch.float16)
    return values.float() * scale.float()


def widen(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a pool of any dtype as `dtype` activations: dequantized, or converted."""
    return dequantize(rows, dtype) if is_quantized(rows.dtype) else rows.to(dtype)
