"""Paged attention equals contiguous attention.

Two levels:

* the attention op (`minivllm.model.attention.paged_attention`) against plain causal SDPA over the
  whole sequence, computed in float64 with K/V repeated per query group (no paging, no GQA
  tricks). The KV pool is filled with large random garbage and block tables are shuffled, so
  reading a wrong slot, a wrong block or past the context shows up as a large error;
* the whole model through `ModelRunner` (tiny random Llama saved by the test and loaded through
  our loader) against `transformers.LlamaForCausalLM` run on each full sequence alone: a batch
  mixing decodes, a prefill from scratch and a chunked prefill on top of a cached prefix must give
  the logits HF gives at the same positions.
"""

from __future__ import annotations

import random
import sys

import pytest
import torch
import torch.nn.functional as F

from minivllm.kernels.cpu import native
from minivllm.model import attention
from minivllm.model.attention import AttentionMetadata, PrefillChunk, paged_attention

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 16
SCALE = HEAD_DIM**-0.5
ATOL = 1e-5


@pytest.fixture(params=["native", "portable"])
def decode_path(request, monkeypatch):
    """Decode attention's two implementations: the native kernel reading the pool through the block
    tables (wherever the native kernels build: CI's machines do), and the portable gather + SDPA."""
    if request.param == "native" and native.available() is not None:
        pytest.skip(f"native kernels unavailable here: {native.available()}")
    monkeypatch.setattr(attention, "USE_NATIVE_DECODE", request.param == "native")
    return request.param


# ---- the attention op ------------------------------------------------------------------------------


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over a whole sequence: q [L, H, D], k/v [L, KV, D] -> [L, H * D] (float64)."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = (t.double().transpose(0, 1) for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
    out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=SCALE)
    return out.transpose(0, 1).reshape(q.shape[0], -1)


class Pool:
    """A KV pool full of garbage with a shuffled allocator (block ids come out non-contiguous)."""

    def __init__(self, num_blocks: int, block_size: int, seed: int, dtype: torch.dtype = torch.float32):
        gen = torch.Generator().manual_seed(seed)
        shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
        self.k = (torch.randn(shape, generator=gen) * 100).to(dtype)
        self.v = (torch.randn(shape, generator=gen) * 100).to(dtype)
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def table(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // self.block_size)
        out, self.free = self.free[:n], self.free[n:]
        assert len(out) == n, "test pool too small"
        return out

    def slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]


def random_seq(length: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(length, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(length, KV_HEADS, HEAD_DIM, generator=gen)
    return q, k, v


class Seq:
    def __init__(self, pool: Pool, length: int, seed: int):
        self.q, self.k, self.v = random_seq(length, seed)
        self.length = length
        self.table = pool.table(length)
        self.expected = reference_attention(self.q, self.k, self.v)


def run_step(pool: Pool, decodes: list[Seq], prefills: list[tuple[Seq, int, int]]) -> list[torch.Tensor]:
    """One flattened step: each decode runs its last token (everything before it must already be
    in the pool); each prefill runs tokens [start, end) with [0, start) already in the pool.
    Returns the output rows of each work item, in order."""
    work = [(s, s.length - 1, s.length) for s in decodes] + list(prefills)
    q = torch.cat([s.q[a:b] for s, a, b in work])
    k = torch.cat([s.k[a:b] for s, a, b in work])
    v = torch.cat([s.v[a:b] for s, a, b in work])
    slots = [x for s, a, b in work for x in pool.slots(s.table, a, b)]
    chunks, row = [], len(decodes)
    for s, a, b in prefills:
        used = -(-b // pool.block_size)
        chunks.append(PrefillChunk(row, row + b - a, a, torch.tensor(s.table[:used])))
        row += b - a
    tables = lens = None
    if decodes:
        width = max(len(s.table) for s in decodes)
        # pad with block 0, which holds another sequence's data or garbage: it must be masked
        tables = torch.tensor([s.table + [0] * (width - len(s.table)) for s in decodes])
        lens = torch.tensor([s.length for s in decodes])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=len(decodes),
        decode_block_tables=tables,
        decode_context_lens=lens,
        prefills=chunks,
        block_size=pool.block_size,
    )
    out = paged_attention(q, k, v, pool.k, pool.v, meta, SCALE)
    assert out.shape == (q.shape[0], HEADS * HEAD_DIM)
    parts, row = [], 0
    for _, a, b in work:
        parts.append(out[row : row + b - a])
        row += b - a
    return parts


def prefill_whole(pool: Pool, seq: Seq, upto: int) -> None:
    """Put tokens [0, upto) of seq into the pool (a prefill from scratch)."""
    if upto:
        run_step(pool, [], [(seq, 0, upto)])


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 33, 70])
def test_prefill_from_scratch(block_size, length):
    pool = Pool(num_blocks=160, block_size=block_size, seed=length)
    seq = Seq(pool, length, seed=length * 7)
    (out,) = run_step(pool, [], [(seq, 0, length)])
    torch.testing.assert_close(out.double(), seq.expected, atol=ATOL, rtol=0)
    # the new K/V landed in the sequence's slots
    slots = torch.tensor(pool.slots(seq.table, 0, length))
    assert torch.equal(pool.k.view(-1, KV_HEADS, HEAD_DIM)[slots], seq.k)
    assert torch.equal(pool.v.view(-1, KV_HEADS, HEAD_DIM)[slots], seq.v)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("splits", [(16, 70), (20, 70), (31, 33, 70), (5, 6, 40, 41, 70), (69, 70)])
def test_chunked_prefill_on_cached_prefix(block_size, splits):
    """The prompt is run as several chunks; each chunk attends to the prefix read back from the pool."""
    pool = Pool(num_blocks=160, block_size=block_size, seed=3)
    seq = Seq(pool, splits[-1], seed=11)
    start, outs = 0, []
    for end in splits:
        (out,) = run_step(pool, [], [(seq, start, end)])
        outs.append(out)
        start = end
    torch.testing.assert_close(torch.cat(outs).double(), seq.expected, atol=ATOL, rtol=0)


def test_prefill_chunks_run_torchs_flash_kernel_not_the_math_path():
    """A chunk from scratch (causal) and one after a cached prefix (masked) both reach torch's CPU flash
    attention: SDPA on 3-D inputs fell back to its math path, which builds the whole score matrix
    (3.5-5.5x slower at 512-2,000 tokens; 44% of a 2,000-token prompt's prefill)."""
    from torch.profiler import profile

    pool = Pool(num_blocks=40, block_size=16, seed=5)
    seq = Seq(pool, 96, seed=12)
    with profile() as prof:
        (first,) = run_step(pool, [], [(seq, 0, 64)])
        (second,) = run_step(pool, [], [(seq, 64, 96)])
    kernels = [e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")]
    assert kernels.count("aten::_scaled_dot_product_flash_attention_for_cpu") == 2, kernels
    assert "aten::_scaled_dot_product_attention_math" not in kernels
    torch.testing.assert_close(torch.cat([first, second]).double(), seq.expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_batched_decode_with_ragged_contexts(block_size, decode_path):
    """Decodes of several sequences in one call: different lengths, tables padded with block 0."""
    pool = Pool(num_blocks=400, block_size=block_size, seed=5)
    seqs = [Seq(pool, n, seed=100 + n) for n in (1, 16, 17, 32, 33, 64, 65)]
    for s in seqs:
        prefill_whole(pool, s, s.length - 1)
    outs = run_step(pool, seqs, [])
    for s, out in zip(seqs, outs):
        torch.testing.assert_close(out.double(), s.expected[-1:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_decode_steps_follow_the_sequence(block_size, decode_path):
    """Token after token: each decode step sees exactly the tokens before it, across block boundaries."""
    pool = Pool(num_blocks=120, block_size=block_size, seed=9)
    full = Seq(pool, 40, seed=21)
    prefill_whole(pool, full, 3)
    for n in range(4, 41):
        view = Seq.__new__(Seq)  # the same sequence cut at n tokens
        view.q, view.k, view.v, view.length, view.table = full.q[:n], full.k[:n], full.v[:n], n, full.table
        (out,) = run_step(pool, [view], [])
        torch.testing.assert_close(out.double(), full.expected[n - 1 : n], atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_mixed_batch_of_decodes_and_prefills(block_size, decode_path):
    """One call holding decodes, a prefill from scratch and chunks on cached prefixes."""
    pool = Pool(num_blocks=300, block_size=block_size, seed=13)
    decodes = [Seq(pool, n, seed=200 + n) for n in (9, 33, 48)]
    fresh = Seq(pool, 37, seed=301)
    chunked = Seq(pool, 50, seed=302)
    tail = Seq(pool, 17, seed=303)  # one token left after a cached prefix (a 1-token "prefill")
    for s in decodes:
        prefill_whole(pool, s, s.length - 1)
    prefill_whole(pool, chunked, 21)
    prefill_whole(pool, tail, 16)
    outs = run_step(pool, decodes, [(fresh, 0, 37), (chunked, 21, 50), (tail, 16, 17)])
    for s, out in zip(decodes, outs[:3]):
        torch.testing.assert_close(out.double(), s.expected[-1:], atol=ATOL, rtol=0)
    torch.testing.assert_close(outs[3].double(), fresh.expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(outs[4].double(), chunked.expected[21:], atol=ATOL, rtol=0)
    torch.testing.assert_close(outs[5].double(), tail.expected[16:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_narrow_pool_rounds_keys_and_values_once(dtype, decode_path):
    """--kv-cache-dtype: K/V are rounded to the pool's dtype when written and widened when read, so a
    decode is exact attention over the rounded K/V (queries and sums stay fp32). A prefill chunk
    attends to its own new K/V before rounding, as vLLM's does."""
    pool = Pool(num_blocks=200, block_size=16, seed=3, dtype=dtype)
    decodes = [Seq(pool, n, seed=400 + n) for n in (5, 40, 71)]
    fresh = Seq(pool, 23, seed=500)
    for s in decodes:
        prefill_whole(pool, s, s.length - 1)
    outs = run_step(pool, decodes, [(fresh, 0, 23)])
    for s, out in zip(decodes, outs):
        rounded = reference_attention(s.q, s.k.to(dtype), s.v.to(dtype))
        torch.testing.assert_close(out.double(), rounded[-1:], atol=ATOL, rtol=0)
        assert not torch.allclose(out.double(), s.expected[-1:], atol=ATOL, rtol=0), "nothing was rounded"
    torch.testing.assert_close(outs[3].double(), fresh.expected, atol=ATOL, rtol=0)
    assert pool.k.dtype == dtype


@pytest.mark.parametrize(
    "heads,kv_heads,dim", [(4, 4, 16), (4, 2, 24), (9, 3, 64), (8, 2, 40), (5, 1, 8), (16, 2, 64), (6, 2, 72)]
)
def test_native_decode_matches_float64_for_every_group_size_and_head_dim(heads, kv_heads, dim):
    """The kernel takes a KV head's query heads up to three at a time, four tokens at a time and 32 dims
    at a time: groups of 1-8 heads, dims that leave 8, 16 or 24 over, contexts that end mid-tile and
    span several parts all give the float64 answer (fp32 and fp16 pools: each against its own rounding)."""
    if native.available() is not None:
        pytest.skip(f"native kernels unavailable here: {native.available()}")
    gen = torch.Generator().manual_seed(heads * 100 + dim)
    block_size, lens = 16, [1, 7, 37, 64, 131, 300]
    width = -(-max(lens) // block_size)
    blocks = torch.randperm(len(lens) * width, generator=gen).view(len(lens), width)
    q = torch.randn(len(lens), heads, dim, generator=gen)
    for dtype in (torch.float32, torch.float16):
        k = torch.randn(len(lens) * width, block_size, kv_heads, dim, generator=gen).to(dtype)
        v = torch.randn(len(lens) * width, block_size, kv_heads, dim, generator=gen).to(dtype)
        out = torch.ops.minivllm_native.paged_decode_attention(q, k, v, blocks, torch.tensor(lens), dim**-0.5)
        for s, n in enumerate(lens):
            ks, vs = (t[blocks[s]].reshape(-1, kv_heads, dim)[:n].double() for t in (k, v))
            group = heads // kv_heads
            scores = torch.einsum("hd,thd->ht", q[s].double(), ks.repeat_interleave(group, 1)) * dim**-0.5
            expected = torch.einsum("ht,thd->hd", scores.softmax(-1), vs.repeat_interleave(group, 1))
            torch.testing.assert_close(
                out[s].double(),
                expected,
                atol=1e-5,
                rtol=1e-5,
                msg=lambda m: f"sequence {s} ({n} tokens, {dtype}): {m}",
            )


def test_native_decode_rejects_a_table_that_points_outside_the_pool():
    """A wrong block table or context length is an error, never a read outside the pool."""
    if native.available() is not None:
        pytest.skip(f"native kernels unavailable here: {native.available()}")
    pool = Pool(num_blocks=4, block_size=16, seed=1)
    q = torch.randn(1, HEADS, HEAD_DIM)
    attend = torch.ops.minivllm_native.paged_decode_attention
    with pytest.raises(RuntimeError, match="block id 9 outside the pool's 4 blocks"):
        attend(q, pool.k, pool.v, torch.tensor([[1, 9]]), torch.tensor([20]), SCALE)
    with pytest.raises(RuntimeError, match="context length 40 outside 1..32"):
        attend(q, pool.k, pool.v, torch.tensor([[1, 2]]), torch.tensor([40]), SCALE)
    # the padded tail of a table is never read: any id may stand there
    out = attend(q, pool.k, pool.v, torch.tensor([[1, 99]]), torch.tensor([16]), SCALE)
    assert torch.isfinite(out).all()


# ---- the whole model through the runner -------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama (GQA, untied) saved in HF format, loaded by our loader; HF is the oracle."""
    from tiny_models import make_tiny_llama

    from minivllm.loader import load_model

    directory = tmp_path_factory.mktemp("tiny-paged")
    hf = make_tiny_llama(directory, seed=5, kv_heads=2, vocab=256, layers=2)
    return hf, load_model(str(directory), dtype="float32", device="cpu")


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


# the KV pool's dtype (--kv-cache-dtype) -> the logits' tolerance against HF in fp32. A narrower pool
# rounds K/V once (fp16 keeps 11 significant bits, bf16 8): measured here, logits of magnitude ~0.5,
# max errors 2e-7 (fp32), 4e-5 (fp16), 3e-4 (bf16)
KV_DTYPE_ATOL = {torch.float32: 1e-4, torch.float16: 1e-4, torch.bfloat16: 1e-3}


@pytest.mark.parametrize(
    "block_size,kv_dtype",
    [(1, torch.float32), (16, torch.float32), (32, torch.float32), (16, torch.float16), (16, torch.bfloat16)],
)
def test_runner_mixed_batch_matches_hf(tiny, block_size, kv_dtype):
    """Several sequences at different stages share each forward pass; every logits row equals HF's
    logits for that sequence alone at that position (within the rounding of a narrower KV pool)."""
    from minivllm.core.step_work import SeqWork
    from minivllm.engine.model_runner import ModelRunner
    from minivllm.model.attention import KVCache

    hf, loaded = tiny
    cfg = loaded.config
    num_blocks = 400 // block_size + 40
    kv = KVCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, kv_dtype)
    runner = ModelRunner(loaded.model, kv)
    gen = torch.Generator().manual_seed(block_size)
    lengths = {"a": 45, "b": 73, "c": 21, "d": 35}
    seqs = {name: torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for name, n in lengths.items()}
    expected = {name: hf_logits(hf, ids) for name, ids in seqs.items()}
    blocks = list(range(num_blocks))
    random.Random(block_size).shuffle(blocks)  # non-contiguous, shuffled tables
    tables = {}
    for name, n in lengths.items():
        need = -(-n // block_size)
        tables[name], blocks = blocks[:need], blocks[need:]
    done = {name: 0 for name in seqs}

    def work(name: str, n: int, logits: bool = True) -> SeqWork:
        start = done[name]
        done[name] += n
        return SeqWork(seqs[name][start : start + n], start, tables[name], num_logits=int(logits))

    def check(name: str, row: torch.Tensor) -> None:
        torch.testing.assert_close(row, expected[name][done[name] - 1], atol=KV_DTYPE_ATOL[kv_dtype], rtol=0)

    # step 1: a prefill from scratch for a (complete) and the first chunk of b (no logits)
    out = runner.execute([], [work("a", 40), work("b", 30, logits=False)])
    assert out.shape[0] == 1
    check("a", out[0])
    # step 2: a decodes, b continues its prompt on the cached prefix, c starts
    out = runner.execute([work("a", 1)], [work("b", 25, logits=False), work("c", 17)])
    check("a", out[0])
    check("c", out[1])
    # step 3: a and c decode, b finishes its prompt, d runs whole
    out = runner.execute([work("a", 1), work("c", 1)], [work("b", 15), work("d", 33)])
    for row, name in zip(out, ["a", "c", "b", "d"]):
        check(name, row)
    # steps 4-6: everyone still running decodes together (d stops after two)
    for _ in range(3):
        names = [n for n in seqs if done[n] < lengths[n]]
        out = runner.execute([work(n, 1) for n in names], [])
        for row, name in zip(out, names):
            check(name, row)
    assert done == lengths


def test_runner_copy_on_write_block_copy(tiny):
    """`copies` duplicates a shared block before a branch writes: both branches then decode correctly."""
    from minivllm.core.step_work import SeqWork
    from minivllm.engine.model_runner import ModelRunner
    from minivllm.model.attention import KVCache

    hf, loaded = tiny
    cfg = loaded.config
    kv = KVCache(cfg.num_hidden_layers, 16, 16, cfg.num_key_value_heads, cfg.head_dim, torch.float32)
    runner = ModelRunner(loaded.model, kv)
    prompt = list(range(10, 30))  # 20 tokens: block 3 full, block 7 partial (shared by both branches)
    runner.execute([], [SeqWork(prompt, 0, [3, 7])])
    # branch 1 keeps [3, 7]; branch 2 gets a private copy of block 7 in block 11
    out = runner.execute([SeqWork([40], 20, [3, 7]), SeqWork([41], 20, [3, 11])], [], copies=[(7, 11)])
    torch.testing.assert_close(out[0], hf_logits(hf, prompt + [40])[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[1], hf_logits(hf, prompt + [41])[-1], atol=1e-4, rtol=0)


class DecodeCase:
    """Eight sequences of 5-150 tokens over shuffled 12-block tables in a random pool (GQA 9/3 heads,
    head dim 64), and `attend`: decode attention over them with the step's context mask."""

    block_size, heads, dim = 16, 9, 64

    def __init__(
        self,
        blocks: int = 40,
        kv_heads: int = 3,
        lens: tuple[int, ...] = (37, 150, 5, 96, 64, 121, 17, 80),
        width: int = 12,
    ):
        torch.manual_seed(0)
        shape = (blocks, self.block_size, kv_heads, self.dim)
        self.k_pool, self.v_pool = torch.randn(shape), torch.randn(shape)
        self.lens = torch.tensor(lens)
        self.tables = torch.stack([torch.randperm(blocks)[:width] for _ in self.lens])  # up to width * 16 tokens
        self.q = torch.randn(len(self.lens), self.heads, self.dim)

    def mask(self, block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        return attention.decode_context_mask(context_lens, block_tables.shape[1] * self.block_size, torch.float32)

    def attend(self, queries: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        return attention.decode_attention(
            queries,
            self.k_pool,
            self.v_pool,
            block_tables,
            context_lens,
            self.mask(block_tables, context_lens),
            self.dim**-0.5,
        )


@pytest.mark.slow
def test_compiled_decode_attention_equals_sdpa_and_a_row_keeps_its_bits_in_any_batch_and_padding(monkeypatch):
    """The portable path (no native kernels). Inside the compiled step decode attention is products and
    sums (attention_by_sums), fused by inductor; eagerly it is SDPA. Both agree; a sequence's output is
    bit-identical in any batch of 2+ rows (one dynamic graph) and with its block table padded wider (the
    masked tail adds exact zeros). A single row has a graph of its own (dynamo specialises a size of 1), whose
    loops may sum in another order: last-bit differences only."""
    monkeypatch.setattr(attention, "USE_NATIVE_DECODE", False)
    case = DecodeCase()
    q, tables, lens, attend, block_size = case.q, case.tables, case.lens, case.attend, case.block_size
    compiled = torch.compile(lambda *step: attend(*step), dynamic=True)  # its own code object: its own graphs
    batch = compiled(q, tables, lens)
    assert torch.allclose(batch, attend(q, tables, lens), atol=1e-5)  # SDPA, eager
    for rows in ([0, 2], [5, 6, 7], [1, 3]):
        assert torch.equal(compiled(q[rows], tables[rows], lens[rows]), batch[rows])
        if lens[rows].max() <= 10 * block_size:  # the same real keys in a narrower table
            assert torch.equal(compiled(q[rows], tables[rows, :10], lens[rows]), batch[rows])
    for row in range(len(lens)):
        alone = compiled(q[row : row + 1], tables[row : row + 1], lens[row : row + 1])
        assert torch.allclose(alone, batch[row : row + 1], rtol=0, atol=2e-6)


def test_native_decode_in_the_compiled_step_keeps_a_rows_bits_in_any_batch_and_padding():
    """The native kernel is one opaque operator in the compiled graph: compiled == eager bit for bit,
    and a sequence's output is the same alone, in any batch and with a wider padded table (one task
    per sequence and KV head, summed in one order)."""
    if native.available() is not None:
        pytest.skip(f"native kernels unavailable here: {native.available()}")
    case = DecodeCase()
    q, tables, lens, attend, heads, dim = case.q, case.tables, case.lens, case.attend, case.heads, case.dim
    batch = attend(q, tables, lens)
    compiled = torch.compile(lambda *step: attend(*step), dynamic=True)  # its own code object: its own graphs
    assert torch.equal(compiled(q, tables, lens), batch)
    for rows in ([0, 2], [5, 6, 7], [1]):
        assert torch.equal(attend(q[rows], tables[rows], lens[rows]), batch[rows])
    assert torch.equal(attend(q[[2]], tables[[2], :1], lens[[2]]), batch[[2]])  # 5 tokens: one block
    rows_with_gaps = torch.randn(len(lens), heads + 6, dim)  # queries as a view of a wider QKV row
    rows_with_gaps[:, :heads] = q
    assert torch.equal(attend(rows_with_gaps[:, :heads], tables, lens), batch)
    portable = attention.gathered_decode_attention(
        q, case.k_pool, case.v_pool, tables, case.mask(tables, lens), dim**-0.5
    )
    torch.testing.assert_close(batch, portable, atol=1e-5, rtol=0)


def test_native_decode_of_long_contexts_in_parts_keeps_a_rows_bits_in_any_batch():
    """Contexts past 64 tokens are attended in parts of 64 (each a task where sequences are few, so one
    sequence keeps both threads streaming), merged by their maxima: the same result as SDPA, and a
    sequence's bits do not depend on the batch (alone: a task per part, or per part and head; in a batch
    of 2 x threads or more: a task per sequence) nor on its table's padding."""
    if native.available() is not None:
        pytest.skip(f"native kernels unavailable here: {native.available()}")
    case = DecodeCase(blocks=400, lens=(700, 300, 1000, 33, 512, 257, 256, 900), width=64)
    q, tables, lens, attend, dim = case.q, case.tables, case.lens, case.attend, case.dim
    batch = attend(q, tables, lens)
    portable = attention.gathered_decode_attention(
        q, case.k_pool, case.v_pool, tables, case.mask(tables, lens), dim**-0.5
    )
    torch.testing.assert_close(batch, portable, atol=1e-5, rtol=0)
    for rows in ([0], [1], [2, 7], [0, 3, 5], [6]):
        assert torch.equal(attend(q[rows], tables[rows], lens[rows]), batch[rows])
    assert torch.equal(attend(q[[1]], tables[[1], :19], lens[[1]]), batch[[1]])  # 300 tokens: 19 blocks


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process's resident memory from /proc")
def test_a_fresh_kv_pool_takes_memory_only_as_its_blocks_are_written():
    """The pool's pages come from the OS on first write: a 256 MiB pool costs next to nothing in RSS until
    blocks fill (torch.zeros wrote all of it at start-up). Still zeros, writable, one storage per pool."""
    before = _resident_mib()
    kv = attention.KVCache(8, 1024, 16, 4, 64, torch.float32)
    assert kv.num_bytes == 256 * 2**20
    assert _resident_mib() - before < 16
    kv.k[3][7] = 1.0
    assert float(kv.k[3][7].sum()) == 16 * 4 * 64 and float(kv.k[3][6].abs().sum()) == 0 == float(
        kv.v[3][7].abs().sum()
    )
    assert _resident_mib() - before < 16  # a block is 16 KiB
    untouched = _resident_mib()
    kv.v[5].fill_(2.0)  # a whole pool of one layer, 16 MiB: now it is resident (it was not before)
    assert _resident_mib() - untouched > 12
    assert len({t.untyped_storage().data_ptr() for t in (*kv.k, *kv.v)}) == 16 and kv.k[0].is_contiguous()
