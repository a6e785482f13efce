"""The key shift of a sliding KV window (StreamingLLM, Xiao et al. 2023).

A windowed sequence's rotary positions are its tokens' indices in its compacted cache [sinks | window],
never their absolute indices. When d tokens leave the window, every key still in the window moves from
cache position p to p - d: a rotation by -d, K' = K cos(d theta) - rotate_half(K) sin(d theta). Rotations
compose, so the shifted key equals the key written at p - d up to rounding; values carry no position.
"""

from __future__ import annotations

import torch

from minivllm.model.rope import RotaryEmbedding


def shift_tables(rotary: RotaryEmbedding, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin of a rotation by -d, fp32 [rotary_dim]. The tables at position d, with
    LongRoPE's attention factor divided out (a shift must rotate, never scale) and the sine negated."""
    cos, sin = rotary.cos[d], rotary.signed_sin[d]
    scale = torch.sqrt(cos * cos + sin * sin)  # the attention factor, equal in every dimension
    return cos / scale, -sin / scale


def shift_keys(pool: torch.Tensor, block_ids: list[int], rotary: RotaryEmbedding, d: int) -> None:
    """Rotate the keys of these blocks of one layer's pool [blocks, block_size, heads, head_dim] back by
    d positions, in place, computed in fp32 (a key is shifted a few times in its life: ~4 roundings)."""
    if not block_ids or d == 0:
        return
    if d >= rotary.cos.shape[0]:
        raise ValueError(f"a key shift of {d} positions is past the rotary tables ({rotary.cos.shape[0]} positions)")
    cos, sin = (t.to(pool.device) for t in shift_tables(rotary, d))
    ids = torch.tensor(block_ids, dtype=torch.long, device=pool.device)
    keys = pool.index_select(0, ids).float()
    pool.index_copy_(0, ids, RotaryEmbedding.rotate(keys, cos, sin).to(pool.dtype))


def layer_rotaries(model) -> list[RotaryEmbedding]:
    """Each decoder layer's own rotary module: Gemma 3's sliding-window layers have a base of their own."""
    return [
        model.local_rotary if layer.self_attn.local_rope else model.rotary  # type: ignore[union-attr]
        for layer in model.layers
    ]


def apply_shifts(
    k_pools: list[torch.Tensor], rotaries: list[RotaryEmbedding], shifts: list[tuple[list[int], int]]
) -> None:
    """A step's key shifts `(block ids, d)`, every layer with its own rope."""
    for block_ids, d in shifts:
        for pool, rotary in zip(k_pools, rotaries):
            shift_keys(pool, block_ids, rotary, d)
