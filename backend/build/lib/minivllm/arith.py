"""Integer helpers shared by the block accounting, the validation and the quantized formats."""

from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    """a / b rounded up, for non-negative a and positive b (blocks needed for a number of tokens)."""
    return -(-a // b)
