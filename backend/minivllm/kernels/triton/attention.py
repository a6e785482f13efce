"""Paged decode attention on CUDA as a Triton kernel: K/V read straight from the pool through the block
tables, bounded by each sequence's context length.

Why: the portable path (`attention.gathered_decode_attention`) copies every sequence's blocks into
contiguous K/V over the padded table width, builds an additive mask and calls SDPA: ~30 small kernels a
layer inside a CUDA graph, and a graphed decode step at ~20x its weight-read floor on an H200. This
kernel reads each K/V row once per query group, only up to the context length, with no copy and no mask.

How: one program per (sequence, KV head, partition of the context). The program holds its KV head's
whole group of query heads (GQA; MHA and MQA are groups of 1 and of all heads) and runs an online
softmax in fp32 over its tokens, a tile at a time. A lone sequence has only `kv_heads` programs per
partition, so long contexts are split into partitions (flash-decoding) that a small kernel merges; the
partition count is a function of shapes only (batch, KV heads, table width), never of tensor values, so
a CUDA graph can hold the call.

Two ways to take a tile's products (the DOT switch): on the CUDA cores, broadcast multiply and sum in fp32
(fp32 activations, bit-for-bit the kernel as first measured), or on the tensor cores with `tl.dot` for
bf16 / fp16 queries and pools (what SDPA's half-precision kernels do, and why they beat the CUDA-core
products from 8 sequences). Either way the online softmax and the accumulators stay fp32; the dot path
rounds the softmax weights to the pool's dtype for the weighted sum, as flash attention does. `tl.dot`
wants every dimension >= 16: the query group is padded to 16 rows (masked like the power-of-two padding),
tiles hold >= 16 tokens, head dims pad to a power of two >= 16. Which batches reach the kernel at all is
`attention.triton_serves`.

An int8 pool (`--kv-cache-dtype int8`, model/kv_quant.py) holds each head row's head_dim values and then
its fp16 scale: the CUDA-core path multiplies each K and V row by its scale as it widens them (the dot path
is never taken: its operands share the query's dtype). The rows are stored rotated; the caller rotates the
queries and the output (attention.decode_attention). Not yet run under Triton's interpreter or on a GPU (no
triton where it was written): `self_check` covers an int8 pool, so a kernel that fails there leaves the
portable path serving.

Only imported on the CUDA path (and by the tests, which also run it under Triton's interpreter on a CPU):
CPU-only installs have no triton.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minivllm.arith import ceil_div

# Products (query heads x tokens x head dims) of one tile's scores: at 8192 each of 4 warps' 128 threads
# holds 64 fp32 values, a budget that leaves registers for the rest; larger tiles get 8 warps. Estimated,
# not yet measured on a GPU.
TILE_ELEMENTS = 8192
# A context is split until batch x KV heads x partitions reaches PROGRAMS_PER_SM programs per SM, in
# partitions no shorter than MIN_PARTITION_TOKENS: each program walks its tokens one dependent tile at a
# time, so short partitions and several programs per SM hide the loads' latency. H200, kernel alone inside
# CUDA graphs (scripts/gpu_attention_sweep.py, 18 shapes): 32 tokens and 8 per SM had the smallest
# geometric mean; against 256 and 1 (the first guess), 2.7x faster at one sequence of 128 tokens (9/3
# heads: 18.3 -> 6.9 us), 2.3x at 32 of 2,000 (291.8 -> 127.0 us).
MIN_PARTITION_TOKENS = 32
PROGRAMS_PER_SM = 8
# The tensor-core (dot) path's tile and warps. H200, TinyLlama 32/4 bf16 (head dim 64), 1-32 sequences of
# 128-2,000 tokens, split 32 / 8 (scripts/gpu_attention_sweep.py --dot-tiles, one run): 128 tokens and 4 warps
# had the smallest geometric mean of time / SDPA's, 0.29 (64 / 4: 0.33, the first guess; 32 / 8: 0.38). Only
# head dim 64 was measured: wider heads keep the guessed tiles (64 tokens up to 128 dims, 32 for 256), whose
# K and V tiles then hold as many elements as 128 tokens of 64.
DOT_TILE_TOKENS = 128
DOT_NUM_WARPS = 4
DOT_MIN_ROWS = 16  # tl.dot's smallest M, N and K
# Half-precision queries over a pool of the same dtype take the dot path unless this is off (or a call
# forces a path): the one switch back to the CUDA-core products for every dtype (a benchmark's A/B; half
# batches still reach the kernel then, slower than SDPA from 8 sequences)
HALF_PRECISION_DOT = True
CPU_PROGRAMS = 8  # under the interpreter: what "fill the machine" means (tests force splits anyway)


# Sizes that change with the bucket are not specialized on (divisible by 16, equal to 1): one compile
# serves every width, rather than a compile in the middle of serving at a new one
@triton.jit(do_not_specialize=["t_s0", "width_tokens", "part_tokens", "num_parts"])
def _partition_kernel(
    q,
    k_pool,
    v_pool,
    tables,
    lens,
    out,
    part_max,
    part_sum,
    scale,
    q_s0,
    q_s1,
    k_s0,
    k_s1,
    k_s2,
    v_s0,
    v_s1,
    v_s2,
    t_s0,
    lens_s0,
    width_tokens,
    part_tokens,
    num_parts,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    DIM: tl.constexpr,
    DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT: tl.constexpr,
    SCALED: tl.constexpr,
):
    """One (sequence, KV head, partition): its query group's attention over the partition's tokens.
    SPLIT: writes the unnormalized sums, max and denominator per head for the merge; else the output.
    DOT: the products on the tensor cores (q, K, V and the weights in the pool's dtype, sums in fp32);
    else on the CUDA cores in fp32. SCALED: int8 rows, each followed by its fp16 scale (at element DIM)."""
    seq, kv_head, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    heads = kv_head * GROUP + tl.arange(0, GROUP_P)  # the query heads of this KV head (padded to 2^n)
    head_ok = tl.arange(0, GROUP_P) < GROUP
    dims = tl.arange(0, DIM_P)
    dim_ok = dims < DIM
    qv = tl.load(
        q + seq * q_s0 + heads[:, None] * q_s1 + dims[None, :], mask=head_ok[:, None] & dim_ok[None, :], other=0.0
    )
    if DOT:
        qv = qv.to(k_pool.dtype.element_ty)  # a no-op for half q over its own pool; forced paths may mix
    else:
        qv = qv.to(tl.float32) * scale
    # never past the table's width: a longer context than the table holds reads what the mask path would
    context = tl.minimum(tl.load(lens + seq * lens_s0).to(tl.int32), width_tokens)
    start = part * part_tokens
    end = tl.minimum(start + part_tokens, context)
    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, DIM_P], tl.float32)
    # every tile starts below `end`, so each has a real token and m_i turns finite at the first one
    for base in range(start, end, TILE):
        pos = base + tl.arange(0, TILE)
        live = pos < end
        # table columns past the context are never loaded: they may hold any id (graph padding: scratch)
        block = tl.load(tables + seq * t_s0 + pos // BLOCK_SIZE, mask=live, other=0)
        slot = pos % BLOCK_SIZE
        tile_ok = live[:, None] & dim_ok[None, :]
        k_rows = k_pool + block * k_s0 + slot * k_s1 + kv_head * k_s2  # [TILE] each token's head row
        k = tl.load(k_rows[:, None] + dims[None, :], mask=tile_ok, other=0.0)
        if SCALED:
            k_scale = tl.load((k_rows + DIM).to(tl.pointer_type(tl.float16)), mask=live, other=0.0)
            k = k.to(tl.float32) * k_scale.to(tl.float32)[:, None]
        if DOT:
            scores = tl.dot(qv, tl.trans(k)) * scale  # fp32 [GROUP_P, TILE]; the scale after, not rounded in q
        else:
            scores = tl.sum(qv[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [GROUP_P, TILE]
        scores = tl.where(live[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # masked V rows load as 0 (not the pool's bytes: NaN there would survive 0 * NaN)
        v_rows = v_pool + block * v_s0 + slot * v_s1 + kv_head * v_s2
        v = tl.load(v_rows[:, None] + dims[None, :], mask=tile_ok, other=0.0)
        if SCALED:
            v_scale = tl.load((v_rows + DIM).to(tl.pointer_type(tl.float16)), mask=live, other=0.0)
            v = v.to(tl.float32) * v_scale.to(tl.float32)[:, None]
        if DOT:
            acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None])  # dead tokens: weight 0 times V's 0
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        m_i = m_new
    store_ok = head_ok[:, None] & dim_ok[None, :]
    if SPLIT:
        row = (seq * (tl.num_programs(1) * GROUP) + heads) * num_parts + part  # [B, heads, parts] rows
        tl.store(out + row[:, None] * DIM + dims[None, :], acc, mask=store_ok)
        tl.store(part_max + row, m_i, mask=head_ok)
        tl.store(part_sum + row, l_i, mask=head_ok)
    else:
        row = seq * (tl.num_programs(1) * GROUP) + heads
        tl.store(out + row[:, None] * DIM + dims[None, :], (acc / l_i[:, None]).to(out.dtype.element_ty), mask=store_ok)


@triton.jit(do_not_specialize=["num_parts"])
def _merge_kernel(
    parts, part_max, part_sum, out, num_parts, DIM: tl.constexpr, DIM_P: tl.constexpr, PARTS_P: tl.constexpr
):
    """One (sequence, query head): its partitions' sums rescaled to the largest max, added, normalized.
    An empty partition (past the context) has max -inf and sum 0: weight exp(-inf) = 0. Partition 0
    always holds the first token, so the largest max is finite."""
    row = tl.program_id(0)
    p = tl.arange(0, PARTS_P)
    p_ok = p < num_parts
    dims = tl.arange(0, DIM_P)
    dim_ok = dims < DIM
    m = tl.load(part_max + row * num_parts + p, mask=p_ok, other=float("-inf"))
    s = tl.load(part_sum + row * num_parts + p, mask=p_ok, other=0.0)
    w = tl.exp(m - tl.max(m, axis=0))
    acc = tl.load(
        parts + (row * num_parts + p)[:, None] * DIM + dims[None, :], mask=p_ok[:, None] & dim_ok[None, :], other=0.0
    )
    merged = tl.sum(acc * w[:, None], axis=0) / tl.sum(s * w, axis=0)
    tl.store(out + row * DIM + dims, merged.to(out.dtype.element_ty), mask=dim_ok)


def tile_tokens(group_p: int, dim_p: int) -> int:
    """Tokens a tile: as many as TILE_ELEMENTS allow, 16 to 64 (a power of two for tl.arange)."""
    return max(16, min(64, TILE_ELEMENTS // (group_p * dim_p)))


def uses_tensor_cores(q_dtype: torch.dtype, pool_dtype: torch.dtype) -> bool:
    """The dot path's rule: bf16 / fp16 queries over a pool of the same dtype (tl.dot's operands share one
    dtype), unless switched off; fp32 keeps the CUDA-core products. `attention.tensor_core_dtypes` routes
    batches by the same rule without importing triton (a test holds the two equal)."""
    return HALF_PRECISION_DOT and q_dtype == pool_dtype and q_dtype in (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Launch:
    """The padded sizes, tile and warps of one path for one shape."""

    group_p: int
    dim_p: int
    tile: int
    num_warps: int


def launch_shape(group: int, dim: int, dot: bool) -> Launch:
    """Powers of two for tl.arange; on the dot path also >= 16 in every dimension of tl.dot."""
    if dot:
        dim_p = max(DOT_MIN_ROWS, triton.next_power_of_2(dim))
        tile = max(DOT_MIN_ROWS, DOT_TILE_TOKENS * 64 // max(64, dim_p))  # 64 dims' tile elements at most
        return Launch(max(DOT_MIN_ROWS, triton.next_power_of_2(group)), dim_p, tile, DOT_NUM_WARPS)
    group_p, dim_p = triton.next_power_of_2(group), triton.next_power_of_2(dim)
    tile = tile_tokens(group_p, dim_p)
    return Launch(group_p, dim_p, tile, 4 if group_p * tile * dim_p <= TILE_ELEMENTS else 8)


def _programs_wanted(device: torch.device) -> int:
    return CPU_PROGRAMS if device.type != "cuda" else _sm_count(device) * PROGRAMS_PER_SM


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def partition_size(batch: int, kv_heads: int, width_tokens: int, tile: int, device: torch.device) -> int:
    """Tokens per partition (a multiple of the tile): the whole width where batch x KV heads programs
    already fill the SMs, else split until they do, partitions no shorter than MIN_PARTITION_TOKENS."""
    parts = max(1, min(_programs_wanted(device) // (batch * kv_heads), width_tokens // MIN_PARTITION_TOKENS))
    return ceil_div(ceil_div(width_tokens, parts), tile) * tile


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    partition_tokens: int = 0,
    tensor_cores: bool | None = None,
) -> torch.Tensor:
    """q [B, heads, D] (any strides with a unit last one), pools [blocks, block_size, kv_heads, D]
    (last dim contiguous; int8: D + 2, each row's fp16 scale last), block_tables [B, W], context_lens [B]
    (>= 1, the new token included)
    -> [B, heads, D] in q's dtype. `partition_tokens`: 0 picks the split from the shapes (tests force one).
    `tensor_cores`: None picks the path from the dtypes (`uses_tensor_cores`); True / False force the dot
    or the CUDA-core path for the same inputs (benchmarks, tests)."""
    q, block_tables = _unit_last_stride(q), _unit_last_stride(block_tables)  # views as they come: no copy
    batch, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_pool.shape
    scaled = k_pool.dtype == torch.int8
    dot = uses_tensor_cores(q.dtype, k_pool.dtype) if tensor_cores is None else tensor_cores and not scaled
    shape = launch_shape(heads // kv_heads, dim, dot)
    width = block_tables.shape[1] * block_size
    part = partition_tokens or partition_size(batch, kv_heads, width, shape.tile, q.device)
    parts = ceil_div(width, part)
    out = torch.empty((batch, heads, dim), dtype=q.dtype, device=q.device)
    if parts > 1:
        partial = torch.empty((batch, heads, parts, dim), dtype=torch.float32, device=q.device)
        stats = torch.empty((2, batch, heads, parts), dtype=torch.float32, device=q.device)
        target, part_max, part_sum = partial, stats[0], stats[1]
    else:
        target = part_max = part_sum = out  # the max/sum pointers are unused without a split
    _partition_kernel[(batch, kv_heads, parts)](
        q,
        k_pool,
        v_pool,
        block_tables,
        context_lens,
        target,
        part_max,
        part_sum,
        scale,
        q.stride(0),
        q.stride(1),
        *k_pool.stride()[:3],
        *v_pool.stride()[:3],
        block_tables.stride(0),
        context_lens.stride(0),
        width,
        part,
        parts,
        GROUP=heads // kv_heads,
        GROUP_P=shape.group_p,
        DIM=dim,
        DIM_P=shape.dim_p,
        BLOCK_SIZE=block_size,
        TILE=shape.tile,
        SPLIT=parts > 1,
        DOT=dot,
        SCALED=scaled,
        num_warps=shape.num_warps,
    )
    if parts > 1:
        _merge_kernel[(batch * heads,)](
            partial, part_max, part_sum, out, parts, DIM=dim, DIM_P=shape.dim_p, PARTS_P=triton.next_power_of_2(parts)
        )
    return out


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("minivllm_triton::paged_decode_attention", mutates_args=())
def paged_decode_attention_op(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The kernel as an operator: torch.compile (MINIVLLM_CUDA_COMPILE=1) keeps it one opaque call
    instead of tracing the launch's host arithmetic over dynamic sizes."""
    return paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, scale)


@paged_decode_attention_op.register_fake
def _(q, k_pool, v_pool, block_tables, context_lens, scale):
    return q.new_empty(q.shape)


def self_check(device: torch.device | str = "cuda") -> None:
    """Raises unless the kernel compiles and computes plain attention on this device, split and unsplit,
    on both paths: fp32 on the CUDA cores, bf16 and fp16 on the tensor cores. Run once before the first
    step uses it (an older Triton's compile error or a wrong result then leaves the portable path serving,
    rather than failing a step or a graph capture)."""
    gen = torch.Generator().manual_seed(0)
    k_pool, v_pool = (torch.randn(3, 16, 1, 64, generator=gen) for _ in range(2))
    q = torch.randn(1, 2, 64, generator=gen)
    table = torch.tensor([[2, 0, 1]])
    for dtype, atol in _self_check_dtypes(torch.device(device)):
        _check_one(q.to(device, dtype), k_pool.to(device, dtype), v_pool.to(device, dtype), table.to(device), atol)
    (k8, k_wide), (v8, v_wide) = _int8_pool(k_pool), _int8_pool(v_pool)  # fp32 queries over an int8 pool
    _check_one(q.to(device), k8.to(device), v8.to(device), table.to(device), 1e-4, (k_wide, v_wide))


def _int8_pool(pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 pool as int8 rows with their fp16 scales (model/kv_quant.py's layout), and those rows widened."""
    scale = (pool.abs().amax(-1, keepdim=True) / 127).to(torch.float16)
    values = (pool / scale.float()).round().clamp(-127, 127).to(torch.int8)
    return torch.cat([values, scale.view(torch.int8)], -1), values.float() * scale.float()


def _self_check_dtypes(device: torch.device) -> list[tuple[torch.dtype, float]]:
    """(dtype, atol): fp32 to 1e-4; half precision to a few of its steps of an output near 1 (the weights
    are rounded to it). Not bf16 off CUDA: Triton's interpreter multiplies bf16 tl.dot operands as their raw
    16-bit patterns (runtime/interpreter.py `create_dot` converts only 8-bit floats), a wrong result there
    that says nothing of the GPU's."""
    dtypes = [(torch.float32, 1e-4), (torch.float16, 4e-3)]
    return dtypes + [(torch.bfloat16, 3e-2)] if device.type == "cuda" else dtypes


def _check_one(q, k_pool, v_pool, table, atol: float, wide_pools=None) -> None:
    """`wide_pools`: the pools' values as fp32 where they are quantized."""
    wide = wide_pools or (k_pool, v_pool)
    keys, values = (pool.to(q.device)[table[0]].flatten(0, 1)[:40, 0].double() for pool in wide)
    expected = torch.softmax(q[0].double() @ keys.T * 0.125, -1) @ values
    lens = torch.tensor([40], device=q.device)
    for partition in (0, 16):
        got = paged_decode_attention(q, k_pool, v_pool, table, lens, 0.125, partition)[0].double()
        if not torch.allclose(got, expected, atol=atol, rtol=0):
            raise RuntimeError(
                f"wrong result ({q.dtype}, partition {partition}): max abs diff "
                f"{(got - expected).abs().max().item():.2e}"
            )
