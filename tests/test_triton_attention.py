"""The Triton paged decode-attention kernel (kernels/triton/attention.py) against the portable path it
replaces on CUDA (`gathered_decode_attention`: gather + mask + SDPA, here in float64).

Pools hold random K/V under shuffled block tables; every slot the kernel must not read (past each
context in its last block, and whole padding columns) holds NaN, so a stray read shows as NaN. Cases:
GQA, MHA, MQA, head sizes 48 to 256, fp32 / bf16 / fp16 pools, context lengths from 1 past 2,000 in one
batch, q as a strided view of a fused QKV row, split and unsplit contexts; the products on the CUDA cores
and, for half precision, on the tensor cores (`tl.dot`, the "dot-" cases).

Where it runs: on CUDA in this process; on a CPU with triton installed, under Triton's interpreter in
one subprocess (TRITON_INTERPRET=1 has to be set before triton is imported, and must not leak into
this process's other tests); skipped where neither (CI installs no triton). bf16 tensor-core cases run on
CUDA only (INTERPRETER_BF16_DOT says why). The CPU path's promise, that it never asks for triton, is
checked everywhere."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from minivllm.model import attention
from minivllm.model.attention import decode_context_mask, gathered_decode_attention

HAS_TRITON = importlib.util.find_spec("triton") is not None
ON_CUDA = HAS_TRITON and torch.cuda.is_available()
needs_triton = pytest.mark.skipif(
    not HAS_TRITON,
    reason="triton is not installed and there is no CUDA device "
    "(CI's case): the kernel runs only on CUDA; with triton installed these tests "
    "run here under its interpreter",
)
# blocks 0 and 1, all NaN: where padding columns point, and block 0 is also where the kernel's masked table
# reads fall back to (other=0), so a K/V load that trusts a dead token's block id reads NaN
NAN_BLOCKS = 2
INTERPRETER_BF16_DOT = (
    "bf16 tensor-core cases run on CUDA only: Triton's interpreter (3.9, "
    "runtime/interpreter.py `create_dot`) multiplies bf16 tl.dot operands as their raw uint16 "
    "bit patterns (it converts only 8-bit floats), so its result says nothing of the kernel's; "
    "the fp16 dot- cases cover the same code here"
)
cuda_only_bf16_dot = pytest.mark.skipif(not ON_CUDA, reason=INTERPRETER_BF16_DOT)


@dataclass(frozen=True)
class Case:
    heads: int
    kv_heads: int
    dim: int
    lens: tuple[int, ...]
    pool_dtype: torch.dtype = torch.float32
    q_dtype: torch.dtype = torch.float32
    block_size: int = 16
    partition: int = 0  # tokens a partition; 0: the kernel's choice from the shapes
    strided_q: bool = False  # q a view of a fused QKV row, as the model passes it
    wild_padding: bool = False  # padding columns hold ids past the pool (a read would fault)
    tensor_cores: bool | None = None  # None: the kernel's choice from the dtypes; True / False force a path

    @property
    def dot(self) -> bool:
        """Whether the products run on the tensor cores (`triton_attention.uses_tensor_cores` when not forced)."""
        if self.tensor_cores is not None:
            return self.tensor_cores
        return self.q_dtype == self.pool_dtype and self.q_dtype in (BF16, FP16)

    @property
    def tolerance(self) -> tuple[float, float]:
        """(atol, rtol): fp32 outputs to 1e-5; bf16 / fp16 outputs to about two of their steps. The dot path
        also rounds each softmax weight to the pool's dtype before the weighted sum: an error of a few of its
        steps of |v| (~1 here) that does not shrink with the output, hence an absolute term."""
        if self.dot:
            return {torch.bfloat16: (2**-7, 2**-6), torch.float16: (2**-10, 2**-9)}[self.q_dtype]
        return {torch.float32: (1e-5, 0.0), torch.bfloat16: (1e-6, 2**-6), torch.float16: (1e-6, 2**-9)}[self.q_dtype]

    @property
    def interpreter_runs(self) -> bool:
        return not (self.dot and BF16 in (self.q_dtype, self.pool_dtype))


BF16, FP16 = torch.bfloat16, torch.float16
MIXED = (1, 16, 17, 300, 2100)  # one token, exactly a block, a block and one, hundreds, past 2,000
CASES = {
    "gqa-9/3-d64-mixed": Case(9, 3, 64, MIXED),
    "gqa-9/3-d64-strided-q": Case(9, 3, 64, (5, 33, 300), strided_q=True),
    "gqa-9/3-d64-split-64": Case(9, 3, 64, (1, 17, 300, 700), partition=64),
    "gqa-32/4-d64-tinyllama": Case(32, 4, 64, (1, 77, 260)),
    "mha-4/4-d64": Case(4, 4, 64, (1, 17, 300)),
    "mqa-8/1-d64": Case(8, 1, 64, (16, 2100)),
    "mqa-8/1-d64-unsplit": Case(8, 1, 64, (2100,), partition=4096),
    "gqa-8/2-d128": Case(8, 2, 128, (1, 16, 17, 300)),
    "gqa-8/2-d128-split-256": Case(8, 2, 128, (300, 2100), partition=256),
    "gqa-6/2-d80": Case(6, 2, 80, (1, 17, 300)),
    "mha-3/3-d48-split": Case(3, 3, 48, (33, 700), partition=128),
    "bf16-pool-fp32-q": Case(9, 3, 64, (1, 17, 300), pool_dtype=BF16),
    "bf16-pool-bf16-q": Case(9, 3, 64, MIXED, pool_dtype=BF16, q_dtype=BF16, strided_q=True, tensor_cores=False),
    "fp16-pool-fp16-q": Case(8, 2, 128, (1, 17, 300), pool_dtype=FP16, q_dtype=FP16, tensor_cores=False),
    "fp16-pool-fp16-q-split": Case(9, 3, 64, (2100,), pool_dtype=FP16, q_dtype=FP16, partition=512, tensor_cores=False),
    "block-size-8": Case(9, 3, 64, (1, 8, 9, 300), block_size=8),
    "block-size-32-split": Case(9, 3, 64, (32, 33, 1000), block_size=32, partition=192),
    "wild-padding-ids": Case(9, 3, 64, (1, 17, 300), wild_padding=True),
    "graph-padding-rows": Case(9, 3, 64, (1, 1, 1, 40)),  # a graph's padding rows: one token each
    # the tensor-core path: query groups of 1 / 3 / 4 / 8 padded to 16 rows, head dims 48 / 80 padded to 64 /
    # 128, 256 (narrower tiles), split and unsplit, a partition that is not a whole number of tiles
    "dot-fp16-gqa-32/4-d64-tinyllama": Case(32, 4, 64, MIXED, pool_dtype=FP16, q_dtype=FP16, strided_q=True),
    "dot-fp16-gqa-9/3-d64-split-64": Case(9, 3, 64, (1, 17, 300, 700), FP16, FP16, partition=64),
    "dot-fp16-mha-4/4-d64-unsplit": Case(4, 4, 64, (1, 17, 300), FP16, FP16, partition=4096),
    "dot-fp16-mqa-8/1-d64-split-48": Case(8, 1, 64, (16, 2100), FP16, FP16, partition=48),
    "dot-fp16-gqa-6/2-d80": Case(6, 2, 80, (1, 17, 300), FP16, FP16),
    "dot-fp16-mha-3/3-d48-split": Case(3, 3, 48, (33, 700), FP16, FP16, partition=128),
    "dot-fp16-gqa-8/2-d256": Case(8, 2, 256, (1, 17, 300), FP16, FP16),
    "dot-fp16-block-size-8-wild-padding": Case(9, 3, 64, (1, 8, 9, 300), FP16, FP16, block_size=8, wild_padding=True),
    "dot-bf16-gqa-32/4-d64-tinyllama": Case(32, 4, 64, MIXED, pool_dtype=BF16, q_dtype=BF16, strided_q=True),
    "dot-bf16-gqa-9/3-d64-split-64": Case(9, 3, 64, (1, 17, 300, 700), BF16, BF16, partition=64),
    "dot-bf16-mha-4/4-d64-unsplit": Case(4, 4, 64, (1, 17, 300), BF16, BF16, partition=4096),
    "dot-bf16-gqa-6/2-d80-split": Case(6, 2, 80, (1, 17, 300), BF16, BF16, partition=96),
}


def _inputs(case: Case, seed: int):
    """(q, k_pool, v_pool, tables, lens) for the kernel, and (k, v, tables) for the reference: the same
    values with the NaNs zeroed and wild ids pointed at block 0 (the reference reads every column)."""
    gen = torch.Generator().manual_seed(seed)
    bs, kv, dim = case.block_size, case.kv_heads, case.dim
    counts = [-(-n // bs) for n in case.lens]
    width = max(counts) + 2  # padding columns after the longest too
    real = sum(counts)
    k, v = (torch.randn(NAN_BLOCKS + real, bs, kv, dim, generator=gen) for _ in range(2))
    ids = (torch.randperm(real, generator=gen) + NAN_BLOCKS).tolist()  # shuffled: no sequence's blocks are in order
    pad = 10**9 if case.wild_padding else 0
    tables = torch.full((len(case.lens), width), pad, dtype=torch.long)
    tables[:, 1::2] = pad if case.wild_padding else 1
    for row, (n, count) in enumerate(zip(case.lens, counts)):
        own, ids = ids[:count], ids[count:]
        tables[row, :count] = torch.tensor(own)
        for pool in (k, v):
            pool[own[-1], (n - 1) % bs + 1 :] = float("nan")  # the last block's slots past the context
    for pool in (k, v):
        pool[:NAN_BLOCKS] = float("nan")
    k_pool, v_pool = k.to(case.pool_dtype), v.to(case.pool_dtype)
    ref_tables = tables.where(tables < real + NAN_BLOCKS, 0)
    heads = case.heads
    if case.strided_q:
        fused = torch.randn(len(case.lens), (heads + 2 * kv) * dim, generator=gen) * 1.5
        q = fused.to(case.q_dtype)[:, : heads * dim].view(-1, heads, dim)  # stride(0) > heads * dim
    else:
        q = (torch.randn(len(case.lens), heads, dim, generator=gen) * 1.5).to(case.q_dtype)
    lens = torch.tensor(case.lens)
    return (q, k_pool, v_pool, tables, lens), (k_pool.nan_to_num(0.0), v_pool.nan_to_num(0.0), ref_tables)


def run_case(name: str, device: str, seed: int = 0) -> dict:
    """The kernel's output against the float64 reference: max abs diff, and whether it is within the
    case's tolerance (no NaN anywhere)."""
    from minivllm.kernels.triton.attention import paged_decode_attention

    case = CASES[name]
    (q, k_pool, v_pool, tables, lens), (k_ref, v_ref, ref_tables) = _inputs(case, seed)
    scale = case.dim**-0.5
    moved = [t.to(device) for t in (k_pool, v_pool, tables, lens)]
    q_dev = q.to(device) if not case.strided_q else _strided_on(q, device)
    out = paged_decode_attention(q_dev, *moved, scale, case.partition, case.tensor_cores).cpu()
    mask = decode_context_mask(lens, ref_tables.shape[1] * case.block_size, torch.float64)
    ref = gathered_decode_attention(q.double(), k_ref, v_ref, ref_tables, mask, scale)
    atol, rtol = case.tolerance
    diff = (out.double() - ref).abs()
    ok = out.dtype == q.dtype and not out.isnan().any() and bool((diff <= atol + rtol * ref.abs()).all())
    if case.tensor_cores is None:  # the kernel's own choice: the path the case expects, bit for bit
        forced = paged_decode_attention(q_dev, *moved, scale, case.partition, case.dot).cpu()
        ok &= torch.equal(out, forced)
    return {"max_abs_diff": diff.max().item(), "ok": ok}


def _strided_on(q: torch.Tensor, device: str) -> torch.Tensor:
    """q moved with its strides: a view into a fused row on the device too."""
    base = q.as_strided((q.shape[0], q.stride(0)), (q.stride(0), 1))
    return base.to(device).as_strided(q.shape, q.stride())


def padded_graph_steps_on_cpu() -> dict:
    """Decode graphs of a tiny model through `no_capture` (padding rows into the scratch block, padded
    widths, no decode mask) with the kernel serving attention on CPU pools (the interpreter), against
    eager steps through the gathered path. The scratch block is NaN but for what padding rows write."""
    import random

    import minivllm.kernels.triton.attention  # noqa: F401 - registers the operator
    from engine_utils import random_decode_works
    from minivllm.engine.model_runner import ModelRunner
    from minivllm.loader import load_model
    from minivllm.model.attention import KVCache
    from minivllm.model.compiled import use_compilation
    from minivllm.model.cuda_graphs import DecodeGraphs, no_capture

    loaded = load_model("random:tiny", device="cpu", quantization="none", max_model_len=256)
    use_compilation(loaded.model, "cpu", enforce_eager=True)
    cfg, blocks = loaded.config, 48
    kv = KVCache(
        cfg.num_hidden_layers, blocks, 16, cfg.num_key_value_heads, cfg.head_dim, torch.float32, scratch_block=True
    )
    gen = torch.Generator().manual_seed(0)
    for pool in (*kv.k, *kv.v):
        pool[:blocks].copy_(torch.randn(pool[:blocks].shape, generator=gen))
        pool[blocks].fill_(float("nan"))
    attention.USE_NATIVE_DECODE = False
    attention.reads_pool_with_triton = lambda k_pool: attention.USE_TRITON_DECODE  # CPU pools: the interpreter
    runner = ModelRunner(loaded.model, kv)
    graphs = DecodeGraphs(loaded.model, kv, 8, 8, capture=no_capture)
    rng, worst, ok = random.Random(0), 0.0, True
    for rows, width in ((1, 1), (3, 3), (5, 2), (8, 8)):
        works = random_decode_works(rng, rows, blocks, 16, max_width=width)
        ok &= runner._metadata(works, [], [0] * rows).decode_mask is None
        runner.graphs = graphs
        replayed = runner.execute(works, [])
        runner.graphs, attention.USE_TRITON_DECODE = None, False
        gathered = runner.execute(works, [])
        attention.USE_TRITON_DECODE = True
        worst = max(worst, (replayed - gathered).abs().max().item())
    return {"max_abs_diff": worst, "ok": ok and worst <= 1e-4 and graphs.replays == 4}


def interpreted_results() -> dict:
    """Every case under the interpreter (run by the subprocess), the engine's padded steps, the self-check."""
    results = {name: run_case(name, "cpu") for name, case in CASES.items() if case.interpreter_runs}
    results["engine"] = padded_graph_steps_on_cpu()
    from minivllm.kernels.triton.attention import self_check

    try:
        self_check("cpu")
        results["self-check"] = {"ok": True}
    except Exception as exc:  # noqa: BLE001 - reported to the parent test
        results["self-check"] = {"ok": False, "error": repr(exc)}
    return results


@pytest.fixture(scope="module")
def results():
    """Per case: {"max_abs_diff", "ok"}, computed on CUDA here or under the interpreter in a subprocess."""
    if ON_CUDA:
        return {}  # computed case by case in this process
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    code = "import json, test_triton_attention as t; print('RESULTS', json.dumps(t.interpreted_results()))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(__file__),
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, f"interpreter run failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("RESULTS "))


@needs_triton
@pytest.mark.parametrize(
    "name",
    [name if case.interpreter_runs else pytest.param(name, marks=cuda_only_bf16_dot) for name, case in CASES.items()],
)
def test_kernel_matches_the_gathered_sdpa_path(name, results):
    got = run_case(name, "cuda") if ON_CUDA else results[name]
    where = "cuda" if ON_CUDA else "interpreter"
    print(f"triton decode attention {name} ({where}): max abs diff {got['max_abs_diff']:.2e}")
    assert got["ok"], f"{name}: max abs diff {got['max_abs_diff']:.3e} (atol, rtol {CASES[name].tolerance})"


@pytest.mark.skipif(
    not HAS_TRITON or ON_CUDA,
    reason="runs under Triton's interpreter only: triton is not "
    "installed here, or there is a GPU (tests/test_cuda.py runs the engine's graphs through "
    "the kernel)",
)
def test_padded_graph_steps_through_the_kernel_match_the_gathered_path(results):
    got = results["engine"]
    print(
        f"triton decode attention, tiny model's padded graph steps (interpreter): max abs diff "
        f"{got['max_abs_diff']:.2e}"
    )
    assert got["ok"], got


@needs_triton
def test_self_check_passes(results):
    if ON_CUDA:
        from minivllm.kernels.triton.attention import self_check

        self_check("cuda")
    else:
        assert results["self-check"]["ok"], results["self-check"]


@needs_triton
def test_half_precision_over_its_own_pool_takes_the_tensor_cores(monkeypatch):
    """The dot path's rule: bf16 / fp16 queries over a pool of their dtype; fp32 and mixed dtypes keep the
    CUDA-core products; HALF_PRECISION_DOT off sends every dtype back to them."""
    from minivllm.kernels.triton import attention as triton_attention

    dtypes = (torch.float32, BF16, FP16)
    rule = {(q, pool): triton_attention.uses_tensor_cores(q, pool) for q in dtypes for pool in dtypes}
    assert rule == {(q, pool): q == pool != torch.float32 for q, pool in rule}
    assert rule == {(q, pool): attention.tensor_core_dtypes(q, pool) for q, pool in rule}  # the routing's copy
    assert [
        CASES[name].dot
        for name in ("gqa-9/3-d64-mixed", "bf16-pool-fp32-q", "dot-bf16-gqa-32/4-d64-tinyllama", "dot-fp16-gqa-6/2-d80")
    ] == [False, False, True, True]
    monkeypatch.setattr(triton_attention, "HALF_PRECISION_DOT", False)
    assert not any(triton_attention.uses_tensor_cores(dtype, dtype) for dtype in dtypes)


def test_the_cpu_path_never_asks_for_triton(monkeypatch):
    """CPU pools: no predicate, decode step or mask decision reaches `triton_decode_ready` (an import of
    triton, absent on CPU-only installs)."""

    def refuse():
        raise AssertionError("the CPU path asked for triton")

    monkeypatch.setattr(attention, "triton_decode_ready", refuse)
    (q, k_pool, v_pool, tables, lens), _ = _inputs(Case(6, 2, 64, (1, 40)), seed=1)
    k_pool, v_pool = k_pool.nan_to_num(0.0), v_pool.nan_to_num(0.0)
    for native in (True, False):
        monkeypatch.setattr(attention, "USE_NATIVE_DECODE", native)
        assert attention.reads_pool_directly(k_pool, 2, q.dtype) == attention.reads_pool_natively(k_pool)
        assert not attention.reads_pool_with_triton(k_pool)
        mask = decode_context_mask(lens, tables.shape[1] * 16, q.dtype)
        out = attention.decode_attention(q, k_pool, v_pool, tables, lens, mask, 0.125)
        assert not out.isnan().any()


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs need a CUDA device")
def test_a_captured_call_follows_new_lengths_and_tables():
    """The launch holds no tensor value (grid and partitions from shapes only): a call captured over
    padding rows (one token each, block 0) replays right for the lengths, tables and queries written
    into its inputs afterwards."""
    from minivllm.kernels.triton.attention import paged_decode_attention

    (q, k_pool, v_pool, tables, lens), (k_ref, v_ref, ref_tables) = _inputs(Case(9, 3, 64, (2100, 300, 17, 16, 1)), 4)
    statics = [torch.zeros_like(q), k_pool, v_pool, torch.zeros_like(tables), torch.ones_like(lens)]
    statics = [t.cuda() for t in statics]
    paged_decode_attention(*statics, 0.125)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(*statics, 0.125)
    for i, new in ((0, q), (3, tables), (4, lens)):
        statics[i].copy_(new)
    graph.replay()
    mask = decode_context_mask(lens, ref_tables.shape[1] * 16, torch.float64)
    ref = gathered_decode_attention(q.double(), k_ref, v_ref, ref_tables, mask, 0.125)
    assert (out.cpu().double() - ref).abs().max() <= 1e-5


def test_the_kernel_serves_fp32_and_half_precision_over_its_own_pool(monkeypatch):
    """Where the kernel measured faster than gather + SDPA on an H200 (triton_serves): fp32 activations at
    any batch, bf16/fp16 over a pool of their own dtype at any batch (tensor-core products), a half-precision
    batch over a pool of another dtype only for one sequence. The decode mask is built exactly where the
    gathered path serves, so such a batch never reaches SDPA without it."""
    from minivllm.core.step_work import SeqWork
    from minivllm.engine.model_runner import ModelRunner

    monkeypatch.setattr(attention, "reads_pool_with_triton", lambda k_pool: True)  # a GPU with triton, as seen here
    monkeypatch.setattr(attention, "USE_NATIVE_DECODE", False)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    for pool_dtype in dtypes:
        pool = torch.zeros(4, 16, 1, 64, dtype=pool_dtype)
        served = {(dtype, rows): attention.triton_serves(pool, rows, dtype) for dtype in dtypes for rows in (1, 2, 8)}
        assert served == {
            (dtype, rows): dtype == torch.float32 or rows == 1 or dtype == pool_dtype for dtype, rows in served
        }
        for (dtype, rows), triton in served.items():
            assert attention.reads_pool_directly(pool, rows, dtype) == triton
            runner = ModelRunner.__new__(ModelRunner)  # only what _metadata reads
            runner.kv_cache, runner.device, runner.dtype, runner.block_size = (
                type("KV", (), {"k": [pool]})(),
                "cpu",
                dtype,
                16,
            )
            runner.window = None
            works = [SeqWork([1], 3, [0]) for _ in range(rows)]
            assert (runner._metadata(works, [], [3] * rows).decode_mask is None) == triton
