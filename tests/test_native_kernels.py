"""Our native kernels (kernels/cpu/native.py), with int8, int8x2 and fp32 activations: built here, not
skipped on a capable CPU, each row computed alone, the fp32 ones exact, the VNNI loops equal to the AVX2 ones,
the GGUF Q4_1 block carried over exactly, inside torch.compile, and a build that fails leaves torch's kernels
in charge. Also the greedy pick's fused argmax + log-sum-exp and the int8 embedding lookup."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from minivllm.kernels.cpu import native
from minivllm.loader.gguf_tensors import q4_1_blocks
from minivllm.quant import matmul_paths
from minivllm.quant.formats import quantize_int4, quantize_int8

CPU = torch.device("cpu")
needs_avx2 = pytest.mark.skipif(
    not native.cpu_has_avx2(),
    reason=f"CPU capability {torch.backends.cpu.get_cpu_capability()} "
    "has no AVX2: the native kernels are not offered here",
)


def _cpu_has_vnni() -> bool:
    flags = open("/proc/cpuinfo").read() if sys.platform == "linux" else ""
    return all(f in flags.split() for f in ("avx512_vnni", "avx512vl", "avx512bw"))


needs_vnni = pytest.mark.skipif(
    not _cpu_has_vnni(),
    reason="this CPU has no AVX512-VNNI: the kernels run their AVX2 loops only, nothing to compare them with",
)


def _int4(n: int, k: int, group: int = 32, seed: int = 0):
    return quantize_int4("w", torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05, group)


@needs_avx2
def test_the_native_kernels_build_and_are_candidates_on_an_avx2_cpu():
    assert native.available() is None  # a missing compiler or ninja on an AVX2 box fails here, loudly
    int4 = matmul_paths.candidates(_int4(64, 128), CPU, torch.float32)
    assert [k.name for k in int4[:3]] == ["int4avx2/int8", "int4avx2/int8x2", "int4avx2/fp32"]
    assert int4[0].packed is int4[1].packed is int4[2].packed  # one packed copy serves every activation precision
    head = [
        k.name for k in matmul_paths.lm_head_candidates(quantize_int8("h", torch.randn(256, 96)), CPU, torch.float32)
    ]
    assert "int8avx2+exact64/int8" in head and "int8avx2/fp32" in head  # an exact kernel needs no exact-top pass


def _native(kind: str, acts: str, n: int, k: int):
    assert native.available() is None  # loads the operators: a test run alone (-k) has no earlier one to do it
    if kind == "int4":
        return matmul_paths.Int4Native(_int4(n, k).packed, acts)
    w = quantize_int8("w", torch.randn(n, k, generator=torch.Generator().manual_seed(1)))
    return matmul_paths.Int8Native(w.q, w.scale[:, 0], acts)


@needs_avx2
@pytest.mark.parametrize("acts", matmul_paths.NATIVE_ACTS)
# int4 at 9, 7, 24 and 2 pairs: a last group of 1 or 3 pairs, none, one; a lone row runs its own loop
@pytest.mark.parametrize("kind,k", [("int4", 576), ("int4", 448), ("int4", 1536), ("int4", 128), ("int8", 576)])
def test_each_row_gets_the_same_bits_alone_and_in_any_batch(kind, k, acts):
    kernel = _native(kind, acts, 300, k)
    x = torch.randn(70, k)  # more rows than one L1 chunk of int8x2 activations (q8_features.inc)
    batch = kernel(x)
    for rows in (1, 2, 3, 4, 5, 9, 33, 70):
        assert torch.equal(kernel(x[:rows]), batch[:rows])
    assert all(torch.equal(kernel(x[i : i + 1]), batch[i : i + 1]) for i in range(0, 70, 7))


# int8 weights pair their blocks too; an odd count (9, 5, 3 blocks) ends in a block paired with nothing
KINDS_AND_K = [("int4", 256), ("int8", 256), ("int8", 288), ("int8", 160), ("int8", 96)]


@needs_avx2
@pytest.mark.parametrize("acts,step", [("int8", 127 * 2), ("int8x2", 127 * 256)])
@pytest.mark.parametrize("kind,k", KINDS_AND_K)
def test_activation_quantization_error_is_that_of_its_blocks(kind, k, acts, step):
    """Per block of 32, with scale = max|x|/127: int8 keeps |x - scale*q| <= scale/2, int8x2 (its
    remainder in 1/128ths of the scale) <= scale/256. The output error stays below
    sum_b |w_b| * max|x_b| / step, computed here for every output."""
    kernel = _native(kind, acts, 64, k)
    w = _int4(64, k).dequantize() if kind == "int4" else kernel.q.float() * kernel.scale[:, None]
    x = torch.randn(3, k) * torch.linspace(0.1, 10, k)  # blocks of very different magnitude
    y = kernel(x)
    block_max = x.abs().reshape(3, k // 32, 32).amax(-1)  # [rows, blocks]
    bound = torch.einsum("rb,nb->rn", block_max / step, w.abs().reshape(64, k // 32, 32).sum(-1))
    err = (y.double() - x.double() @ w.double().t()).abs()
    assert (err <= bound * 1.001 + 2e-5).all()
    if acts == "int8x2":  # and it is that much better than int8, not merely within a loose bound
        coarse = (_native(kind, "int8", 64, k)(x).double() - x.double() @ w.double().t()).abs()
        assert err.max() < coarse.max() / 30


@needs_avx2
@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("shape", [(1, 64, 128), (5, 301, 576), (9, 96, 1536)])
def test_the_fp32_activation_kernels_compute_the_dequantized_product(kind, shape):
    """fp32 activations, weights dequantized in registers: equal to x @ W^T of the dequantized
    weights up to fp32 summation order, the precision of the fp32 model HF parity is checked on."""
    rows, n, k = shape
    kernel = _native(kind, "fp32", n, k)
    if kind == "int4":
        w = _int4(n, k).dequantize()
    else:
        w = kernel.q.float() * kernel.scale[:, None]
    x = torch.randn(rows, k)
    expected = (x.double() @ w.double().t()).float()
    assert kernel.exact
    assert torch.allclose(kernel(x), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@needs_vnni
@pytest.mark.parametrize("acts", ["int8", "int8x2"])
# pairs: 9, 7, 24, 2 (a last group of 1 or 3 pairs, none, one); int8 also 4.5 and 2.5 (a block alone)
@pytest.mark.parametrize(
    "kind,k", [(kind, k) for kind in ("int4", "int8") for k in (576, 448, 1536, 128)] + [("int8", 288), ("int8", 160)]
)
def test_the_vnni_loops_give_the_avx2_loops_bits(kind, acts, k):
    kernel = _native(kind, acts, 200, k)
    x = torch.randn(7, k)
    try:
        assert native.use_vnni(True)
        with_vnni = kernel(x), kernel(x[:1])  # a lone row runs its own loop
        assert not native.use_vnni(False)
        assert torch.equal(kernel(x), with_vnni[0]) and torch.equal(kernel(x[:1]), with_vnni[1])
    finally:
        native.use_vnni(True)


@needs_avx2
def test_a_gguf_q4_1_block_is_packed_with_its_own_fp16_d_and_m():
    rng = np.random.default_rng(3)
    q = rng.integers(0, 16, (4, 64)).astype(np.uint8)
    d = rng.random((4, 2)).astype(np.float16)
    m = -rng.random((4, 2)).astype(np.float16)
    raw = np.zeros((4, 2, 20), dtype=np.uint8)
    raw[..., 0:2], raw[..., 2:4] = d[..., None].view(np.uint8), m[..., None].view(np.uint8)
    qb = q.reshape(4, 2, 32)
    raw[..., 4:] = qb[..., :16] | (qb[..., 16:] << 4)
    packed = q4_1_blocks(raw.reshape(4, -1), 4, 64).packed.numpy()
    assert np.array_equal(packed[:, :4].view(np.float16), d)  # d, then m: the file's own halves
    assert np.array_equal(packed[:, 4:8].view(np.float16), m)
    assert np.array_equal(packed[:, 8:].reshape(4, 2, 16), raw[..., 4:])  # the file's nibble bytes


@needs_avx2
@pytest.mark.parametrize("acts", matmul_paths.NATIVE_ACTS)
def test_the_native_kernel_runs_inside_a_compiled_graph(acts):
    kernel = _native("int4", acts, 128, 128)
    norm = torch.ones(128)

    def layer(x):
        return torch.nn.functional.silu(kernel(torch.rms_norm(x, (128,), norm)))

    x = torch.randn(2, 128)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    assert torch.allclose(compiled(x), layer(x), atol=1e-5)


def test_a_failed_build_leaves_torchs_kernels_and_says_why(monkeypatch, caplog):
    def no_compiler():
        raise RuntimeError("Error building extension 'minivllm_native'\ng++: command not found")

    native.available.cache_clear()
    monkeypatch.setattr(native, "_build", no_compiler)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    try:
        with caplog.at_level(logging.WARNING):
            assert "g++: command not found" in native.available()
        assert "g++: command not found" in caplog.text
        names = [k.name for k in matmul_paths.candidates(_int4(64, 128), CPU, torch.float32)]
        assert names == ["int4pack/bf16", "int4pack/fp32"]
    finally:
        native.available.cache_clear()


def test_a_cpu_without_avx2_is_told_so_and_never_builds(monkeypatch):
    native.available.cache_clear()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    monkeypatch.setattr(native, "_build", lambda: pytest.fail("built without AVX2"))
    try:
        assert "no AVX2" in native.available()
    finally:
        native.available.cache_clear()


@needs_avx2
def test_our_fp32_kernel_serves_a_linear_at_every_row_count_each_row_summed_alone():
    """fp32 weights through our kernel: F.linear's product at every row count, and a row's bits do
    not depend on the rows beside it (a decode batch, a prefill chunk, a prefix-cache recompute)."""
    from minivllm.model.packed_linear import PackedLinear

    native.available()  # loads the kernels, as pack_model does before it sets `native`
    torch.manual_seed(0)
    layer = PackedLinear(96, 80, bias=False)
    layer.native = True
    with torch.no_grad():
        for rows in (1, 2, 3, 8, 9, 40, 130):
            x = torch.randn(rows, 96)
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight), atol=1e-5, rtol=1e-5)
        x = torch.randn(130, 96)
        assert all(torch.equal(layer(x)[i], layer(x[i : i + 1])[0]) for i in (0, 3, 77, 129))


@pytest.mark.parametrize(
    "wins, chosen",
    [
        ((True, True, True), True),
        ((False, True, True), False),
        ((True, False, True), False),
        ((True, True, False), False),
    ],
)
def test_the_fp32_kernel_choice_follows_the_timings(monkeypatch, tmp_path, wins, chosen):
    """Our kernel serves every row count (and nothing is packed) only where it beats MKL at one row
    and at 8 rows and stays within PREFILL_SLOWDOWN of it at a prefill chunk; else MKL as before. The
    choice is kept for the machine: a second load takes it without timing."""
    from minivllm.model import packed_linear

    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))

    model = torch.nn.Sequential(
        packed_linear.PackedLinear(64, 96, bias=False), packed_linear.PackedLinear(64, 96, bias=False)
    )
    if not packed_linear.packing_supported(model[0].weight) or not packed_linear.native_fp32_usable(list(model)):
        pytest.skip("needs torch with MKL and our native kernels (AVX2)")
    ours = torch.ops.minivllm_native.f32_linear
    ours_wins = dict(zip((1, 8, packed_linear.PREFILL_ROWS), wins))

    def fake_time(weights, rows, product):
        mkl = 1.0 if ours_wins[rows] else 0.5 / packed_linear.PREFILL_SLOWDOWN
        return 1.0 if product is ours else mkl

    monkeypatch.setattr(packed_linear, "_time_products", fake_time)
    packed_linear.pack_model(model)
    assert all(layer.native == chosen for layer in model)
    assert all(bool(getattr(layer, "packs", None)) != chosen for layer in model)

    def no_timing(*args):
        raise AssertionError("timed again")

    monkeypatch.setattr(packed_linear, "_time_products", no_timing)
    assert packed_linear.choose_fp32_kernel(list(model)) == chosen


@pytest.mark.parametrize("forced,chosen", [("native", True), ("mkl", False)])
def test_the_fp32_kernel_can_be_named_instead_of_timed(monkeypatch, tmp_path, forced, chosen):
    from minivllm.model import packed_linear

    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    layers = [packed_linear.PackedLinear(64, 96, bias=False)]
    if not packed_linear.native_fp32_usable(layers):
        pytest.skip("needs our native kernels (AVX2)")

    def no_timing(*args):
        raise AssertionError("timed although named")

    monkeypatch.setattr(packed_linear, "_time_products", no_timing)
    monkeypatch.setenv("MINIVLLM_FP32_KERNEL", forced)
    assert packed_linear.choose_fp32_kernel(layers) == chosen
    monkeypatch.setenv("MINIVLLM_FP32_KERNEL", "fastest")
    with pytest.raises(ValueError, match="expected 'native' or 'mkl'"):
        packed_linear.choose_fp32_kernel(layers)


@needs_avx2
@pytest.mark.parametrize("vocab", [1, 7, 8, 23, 49152 + 3])
def test_argmax_logsumexp_is_torchs_argmax_and_logsumexp(vocab):
    """The greedy step's fused pick: torch's first maximum and log-sum-exp, and the pick's log-prob as torch's
    gather and subtraction give it, each row alone or in any batch."""
    native.available()  # builds / loads the operators: run alone, no earlier test has
    x = torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
    x[1] = x[1].max()  # a tie across the whole row: the first index
    x[2, vocab // 2 :] = x[2].max() + 1  # ties in the second half, some in the scalar tail
    x[3] = float("-inf")  # a fully masked row: index 0, -inf
    x[4, vocab // 3] = float("nan")  # NaN wins, as in torch.argmax, and poisons the sum
    x[5, -1] = float("inf")
    ids, lse, logprob = native.argmax_logsumexp(x)
    assert torch.equal(ids, x.argmax(dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(x, dim=-1), rtol=2e-6, atol=2e-6, equal_nan=True)
    torch.testing.assert_close(logprob, x.gather(1, ids[:, None])[:, 0] - lse, rtol=0, atol=0, equal_nan=True)
    assert logprob[[3, 4, 5]].isnan().all()  # -inf - -inf, a NaN row, inf - inf: as torch's subtraction
    for i in range(9):
        alone = native.argmax_logsumexp(x[i : i + 1].contiguous())
        for value, batched in zip(alone, (ids, lse, logprob)):
            torch.testing.assert_close(value, batched[i : i + 1], rtol=0, atol=0, equal_nan=True)  # the same bits


@needs_avx2
# per group of 32 (GGUF's Q8_0), of 64, one scale per row of 100 values (a tail no vector holds)
@pytest.mark.parametrize("hidden, group", [(96, 32), (128, 64), (100, None)])
def test_the_native_embedding_lookup_is_the_torch_forms_bits(hidden, group):
    """QuantEmbedding's one native call gives the six-operator torch form's bits for ids of any shape,
    and an id outside the table is an error, not a read."""
    from minivllm.quant.linear import QuantEmbedding

    table = quantize_int8("embed", torch.randn(50, hidden, generator=torch.Generator().manual_seed(1)), group)
    embedding = QuantEmbedding(table, CPU, torch.float32)
    assert embedding.looks_up_natively
    ids = torch.tensor([[0, 49, 7], [7, 3, 0]])
    native_rows = embedding(ids)
    embedding.looks_up_natively = False
    torch_rows = embedding(ids)
    assert native_rows.shape == (2, 3, hidden) and torch.equal(native_rows, torch_rows)
    assert torch.equal(native_rows, table.dequantize()[ids])
    assert torch.equal(
        native.int8_embedding(torch.tensor([], dtype=torch.long), table.q, table.scale), torch.empty(0, hidden)
    )
    for bad in (50, -1):
        with pytest.raises(RuntimeError, match=f"token id {bad} is outside the embedding table's 50 rows"):
            native.int8_embedding(torch.tensor([1, bad]), table.q, table.scale)


@pytest.mark.slow
@needs_vnni
def test_minivllm_no_vnni_runs_the_avx2_loops_and_times_its_kernels_apart():
    """MINIVLLM_NO_VNNI=1 (with ATEN_CPU_CAPABILITY=avx2 and MKL_ENABLE_INSTRUCTIONS=AVX2: an AVX2 box's
    code paths on this one): the int8 kernels start on their AVX2 loops, and the kernel choices are kept
    under another machine key than the VNNI loops' timings."""
    code = (
        "from minivllm.kernels.cpu import native; from minivllm.quant import choice_cache; import torch; "
        "assert native.available() is None; "
        "print(native.vnni_running(), choice_cache.machine(torch.device('cpu')).endswith('no-vnni'))"
    )
    for env, expected in (({"MINIVLLM_NO_VNNI": "1"}, "False True"), ({}, "True False")):
        out = subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0 and out.stdout.split() == expected.split(), out.stderr
