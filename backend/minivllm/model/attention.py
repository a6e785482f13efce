"""Paged attention over a block-structured KV pool, for a flattened batch of tokens.

A step's tokens are laid out decode tokens first (one per decoding sequence), then the prefill
chunks one sequence after another. New K/V are written through `slot_mapping` (flat slot =
block_id * block_size + offset). Decode attention reads K/V straight from the pool through the block
tables: on a CPU our native kernel (`kernels/cpu/paged_attention.cpp`), on CUDA a Triton kernel
(`kernels/triton/attention.py`). Elsewhere, or without those kernels, it is one batched gather + one
fused attention call for all decoding sequences together (no Python loop over sequences). Each
prefill chunk is one SDPA call.

The pool may hold K/V in a narrower dtype than the activations (`--kv-cache-dtype`): values are
rounded once when written and widened when read; int8 / fp8 pools hold a scale per token and head
(model/kv_quant.py), and every reader dequantizes.

Sliding-window attention (`AttentionMetadata.window`, Mistral): the query at position p attends to keys
in (p - window, p]. The masks say so, a prefill chunk gathers from the block its first query's window
starts in, and the native kernel starts each sequence there; a block table's slots before that are
FREED (core/block_manager.py) and read as block 0, always masked. Triton does not take a window: such
a pool's decode attention gathers (`reads_pool_directly`).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minivllm.console import progress
from minivllm.env import env_flag
from minivllm.kernels.cpu import native
from minivllm.model.kv_quant import head_dim_of, is_quantized, quantize, rotate, row_width, widen

# what the native and Triton kernels read (int8: rows with their scales, kv_quant.py; fp8 pools: torch only)
POOL_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8)


@dataclass
class PrefillChunk:
    """One sequence's chunk of new tokens: rows [start, end) of the flattened batch."""

    start: int
    end: int
    num_computed: int  # tokens of this sequence already in the cache before this chunk
    block_table: torch.Tensor  # [num_blocks_of_seq] long
    mask: torch.Tensor | None = None  # [new, context] causal mask over prefix + chunk (None: plain causal)
    key_start: int = 0  # the first key position it reads (a block's first, before the chunk's first window)

    @property
    def context_len(self) -> int:
        return self.num_computed + (self.end - self.start)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks] long, padded with 0
    decode_context_lens: torch.Tensor | None  # [num_decode] long, including the new token
    prefills: list[PrefillChunk]
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_len] additive: -inf past each context
    block_size: int = 16  # of the pool, for the decode mask's width
    dtype: torch.dtype = torch.float32  # the model's activations: the decode mask's dtype
    decode_mask_read: bool = True  # False where a kernel reads the pool (it bounds by length): reads_pool_directly
    window: int | None = None  # sliding-window attention over this many keys (the query's own included)

    def __post_init__(self) -> None:
        """Masks are built once per step here, not lazily in the first layer: the forward pass then
        only reads tensors (nothing for a compiled graph to branch on)."""
        if self.decode_block_tables is not None and self.decode_mask is None and self.decode_mask_read:
            width = self.decode_block_tables.shape[1] * self.block_size
            self.decode_mask = decode_context_mask(self.decode_context_lens, width, self.dtype, self.window)
        for chunk in self.prefills:
            if self.window is not None:
                chunk.key_start = max(0, chunk.num_computed - self.window + 1) // self.block_size * self.block_size
                if chunk.context_len > self.window and chunk.mask is None:
                    chunk.mask = _prefix_causal_mask(chunk, self.window)
            if chunk.num_computed and chunk.mask is None:
                chunk.mask = _prefix_causal_mask(chunk)


def decode_context_mask(
    context_lens: torch.Tensor, max_len: int, dtype: torch.dtype, window: int | None = None
) -> torch.Tensor:
    """Additive mask [B, 1, 1, max_len]: 0 inside each context (its last `window` positions under a
    sliding window), -inf elsewhere. A float mask, not a boolean one: SDPA would convert a boolean mask
    again in every layer."""
    span = torch.arange(max_len, device=context_lens.device)[None, :]
    outside = span >= context_lens[:, None]
    if window is not None:
        outside |= span < context_lens[:, None] - window
    outside = outside[:, None, None, :]
    return torch.zeros(outside.shape, dtype=dtype, device=context_lens.device).masked_fill_(outside, float("-inf"))


def _prefix_causal_mask(chunk: PrefillChunk, window: int | None = None) -> torch.Tensor:
    """[new, context - key_start] bool: the keys each query of the chunk sees, from `key_start` on."""
    device = chunk.block_table.device
    key_pos = torch.arange(chunk.key_start, chunk.context_len, device=device)[None, :]
    query_pos = torch.arange(chunk.num_computed, chunk.context_len, device=device)[:, None]
    visible = key_pos <= query_pos
    return visible if window is None else visible & (key_pos > query_pos - window)


def untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros whose memory the OS supplies page by page on first write (an anonymous mapping, one per
    tensor: no two pools share a storage), where torch.zeros writes every page at once. A KV pool's
    resident memory then follows the blocks in use, not the pool's size (the default 512 MiB pool
    counted in full in `ps` from start-up). CUDA: torch.zeros."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


class KVCache:
    """Per-layer K and V pools shaped [num_blocks, block_size, num_kv_heads, head_dim], allocated once
    (int8 / fp8: head_dim + 2, each head row's scale at its end: kv_quant.py).
    `scratch_block`: one more block past the others, never handed out, where a decode graph's padding
    rows write (model/cuda_graphs.py); its id is `scratch_block` (None without one)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        scratch_block: bool = False,
    ):
        shape = (num_blocks + int(scratch_block), block_size, num_kv_heads, row_width(head_dim, dtype))
        if dtype == torch.float8_e4m3fn:
            progress("fp8_e4m3 KV cache: decode attention gathers and dequantizes the pool in torch (no native kernel)")
        self.k = [untouched_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [untouched_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch_block = num_blocks if scratch_block else None

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * row_width(head_dim, dtype) * dtype.itemsize

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks src -> dst in every layer (a quantized pool's scales with them)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.k[0].device)
        dst = torch.tensor([d for _, d in pairs], device=self.k[0].device)
        for pool in (*self.k, *self.v):
            pool[dst] = pool[src]


def write_kv(
    k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    for pool, rows in ((k_pool, k), (v_pool, v)):
        if is_quantized(pool.dtype):  # as bytes: torch's index_copy_ has no fp8 kernel
            pool, rows = pool.view(torch.uint8), quantize(rows, pool.dtype).view(torch.uint8)
        pool.view(-1, *pool.shape[2:]).index_copy_(0, slot_mapping, rows.to(pool.dtype))


def gather_blocks(pool: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[..., n_blocks] block ids -> [..., n_blocks * block_size, kv_heads, head_dim] contiguous K or V.

    index_select on the flattened table copies whole blocks as rows: ~5x faster on CPU than
    advanced indexing (`pool[block_table]`) for a batch of 8 tables."""
    blocks = pool.index_select(0, block_table.flatten())  # [tables * n_blocks, block_size, kv_heads, D]
    return blocks.unflatten(0, block_table.shape).flatten(-4, -3)


def gather_kv(pool: torch.Tensor, block_table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`gather_blocks` widened to `dtype` activations (a quantized pool's rows dequantized)."""
    return widen(gather_blocks(pool, block_table), dtype)


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q: [B, heads, head_dim], one query per sequence -> [B, heads, head_dim]. `context_lens` [B]
    (the new token included) bound what the native and Triton kernels read, `window` where they start;
    `mask` [B, 1, 1, L] is the same bound as an additive mask (-inf outside each context) for the
    portable path (None where a kernel reads the pool: `reads_pool_directly`). A quantized pool holds
    rotated rows (kv_quant.py): a kernel reading it takes rotated queries and gives the rotated output."""
    if not reads_pool_directly(k_pool, q.shape[0], q.dtype, window):
        return gathered_decode_attention(q, k_pool, v_pool, block_tables, mask, scale)
    if is_quantized(k_pool.dtype):
        out = kernel_decode_attention(rotate(q), k_pool, v_pool, block_tables, context_lens, scale, window)
        return rotate(out).to(q.dtype)
    return kernel_decode_attention(q, k_pool, v_pool, block_tables, context_lens, scale, window)


def kernel_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """The native kernel on a CPU, else the Triton kernel (where `reads_pool_directly`; no window)."""
    if reads_pool_natively(k_pool):
        if window is not None:  # each sequence read from its window's first block
            out = torch.ops.minivllm_native.paged_decode_attention_window(
                q.float(), k_pool, v_pool, block_tables, context_lens, scale, window
            )
            return out.to(q.dtype)
        out = torch.ops.minivllm_native.paged_decode_attention(  # q: a strided view, read as it is
            q.float(), k_pool, v_pool, block_tables, context_lens, scale
        )
        return out.to(q.dtype)
    return torch.ops.minivllm_triton.paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, scale)


def reads_pool_directly(k_pool: torch.Tensor, rows: int, dtype: torch.dtype, window: int | None = None) -> bool:
    """Whether a kernel reads this pool through the block tables, bounded by the context lengths, for
    `rows` decoding sequences of `dtype` activations: then their step needs no decode mask
    (`AttentionMetadata.decode_mask_read`). The Triton kernel takes no sliding window."""
    return reads_pool_natively(k_pool) or (window is None and triton_serves(k_pool, rows, dtype))


def triton_serves(k_pool: torch.Tensor, rows: int, dtype: torch.dtype) -> bool:
    """Whether the Triton kernel serves decode attention here: fp32 activations (its CUDA-core products;
    SDPA has no tensor-core path for them), half-precision ones over a pool of their own dtype (its
    tensor-core products), or a lone sequence. H200, kernel alone inside CUDA graphs
    (scripts/gpu_attention_sweep.py): 9/3 heads fp32, 2-25x faster than gather + SDPA at 1-32 sequences
    of 128-2,000 tokens; 32/4 heads bf16 with tensor-core products 0.15-0.51x SDPA's time at 1-32
    sequences (with CUDA-core products 0.41-3.8x: slower from 8 sequences, where SDPA's bf16 kernels
    use tensor cores). A batch of half-precision activations over a pool of another dtype keeps SDPA."""
    return (dtype == torch.float32 or rows == 1 or tensor_core_dtypes(dtype, k_pool.dtype)) and reads_pool_with_triton(
        k_pool
    )


def tensor_core_dtypes(dtype: torch.dtype, pool_dtype: torch.dtype) -> bool:
    """bf16 / fp16 activations over a pool of the same dtype: where the Triton kernel takes its products on
    the tensor cores (`triton_attention.uses_tensor_cores`, the same rule; that module imports triton)."""
    return dtype == pool_dtype and dtype in (torch.bfloat16, torch.float16)


def reads_pool_natively(k_pool: torch.Tensor) -> bool:
    """Whether the native paged kernel serves decode attention over this pool: on a CPU, of a dtype it
    reads, a head size it vectorizes, and the native kernels built (without a compiler they are not:
    the portable path runs)."""
    return (
        k_pool.device.type == "cpu"
        and head_dim_of(k_pool) % 8 == 0
        and k_pool.dtype in POOL_KERNEL_DTYPES
        and native_decode_ready()
    )


USE_NATIVE_DECODE = True  # tests turn it off to cover the portable path
# MINIVLLM_TRITON_ATTENTION=0 (or this switch, read at each step and at each graph's capture) turns the
# Triton kernel off: `bench compile --device cuda` compares it with the portable path side by side
USE_TRITON_DECODE = env_flag("MINIVLLM_TRITON_ATTENTION", default=True)


def native_decode_ready() -> bool:
    """Marked a constant for dynamo (decided before any graph: it must not trace a build) where the
    compiled step is set up (model/compiled.py), so that importing this module imports no compiler."""
    return USE_NATIVE_DECODE and native.available() is None


def reads_pool_with_triton(k_pool: torch.Tensor) -> bool:
    """Whether the Triton kernel serves decode attention over this pool: on CUDA, of a dtype it reads,
    a head size up to 256 (padded to a power of two inside), and triton importable. The device is
    checked first: nothing on a CPU imports triton (CPU-only installs have none)."""
    return (
        k_pool.device.type == "cuda"
        and k_pool.dtype in POOL_KERNEL_DTYPES
        and head_dim_of(k_pool) <= 256
        and k_pool.stride(-1) == 1
        and triton_decode_ready()
    )


_triton_missing: list[str | None] = []  # once known: None where the kernel passed its self-check, else why not


def triton_decode_ready() -> bool:
    """The switch, and the kernel importable (its module registers the operator) and checked on this
    GPU once (`triton_attention.self_check`): the runner's warm-up asks first, before any graph or
    compile. Marked a constant for dynamo like `native_decode_ready`."""
    if not USE_TRITON_DECODE:
        return False
    if not _triton_missing:
        try:
            from minivllm.kernels.triton import attention as triton_attention  # registers torch.ops.minivllm_triton

            triton_attention.self_check()
            _triton_missing.append(None)
        except Exception as exc:  # noqa: BLE001 - no triton, an older one, no compiler: the portable path serves
            _triton_missing.append(f"{type(exc).__name__}: {str(exc).strip()[:300]}")
            progress(
                f"WARNING: Triton decode attention unavailable ({_triton_missing[0]}); "
                "the gather + SDPA path serves decode attention"
            )
    return _triton_missing[0] is None


def gathered_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The portable decode attention: every sequence's K/V gathered into contiguous copies, then one
    fused SDPA call for the whole batch (measured 2.5-3.5x faster on CPU than matmul, mask, softmax,
    matmul at 8-32 sequences). Query heads are grouped per KV head ([B, kv_heads, group, D]) so GQA
    needs no K/V repeat; the gathered K/V are read through transposed views, not copied."""
    batch, heads, dim = q.shape
    keys = gather_kv(k_pool, block_tables, q.dtype)  # [B, L, kv, D]
    values = gather_kv(v_pool, block_tables, q.dtype)
    kv_heads = keys.shape[2]
    qg = q.unflatten(1, (kv_heads, heads // kv_heads))
    attend = attention_by_sums if torch.compiler.is_compiling() else F.scaled_dot_product_attention
    out = attend(qg, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale)
    return out.reshape(batch, heads, dim)


def attention_by_sums(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA for a few queries per KV head, as broadcast products and sums: inductor fuses it (with the
    block gather) into a few loops, where SDPA stays an opaque call (measured in a compiled graph,
    GQA 9/3 heads: 46 vs 135 us at 1 sequence, 0.63 vs 2.0 ms at 32 sequences of 256 tokens).
    Eagerly each product would be a tensor of its own: SDPA is faster there."""
    torch._check(attn_mask.shape[0] == q.shape[0])  # for the compiler: one row count, not a broadcast
    scores = (q.unsqueeze(3) * k.unsqueeze(2)).sum(-1) * scale + attn_mask  # [B, kv, group, L]
    return (scores.softmax(-1).unsqueeze(-1) * v.unsqueeze(2)).sum(-2)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunk: PrefillChunk,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q/k/v: this chunk's new tokens [n, heads|kv_heads, D]. Attends causally to the cached
    prefix (read through the block table) plus the chunk itself."""
    n = q.shape[0]
    if chunk.num_computed == 0:
        keys, values, mask, causal = k, v, chunk.mask, chunk.mask is None
    else:
        keys, values = chunk_context(k_pool, v_pool, chunk, q.dtype)
        mask, causal = chunk.mask, False
    # [1, heads, n, D]: with a batch dimension torch runs its CPU flash kernel; 3-D inputs fell back to
    # the math path, which builds the whole score matrix (3.5-5.5x slower: 2,000 tokens, 203 vs 37 ms a layer)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )[0]
    return out.transpose(0, 1).reshape(n, -1)


def chunk_context(
    k_pool: torch.Tensor, v_pool: torch.Tensor, chunk: PrefillChunk, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's keys and values from the pool: positions [key_start, context_len)."""
    table = chunk.block_table[chunk.key_start // k_pool.shape[1] :]
    span = chunk.context_len - chunk.key_start
    return gather_kv(k_pool, table, dtype)[:span], gather_kv(v_pool, table, dtype)[:span]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [T, heads, D], k/v: [T, kv_heads, D] for all tokens of the step -> [T, heads * D]. `softcap`:
    scores become softcap * tanh(score / softcap) before the softmax (Gemma 2), on the portable path."""
    write_kv(k_pool, v_pool, k, v, meta.slot_mapping)
    if softcap is not None:
        return softcapped_attention(q, k, v, k_pool, v_pool, meta, scale, softcap)
    if not meta.prefills:  # every row is one sequence's single token: no slicing by a row count
        out = decode_attention(
            q, k_pool, v_pool, meta.decode_block_tables, meta.decode_context_lens, meta.decode_mask, scale, meta.window
        )
        return out.reshape(q.shape[0], -1)
    parts = []
    nd = meta.num_decode_tokens
    if nd:
        out = decode_attention(
            q[:nd],
            k_pool,
            v_pool,
            meta.decode_block_tables,
            meta.decode_context_lens,
            meta.decode_mask,
            scale,
            meta.window,
        )
        parts.append(out.reshape(nd, -1))
    for chunk in meta.prefills:
        s, e = chunk.start, chunk.end
        parts.append(prefill_attention(q[s:e], k[s:e], v[s:e], chunk, k_pool, v_pool, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def softcapped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Attention with soft-capped scores, which neither SDPA nor our kernels take: scores, cap, mask and
    softmax written out, over each decode row's gathered context and each prefill chunk's."""
    parts = []
    nd = meta.num_decode_tokens
    if nd:
        keys = gather_kv(k_pool, meta.decode_block_tables, q.dtype)  # [B, L, kv, D]
        values = gather_kv(v_pool, meta.decode_block_tables, q.dtype)
        span = torch.arange(keys.shape[1], device=q.device)
        visible = span[None, :] < meta.decode_context_lens[:, None]  # [B, L]
        if meta.window is not None:
            visible &= span[None, :] >= meta.decode_context_lens[:, None] - meta.window
        out = capped_scores_attention(q[:nd, None], keys, values, visible[:, None, :], scale, softcap)
        parts.append(out.reshape(nd, -1))
    for chunk in meta.prefills:
        s, e = chunk.start, chunk.end
        if chunk.num_computed == 0:
            keys, values = k[s:e], v[s:e]
        else:
            keys, values = chunk_context(k_pool, v_pool, chunk, q.dtype)
        visible = _prefix_causal_mask(chunk, meta.window)  # [n, L], causal over prefix + chunk
        out = capped_scores_attention(q[None, s:e], keys[None], values[None], visible[None], scale, softcap)
        parts.append(out.reshape(e - s, -1))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def capped_scores_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """q [B, n, heads, D], k/v [B, L, kv_heads, D], visible [B, n, L] -> [B, n, heads, D]: HF's eager
    Gemma 2 attention (scores * scale, capped, masked, softmax in fp32)."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2).transpose(1, 2)  # [B, heads, L, D]
    v = v.repeat_interleave(group, dim=2).transpose(1, 2)
    scores = torch.matmul(q.transpose(1, 2), k.transpose(2, 3)) * scale  # [B, heads, n, L]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    weights = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v).transpose(1, 2)
