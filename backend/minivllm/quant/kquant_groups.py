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

import torch

from minivllm.kernels.cpu import native
from minivllm.quant.formats import KQUANT_BYTES, KQUANT_TYPES

GROUP_ROWS = 8
GROUPED_TYPES = ("Q4_Kx8", "Q6_Kx8", "Q5_Kx8")
KERNEL_TYPES = (*KQUANT_TYPES, *GROUPED_TYPES)  # kquant_matmul.cpp's KType numbering


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


def write_part(kind: str, data: torch.Tensor, out: torch.Tensor) -> None:
    """A part's rows into `out` ([N, its row bytes]) as `kind` (`kernel_kinds`): regrouped by our kernels' own
    op (`kquant_regroup`, groups in parallel), or copied as the file has them."""
    if kind in GROUPED_TYPES:
        native.kquant_regroup(data.contiguous(), KERNEL_TYPES.index(kind), out)
    else:
        out.copy_(data)
