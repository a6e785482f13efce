"""GGUF K-quant rows regrouped by eight for our kernels (native/kquant_matmul.cpp's kQ4Kx8 and kQ6Kx8): a
vector there holds four codes of each of eight rows and meets one broadcast of four activation codes, so a
sub-block sums in integer lanes that are each one output's. The same numbers, only where they lie; the same
bytes a row, or a few more where 6-bit scales are unpacked to bytes (Q4_K: 148, not 144; Q5_K: 180, not 176;
Q6_K: 210).

Per group of eight rows and super-block of 256:
  Q4_K (1,184 bytes): the rows' fp16 d, their fp16 dmin, per sub-block of 32 the rows' scales (64), then their
       mins (64), then per 32-byte chunk of the file's nibbles and four bytes of it, the rows' four bytes (1,024).
  Q5_K (1,440 bytes): as Q4_K, then per sub-block the fifth bits (256): bit g of byte [row, k] is element 4g + k's.
  Q6_K (1,680 bytes): the rows' fp16 d, per group of 16 the rows' int8 scales (128), then per group of 16 its
       four chunks of four codes a, b, c, d as 96 bytes: a | b << 4, c | d << 4 (the low nibbles) and the high
       bit pairs a | b << 2 | c << 4 | d << 6, each [row, code] of 8 x 4.
"""

from __future__ import annotations

import numpy as np
import torch

from minivllm.quant.formats import KQUANT_BYTES

GROUP_ROWS = 8
GROUPED_TYPES = ("Q4_Kx8", "Q6_Kx8", "Q5_Kx8")  # kquant_matmul.cpp's KType numbers 3, 4, 5


GROUPS = {"Q4_K": "Q4_Kx8", "Q5_K": "Q5_Kx8", "Q6_K": "Q6_Kx8"}
GROUPED_BYTES = {"Q4_Kx8": 148, "Q5_Kx8": 180, "Q6_Kx8": 210}  # a row's bytes per super-block


def super_bytes(kind: str) -> int:
    """A row's bytes per super-block as `kind` (a file's type or a grouped one) lies."""
    return GROUPED_BYTES.get(kind) or KQUANT_BYTES[kind]


def kernel_kinds(parts: list[tuple[str, torch.Tensor]]) -> list[str]:
    """The type each part runs as: regrouped when every part's rows come in eights (a task then never cuts a
    group), else as the file has it."""
    if any(data.shape[0] % GROUP_ROWS for _, data in parts):
        return [kind for kind, _ in parts]
    return [GROUPS.get(kind, kind) for kind, _ in parts]


def write_part(kind: str, data: torch.Tensor, out: torch.Tensor, rows: int = 256) -> None:
    """A part's rows into `out` ([N, its row bytes]) as `kind` (`kernel_kinds`), a slice of rows at a time: numpy's
    temporaries stay a slice's size, in cache (Q5_K, Q6_K 1.3-1.5x faster than whole tensors), and no whole
    regrouped copy sits beside the packed weight (a load's peak RSS +150 MiB at TinyLlama's shapes)."""
    regroup = {"Q4_Kx8": group_q4_k, "Q5_Kx8": group_q5_k, "Q6_Kx8": group_q6_k}.get(kind)
    for start in range(0, data.shape[0], rows):
        piece = data[start : start + rows]
        out[start : start + rows] = regroup(piece) if regroup else piece


def _groups(data: torch.Tensor, block_bytes: int) -> np.ndarray:
    """[N, S * bytes] as [N/8 groups, S, 8 rows, bytes]."""
    n, width = data.shape
    return data.numpy().reshape(n // GROUP_ROWS, GROUP_ROWS, width // block_bytes, block_bytes).transpose(0, 2, 1, 3)


def _rows(groups: np.ndarray, pieces: list[np.ndarray]) -> torch.Tensor:
    g, s = groups.shape[:2]
    joined = np.concatenate([p.reshape(g, s, -1) for p in pieces], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(joined).reshape(g * GROUP_ROWS, -1))


def group_q4_k(data: torch.Tensor) -> torch.Tensor:
    blocks = _groups(data, 144)
    return _rows(blocks, _scaled_nibbles(blocks, blocks[..., 16:144]))


def group_q5_k(data: torch.Tensor) -> torch.Tensor:
    blocks = _groups(data, 176)
    g, s = blocks.shape[:2]
    bits = (blocks[..., 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # [G, S, row, element l, sub-block j]
    bits = bits.reshape(g, s, GROUP_ROWS, 8, 4, 8).transpose(0, 1, 5, 2, 4, 3)  # [G, S, j, row, l % 4, l // 4]
    fifth = (bits << np.arange(8, dtype=np.uint8)).sum(-1, dtype=np.uint8)
    return _rows(blocks, [*_scaled_nibbles(blocks, blocks[..., 48:176]), fifth])


def _scaled_nibbles(blocks: np.ndarray, nibbles: np.ndarray) -> list[np.ndarray]:
    """Q4_K / Q5_K: d, dmin, the scales and mins as bytes, and the nibbles by chunk of four bytes and row."""
    packed = blocks[..., 4:16]  # 6-bit scales and mins, llama.cpp's packing
    low, high = packed[..., 8:12] & 0x0F, packed[..., 8:12] >> 4
    scales = np.concatenate([packed[..., 0:4] & 63, low | ((packed[..., 0:4] >> 6) << 4)], axis=-1)
    mins = np.concatenate([packed[..., 4:8] & 63, high | ((packed[..., 4:8] >> 6) << 4)], axis=-1)
    g, s = blocks.shape[:2]
    by_chunk = nibbles.reshape(g, s, GROUP_ROWS, 32, 4).transpose(0, 1, 3, 2, 4)  # [G, S, chunk, row, 4]
    return [blocks[..., 0:2], blocks[..., 2:4], scales.swapaxes(2, 3), mins.swapaxes(2, 3), by_chunk]


def q6_k_codes(blocks: np.ndarray) -> np.ndarray:
    """[..., 210] Q6_K super-blocks' 256 unsigned 6-bit codes each, in input order (gguf-py's arithmetic, less
    its -32 and scales)."""
    ql, qh = blocks[..., 0:128], blocks[..., 128:192]
    halves = []
    for h in range(2):
        low, high = ql[..., 64 * h : 64 * h + 64], qh[..., 32 * h : 32 * h + 32]
        nibbles = [low[..., :32] & 0x0F, low[..., 32:] & 0x0F, low[..., :32] >> 4, low[..., 32:] >> 4]
        halves += [nibbles[i] | (((high >> (2 * i)) & 3) << 4) for i in range(4)]
    return np.concatenate(halves, axis=-1)


def group_q6_k(data: torch.Tensor) -> torch.Tensor:
    blocks = _groups(data, 210)
    g, s = blocks.shape[:2]
    codes = q6_k_codes(blocks).reshape(g, s, GROUP_ROWS, 16, 4, 4).transpose(0, 1, 3, 4, 2, 5)  # [G,S,16,abcd,row,4]
    a, b, c, d = (codes[:, :, :, i] for i in range(4))
    quads = np.stack(
        [
            (a & 15) | ((b & 15) << 4),
            (c & 15) | ((d & 15) << 4),
            (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((d >> 4) << 6),
        ],
        axis=3,
    )
    return _rows(blocks, [blocks[..., 208:210], blocks[..., 192:208].swapaxes(2, 3), quads])
