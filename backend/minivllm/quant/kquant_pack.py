"""Floats into GGUF's Q4_K super-blocks (the layout gguf-py dequantizes and kquant_matmul.cpp reads), so that
GGUF types no kernel reads (Q2_K, Q3_K, the IQ types) sit beside their file's Q4_K / Q5_K / Q6_K tensors in
one K-quant format: a fused q|k|v of Q3_K q and k and a Q5_K v stays one KQuantWeight.

Round-to-nearest per sub-block of 32 with a minimum (x ~= d * sc * q - dmin * m; sc, m of 6 bits, q of 4),
not llama.cpp's searched scales: these weights were already rounded once by the file. On Gaussian weights
the mean error is 1.01x that of fp32 scales per group of 32 (8.2% vs 8.1% of the mean magnitude).
"""

from __future__ import annotations

import numpy as np
import torch

from minivllm.quant.formats import SUPER_BLOCK, KQuantWeight

SUB_BLOCK = 32
SUBS = SUPER_BLOCK // SUB_BLOCK  # 8 sub-blocks, each with its own 6-bit scale and minimum


def quantize_q4_k(weight: torch.Tensor) -> KQuantWeight:
    """[N, K] floats (K a multiple of 256) as Q4_K rows."""
    n, k = weight.shape
    if k % SUPER_BLOCK:
        raise ValueError(f"Q4_K needs rows of whole super-blocks of {SUPER_BLOCK}, got {k} columns")
    x = weight.detach().float().numpy().reshape(n, k // SUPER_BLOCK, SUBS, SUB_BLOCK)
    low = np.minimum(x.min(-1), 0.0)  # the minimum is subtracted: never above 0
    step = (x.max(-1) - low) / 15
    d, sc = _six_bit(step)
    dmin, m = _six_bit(-low)
    scale = (d[..., None] * sc).astype(np.float32)[..., None]
    offset = (dmin[..., None] * m).astype(np.float32)[..., None]
    q = np.where(scale > 0, np.rint((x + offset) / np.where(scale > 0, scale, 1)), 0).clip(0, 15).astype(np.uint8)
    return KQuantWeight([("Q4_K", torch.from_numpy(_pack(d, dmin, sc, m, q).reshape(n, -1)))])


def _six_bit(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per super-block an fp16 unit and per sub-block the 6-bit multiple of it nearest each value (>= 0);
    rounding up instead measured 1.02x the error: the clamp at 15 costs less than the coarser grid."""
    unit = (values.max(-1) / 63).astype(np.float16)
    unit32 = unit.astype(np.float32)[..., None]
    codes = np.where(unit32 > 0, np.rint(values / np.where(unit32 > 0, unit32, 1)), 0).clip(0, 63).astype(np.uint8)
    return unit, codes


def _pack(d, dmin, sc, m, q) -> np.ndarray:
    """144 bytes a super-block: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and minimums (sub-blocks 0-3 in
    the low 6 bits of bytes 0-3 / 4-7, 4-7 split into nibbles in bytes 8-11 and the top 2 bits of 0-7), then
    per 64 weights 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones."""
    scales = np.concatenate(
        [
            sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
            m[..., :4] | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4),
        ],
        axis=-1,
    )
    pairs = q.reshape(*q.shape[:-2], SUBS // 2, 2, SUB_BLOCK)
    nibbles = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(*q.shape[:-2], -1)
    return np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), scales, nibbles], axis=-1)
