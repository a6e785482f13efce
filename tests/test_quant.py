"""Quantized weights: formats, GGUF blocks, every kernel path against the dequantized reference, the
chooser, the load-time policy and its errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.kernels.cpu import native
from minivllm.loader.gguf_tensors import q4_1_blocks, q8_0_blocks, read_gguf_tensors, rotary_unpermute_index
from minivllm.quant import chooser, matmul_paths
from minivllm.quant.chooser import choose_kernels
from minivllm.quant.formats import (
    Int4Weight,
    Int8Weight,
    QuantizationError,
    concat_rows,
    quantize_int4,
    quantize_int8,
    to_per_channel,
    weight_bytes,
)
from minivllm.quant.linear import QuantEmbedding, QuantLinear
from minivllm.quant.policy import QuantConfig

CPU = torch.device("cpu")
# bf16 activations carry 8 mantissa bits: a K-term dot product of unit-scale values is off by about
# sqrt(K) * 2**-9 relative to its magnitude; 2% of the output's scale covers K up to ~1500 with margin
BF16_REL_TOL = 0.02


def random_int4(n: int, k: int, group: int = 32, seed: int = 0) -> Int4Weight:
    return quantize_int4("w", torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05, group)


# int8x2 activations keep ~15 bits per block of 32 (test_native_kernels bounds it exactly): 1e-3 of the
# output's scale is 20x tighter than bf16's tolerance, and leaves room for a K of 1536
PRECISE_REL_TOL = 1e-3


def assert_close_to_reference(y: torch.Tensor, ref: torch.Tensor, kernel: matmul_paths.Kernel) -> None:
    scale = ref.abs().max().item()
    err = (y - ref).abs().max().item()
    tol = 1e-4 * max(scale, 1) if kernel.exact else (PRECISE_REL_TOL if kernel.precise else BF16_REL_TOL) * scale
    assert err <= tol, f"{kernel.name}: max err {err} (output scale {scale})"


@pytest.mark.parametrize("n,k,group", [(96, 64, 32), (960, 576, 32), (100, 128, 64), (576, 1536, 128), (8, 32, 32)])
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 40])
def test_every_int4_kernel_matches_the_dequantized_weight(n, k, group, rows):
    weight = random_int4(n, k, group)
    x = torch.randn(rows, k)
    ref = x @ weight.dequantize().t()
    for kernel in matmul_paths.candidates(weight, CPU, torch.float32):
        assert_close_to_reference(kernel(x), ref, kernel)


@pytest.mark.parametrize("shape", [(96, 64), (49152 // 16, 576), (33, 80)])
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_every_int8_kernel_matches_the_dequantized_weight(shape, rows):
    weight = quantize_int8("w", torch.randn(*shape) * 0.05)
    x = torch.randn(rows, shape[1])
    ref = x @ weight.dequantize().t()
    names = []
    for kernel in matmul_paths.candidates(weight, CPU, torch.float32):
        assert_close_to_reference(kernel(x), ref, kernel)
        names.append(kernel.name)
    native_fits = shape[1] % 32 == 0 and native.available() is None
    ours = ["int8avx2/int8", "int8avx2/int8x2", "int8avx2/fp32"]
    assert names == ours * native_fits + ["int8pack/bf16", "int8pack/fp32"]


@pytest.mark.skipif(
    native.available() is not None,
    reason="our kernels are not built on this CPU (no AVX2): torch's int8 kernels take one scale per row only",
)
def test_a_q8_0_table_runs_in_its_own_blocks_in_the_head_and_the_lookup():
    """GGUF's Q8_0 (int8 with a scale per block of 32) is not re-rounded to one scale per row: our
    kernels and the embedding lookup take the file's values as they are."""
    weight = quantize_int8("w", torch.randn(300, 576) * torch.linspace(0.01, 1, 576), 32)
    dequantized = weight.dequantize()
    x = torch.randn(3, 576)
    head = {k.name: k for k in matmul_paths.lm_head_candidates(weight, CPU, torch.float32)}
    exact = head["int8avx2/fp32"](x)
    assert torch.allclose(exact, x @ dequantized.t(), rtol=1e-5, atol=1e-4)
    assert head["int8avx2/fp32"].q is weight.q  # no per-row copy
    refined = head["int8avx2+exact64/int8"](x)  # int8 activations, then the top 64 from the Q8_0 rows
    top = refined.topk(32, dim=-1).indices  # well inside the 64 recomputed (the 64th may be a rounded one)
    assert torch.allclose(refined.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-4)
    per_row = x @ to_per_channel(weight).dequantize().t()  # what re-rounding to one scale per row gives
    assert (per_row - exact).abs().max() > 100 * (exact - x @ dequantized.t()).abs().max()
    ids = torch.tensor([[0, 299], [7, 7]])
    assert torch.equal(QuantEmbedding(weight, CPU, torch.float32)(ids), dequantized[ids])


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_the_lm_head_gets_exact_top_logits_over_its_bf16_kernel(rows):
    """The bf16 kernel's 64 highest logits of each row are recomputed to equal fp32 (the exact
    kernel); the others stay the bf16 kernel's; each row is computed alone (a batch changes no row)."""
    weight = quantize_int8("w", torch.randn(4096, 96) * 0.05)
    x = torch.randn(rows, 96) * 3
    head = {k.name: k for k in matmul_paths.lm_head_candidates(weight, CPU, torch.float32)}
    ours = {"int8avx2+exact64/int8", "int8avx2/int8x2", "int8avx2/fp32"}
    assert set(head) - ours == {"int8pack+exact64/bf16", "int8pack/fp32"}
    fast = matmul_paths.Int8PackCPU(lambda: weight, torch.bfloat16)
    refined, exact, rounded = head["int8pack+exact64/bf16"](x), head["int8pack/fp32"](x), fast(x)
    top = rounded.topk(64, dim=-1).indices  # the candidates: the bf16 kernel's 64 highest
    assert torch.allclose(refined.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
    assert (rounded.gather(1, top) - exact.gather(1, top)).abs().max() > 1e-3  # what bf16 alone gives
    assert refined.argmax(-1).tolist() == exact.argmax(-1).tolist()
    rest = torch.ones_like(refined, dtype=torch.bool).scatter_(1, top, False)
    assert torch.equal(refined[rest], rounded[rest])
    assert torch.equal(head["int8pack+exact64/bf16"](x[:1]), refined[:1])
    precise = head["int8avx2/int8x2"](x)  # no exact-top pass: ~15-bit activations are within ~1e-4 already
    assert (precise - exact).abs().max() <= 1e-3 * exact.abs().max()
    assert precise.argmax(-1).tolist() == exact.argmax(-1).tolist()
    assert all(k.q.data_ptr() == weight.q.data_ptr() for k in head.values())  # one int8 copy


def test_an_exact_top_head_streams_its_table_once():
    """The weight-read floor (`bench profile`) counts what a call reads: the fast kernel's table, then
    64 rows per input row; the int8 table they share is not read twice."""
    weight = quantize_int8("w", torch.randn(4096, 96) * 0.05)
    head = {k.name: k for k in matmul_paths.lm_head_candidates(weight, CPU, torch.float32)}
    refined = head["int8avx2+exact64/int8"]
    table = weight.q.numel() + weight.scale.numel() * 4
    row_bytes = 96 + 4
    assert refined.streamed_bytes(1) == refined.fast.streamed_bytes(1) + 64 * row_bytes
    assert refined.streamed_bytes(8) - refined.streamed_bytes(1) == 7 * 64 * row_bytes
    assert refined.fast.streamed_bytes(1) < table + 4096 * 4  # at most the table and a scale per row


def test_dequant_kernel_is_exact_for_both_formats():
    for weight in (random_int4(64, 64), quantize_int8("w", torch.randn(48, 64))):
        x = torch.randn(5, 64)
        y = matmul_paths.Dequant(weight, CPU, torch.float32)(x)
        assert torch.allclose(y, x @ weight.dequantize().t(), atol=1e-5)


def test_quantizers_round_to_within_half_a_step():
    w = torch.randn(64, 256)
    q4 = quantize_int4("w", w, 64)
    step4 = q4.scale.repeat_interleave(64, 1)
    assert ((q4.dequantize() - w).abs() <= step4 / 2 + 1e-6).all()
    assert q4.q.min() >= 0 and q4.q.max() <= 15
    q8 = quantize_int8("w", w)
    assert ((q8.dequantize() - w).abs() <= q8.scale / 2 + 1e-6).all()
    assert q8.per_channel and q8.scale.shape == (64, 1)


def test_int4_steps_and_minimums_are_fp16_values_as_in_q4_1():
    """The native kernels store d and m in fp16 (GGUF's Q4_1 layout): a quantizer whose d and m are
    already fp16 values loses nothing there, so the kernels compute exactly this weight."""
    q4 = quantize_int4("w", torch.randn(64, 256) * 0.03, 32)
    minimum = q4.zero - 8 * q4.scale
    assert torch.equal(q4.scale.half().float(), q4.scale)
    assert torch.equal(minimum.half().float(), minimum)


def test_a_layer_whose_input_is_not_a_multiple_of_the_group_is_named_in_the_error():
    with pytest.raises(QuantizationError, match=r"layers\.3\.mlp\.down_proj.*\(64, 96\).*group size 64"):
        quantize_int4("layers.3.mlp.down_proj", torch.randn(64, 96), 64)


def _q4_1_bytes(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Encode blocks the way ggml does: f16 d, f16 m, then byte j = q[j] | q[j + 16] << 4."""
    rows, blocks = d.shape
    out = np.zeros((rows, blocks, 20), dtype=np.uint8)
    out[..., 0:2] = d.astype(np.float16)[..., None].view(np.uint8)
    out[..., 2:4] = m.astype(np.float16)[..., None].view(np.uint8)
    qb = q.reshape(rows, blocks, 32)
    out[..., 4:] = qb[..., :16] | (qb[..., 16:] << 4)
    return out.reshape(rows, -1)


def test_q4_1_blocks_decode_to_d_times_q_plus_m():
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (6, 64)).astype(np.uint8)
    d = rng.random((6, 2)).astype(np.float16).astype(np.float32)
    m = -rng.random((6, 2)).astype(np.float16).astype(np.float32)
    weight = q4_1_blocks(_q4_1_bytes(q, d, m), 6, 64)
    expected = q.astype(np.float32) * np.repeat(d, 32, 1) + np.repeat(m, 32, 1)
    assert np.allclose(weight.dequantize().numpy(), expected, atol=1e-6)
    assert torch.equal(weight.q, torch.from_numpy(q))


def test_q8_0_blocks_decode_to_d_times_q():
    rng = np.random.default_rng(1)
    q = rng.integers(-127, 128, (4, 64)).astype(np.int8)
    d = rng.random((4, 2)).astype(np.float16)
    raw = np.zeros((4, 2, 34), dtype=np.uint8)
    raw[..., 0:2] = d[..., None].view(np.uint8)
    raw[..., 2:] = q.reshape(4, 2, 32).view(np.uint8)
    weight = q8_0_blocks(raw.reshape(4, -1), 4, 64)
    assert np.allclose(weight.dequantize().numpy(), q.astype(np.float32) * np.repeat(d.astype(np.float32), 32, 1))


def test_embedded_gguf_tensors_equal_transformers_dequantized_reading(embedded_path):
    """Our block reader (no float detour) against the oracle's reader: every tensor, bit for bit,
    which also checks the un-permutation of Q/K rows."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from minivllm.loader.gguf_loader import _name_map_source, load_gguf_config

    cfg = load_gguf_config(embedded_path, "x")
    ours = read_gguf_tensors(embedded_path, cfg.num_attention_heads, cfg.num_key_value_heads)
    theirs = load_gguf_checkpoint(
        str(embedded_path), return_tensors=True, model_to_load=_name_map_source(cfg), torch_dtype=torch.float32
    )["tensors"]
    assert set(ours.tensors) == set(theirs)
    assert {ours.types[n] for n in ours.tensors if "_proj" in n} == {"Q4_1"}
    assert ours.types["model.embed_tokens.weight"] == "Q8_0" and not ours.dequantized
    for name, value in theirs.items():
        mine = ours.tensors[name]
        mine = mine if isinstance(mine, torch.Tensor) else mine.dequantize()
        assert torch.equal(mine, value), name


def test_rotary_unpermute_index_is_a_permutation_that_interleaves_halves():
    index = rotary_unpermute_index(8, 2)
    assert sorted(index.tolist()) == list(range(8))
    assert index.tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_values_come_back_exactly_from_the_stored_rows(group):
    """The stored Q4_1 rows are the only form: q, d (scale) and m + 8d (zero) read back bit for bit."""
    rng = np.random.default_rng(group)
    q = torch.from_numpy(rng.integers(0, 16, (6, 256)).astype(np.uint8))
    d = torch.from_numpy(rng.random((6, 256 // group)).astype(np.float16)).float()
    m = -torch.from_numpy(rng.random((6, 256 // group)).astype(np.float16)).float()
    weight = Int4Weight.from_values(q, d, m, group)
    assert weight.shape == (6, 256) and weight.packed.shape == (6, 256 // 32 * 20)
    assert torch.equal(weight.q, q) and torch.equal(weight.scale, d) and torch.equal(weight.zero, m + 8 * d)
    rows = weight.rows(torch.tensor([4, 1]))
    assert torch.equal(rows.q, q[[4, 1]]) and torch.equal(rows.zero, (m + 8 * d)[[4, 1]])


@pytest.mark.skipif(native.available() is not None, reason="our kernels are not built on this CPU (no AVX2)")
def test_our_4bit_kernels_read_the_stored_rows_without_a_copy(embedded_path):
    """A GGUF Q4_1 weight is read into its stored rows once; our kernels compute from those bytes."""
    from minivllm.loader.gguf_loader import load_gguf_config

    cfg = load_gguf_config(embedded_path, "x")
    weight = read_gguf_tensors(embedded_path, cfg.num_attention_heads, cfg.num_key_value_heads).tensors[
        "model.layers.0.mlp.down_proj.weight"
    ]
    layer = QuantLinear("down", weight, CPU, torch.float32)
    ours = [k for k in layer.candidates if k.name.startswith("int4avx2/")]
    assert ours and all(k.packed.data_ptr() == weight.packed.data_ptr() for k in ours)


def test_fusing_takes_each_part_out_of_the_loaded_tensors():
    """Parts are freed as their fused weight is built, not when the load returns (the load's peak)."""
    from minivllm.loader.random_shapes import random_config, random_tensors
    from minivllm.loader.weights import fused_state_dict, hf_tensor_names

    cfg = random_config("tiny")
    loaded = random_tensors(cfg, 0, torch.float32)
    fused = fused_state_dict(cfg, loaded)
    assert not set(hf_tensor_names(cfg)) & set(loaded)
    assert "layers.0.self_attn.qkv_proj.weight" in fused and "lm_head.weight" in fused


def test_rounding_4bit_weights_again_at_another_group_is_said_at_load(capfd):
    """int4 at group 64 over weights a checkpoint holds in 4 bits at group 32 rounds them twice (the embedded
    model: KL 0.99 against fp32): the load says so; at their own group, or from floats, it says nothing."""
    from minivllm.loader.random_shapes import random_config, random_tensors
    from minivllm.loader.weights import build_model

    cfg = random_config("tiny")

    def stored_in_4_bits() -> dict:
        tensors = random_tensors(cfg, 0, torch.float32)
        return {name: quantize_int4(name, t, 32) if "_proj." in name else t for name, t in tensors.items()}

    _, twice = build_model(cfg, stored_in_4_bits(), torch.float32, CPU, quant=QuantConfig("int4", group_size=64))
    layers = cfg.num_hidden_layers * 4  # fused: q|k|v, o, gate|up, down
    assert twice.requantized_note.startswith(
        f"warning: {layers} weight(s) stored in 4 bits (groups of 32) re-quantized to int4 g64"
    )
    _, kept = build_model(cfg, stored_in_4_bits(), torch.float32, CPU, quant=QuantConfig("int4", group_size=32))
    _, from_floats = build_model(
        cfg, random_tensors(cfg, 0, torch.float32), torch.float32, CPU, quant=QuantConfig("int4", group_size=64)
    )
    assert kept.requantized_note is None and from_floats.requantized_note is None


def test_fused_rows_concatenate_and_mixed_groups_are_refused():
    a, b = random_int4(32, 64, seed=1), random_int4(16, 64, seed=2)
    fused = concat_rows([a, b])
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(QuantizationError, match="different quantized formats"):
        concat_rows([a, random_int4(16, 64, group=64)])


def test_per_channel_requantization_of_q8_0_stays_within_half_a_row_step():
    grouped = quantize_int8("w", torch.randn(16, 128), group_size=32)
    per_channel = to_per_channel(grouped)
    assert per_channel.per_channel
    assert ((per_channel.dequantize() - grouped.dequantize()).abs() <= per_channel.scale / 2 + 1e-6).all()


def test_int4_g32_stores_half_a_byte_per_weight_plus_two_fp16_per_group():
    weight = random_int4(960, 576)
    assert weight_bytes(weight) == 960 * 576 // 2 + 2 * 960 * (576 // 32) * 2  # 15.6% of fp32


def test_embedding_lookup_and_tied_head_share_one_int8_table():
    table = quantize_int8("embed", torch.randn(80, 64))
    emb = QuantEmbedding(table, CPU, torch.float32)
    ids = torch.tensor([0, 5, 79, 5])
    assert torch.allclose(emb(ids), table.dequantize()[ids], atol=1e-6)
    head = QuantLinear(
        "lm_head",
        emb.as_weight(),
        CPU,
        torch.float32,
        kernels=matmul_paths.lm_head_candidates(emb.as_weight(), CPU, torch.float32),
    )
    assert all(k.q.data_ptr() == emb.q.data_ptr() for k in head.candidates)


def test_chooser_times_every_candidate_and_keeps_only_the_chosen(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))  # no choice kept from an earlier run: a timing
    layers = [QuantLinear(f"l{i}", random_int4(96, 64, seed=i), CPU, torch.float32) for i in range(3)]
    (choice,) = choose_kernels(layers, buckets=(1, 8))
    assert choice.layers == 3 and set(choice.timings_ms) == {1, 8} and not choice.cached
    ours = {"int4avx2/int8", "int4avx2/int8x2", "int4avx2/fp32"}
    assert set(choice.timings_ms[1]) - ours == {"int4pack/bf16", "int4pack/fp32"}
    for layer in layers:
        assert len(layer.plan) == 1  # one kernel at every row count: a row's result never depends on its batch
        assert [k.name for k in layer.candidates] == [layer.plan[0][1].name]  # the others were dropped


@pytest.mark.skipif(
    native.available() is not None,
    reason="our kernels are not built on this CPU (no AVX2): "
    "torch's two kernels are 10x apart, nothing close to choose between",
)
def test_the_chooser_takes_the_precise_kernel_fastest_over_all_buckets_and_exact_within_the_margin():
    layer = QuantLinear("l", random_int4(96, 64), CPU, torch.float32)
    fast, precise, exact, torchs = "int4avx2/int8", "int4avx2/int8x2", "int4avx2/fp32", "int4pack/bf16"
    timings = {
        1: {fast: 1.0, precise: 1.1, exact: 2.5, torchs: 0.95},
        8: {fast: 2.0, precise: 3.0, exact: 3.3, torchs: 4.0},
    }
    assert chooser._plan_from(timings, layer) == [(8, precise)]  # 1.1-1.5x for 15-bit activations: paid
    assert chooser._plan_from(timings, layer, prefer_precise=False) == [
        (8, fast)
    ]  # torch's: 5% faster at 1, 2x slower at 8
    close = {
        1: {fast: 1.0, precise: 1.1, exact: 1.15, torchs: 2.0},
        8: {fast: 2.0, precise: 2.2, exact: 2.3, torchs: 4.0},
    }
    assert chooser._plan_from(close, layer) == [(8, exact)]  # within 10% of the fastest precise one
    dear = {
        1: {fast: 1.0, precise: 2.5, exact: 3.0, torchs: 2.0},
        8: {fast: 2.0, precise: 5.0, exact: 6.0, torchs: 4.0},
    }
    assert chooser._plan_from(dear, layer) == [(8, fast)]  # precision past PRECISION_MARGIN is not bought
    # the LM head as timed on an AVX-512 box: exact wins on the mean over buckets, but is 2.3x slower
    # than int8x2 at one row (single-stream decode); int8x2's worst bucket is 2.05x, exact's 2.35x
    head = {
        1: {fast: 1.4, precise: 1.7, exact: 4.0},
        4: {fast: 2.8, precise: 3.8, exact: 2.1},
        16: {fast: 10.4, precise: 14.3, exact: 9.1},
        64: {fast: 49.6, precise: 68.9, exact: 33.6},
    }
    assert chooser._plan_from(head, layer) == [(64, precise)]


def test_the_chooser_times_candidates_in_turns_so_a_busy_spell_does_not_pick_the_kernel(monkeypatch):
    """A busy spell on the machine (another process on the cores) as long as three runs: timed one kernel after
    another it would slow every run of the first, and the slower kernel would win. The candidates take turns and
    each keeps its best run, so each gets at least one undisturbed run. A simulated clock: no real timing."""
    from types import SimpleNamespace

    cost = {"ours": 0.002, "theirs": 0.006}  # seconds a call, undisturbed
    clock, calls = [0.0], []

    class FakeKernel:
        def __init__(self, name: str):
            self.name = name

        def __call__(self, x):
            timed = len(calls) >= len(cost)  # after each kernel's warm-up call
            busy = timed and len(calls) < len(cost) + 3  # the first three timed runs
            clock[0] += cost[self.name] + (0.010 if busy else 0.0)
            calls.append(self.name)

    monkeypatch.setattr(chooser, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    layer = SimpleNamespace(candidates=[FakeKernel(name) for name in cost])
    ms = chooser._time_in_turns([layer], list(cost), torch.zeros(1, 4))
    assert calls == ["ours", "theirs"] * (1 + chooser.REPEATS)
    assert ms == pytest.approx({"ours": 2.0, "theirs": 6.0})


@pytest.mark.skipif(native.available() is not None, reason="our kernels are not built on this CPU (no AVX2)")
def test_a_busy_spell_at_one_bucket_does_not_cut_the_precise_kernel(monkeypatch, caplog):
    """Seen on a busy 2-core box: int8x2 timed 4.5x int8 at 8 rows once, the cut dropped it from every larger
    bucket, and a 1.1B model's biggest layers ran int8 activations (kept for every later load). A cut now
    needs a second timing of the bucket to agree. A simulated timing: no real clock."""
    fast, precise = "int4avx2/int8", "int4avx2/int8x2"
    undisturbed = {fast: 1.0, precise: 1.5}  # ms a row; every other candidate 20
    spikes = [{precise: 5.0}]  # only the first timing at 8 rows is disturbed
    timed = []

    def fake_time_in_turns(sample, names, x):
        rows = x.shape[0]
        timed.append(rows)
        spike = spikes.pop() if rows == 8 and spikes else {}
        return {n: rows * spike.get(n, undisturbed.get(n, 20.0)) for n in names}

    monkeypatch.setattr(chooser, "_time_in_turns", fake_time_in_turns)
    layer = QuantLinear("l", random_int4(96, 64), CPU, torch.float32)
    timings = chooser._time_group([layer], (1, 8, 64))
    assert timed == [1, 1, 8, 8, 64]  # buckets 1 (a real cut) and 8 (a spike) timed twice
    assert set(timings[8]) == set(timings[64]) == {fast, precise}  # the slow ones cut, once confirmed
    assert timings[8][precise] == 8 * 1.5  # the undisturbed timing is the one kept
    assert chooser._plan_from(timings, layer) == [(64, precise)]
    with caplog.at_level("WARNING", logger="minivllm.quant.chooser"):
        chooser._warn_if_imprecise("int4 [96x64]", [(64, precise)], layer)
        assert not caplog.records
        chooser._warn_if_imprecise("int4 [96x64]", [(64, fast)], layer)
    assert "int4 [96x64]: no precise kernel" in caplog.text and "int4avx2/int8 runs it" in caplog.text


def test_forcing_an_unknown_kernel_lists_the_available_ones():
    layer = QuantLinear("l", random_int4(96, 64), CPU, torch.float32)
    with pytest.raises(ValueError, match="int4pack/bf16"):
        layer.force("fbgemm")


def test_unknown_quantization_lists_the_choices():
    with pytest.raises(ValueError, match="auto, none, int8, int4"):
        QuantConfig("int3").validate()
    with pytest.raises(ValueError, match="32, 64, 128"):
        QuantConfig("int4", group_size=48).validate()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the CUDA kernels cannot run")
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_cuda_kernels_match_the_dequantized_weight(rows):
    device = torch.device("cuda")
    for weight in (random_int4(256, 512), quantize_int8("w", torch.randn(256, 512) * 0.05)):
        x = torch.randn(rows, 512, device=device, dtype=torch.bfloat16)
        ref = x.float() @ weight.dequantize().to(device).t()
        for kernel in matmul_paths.candidates(weight, device, torch.bfloat16):
            y = kernel(x).float()
            assert (y - ref).abs().max() <= 0.03 * ref.abs().max(), kernel.name


def test_the_weight_memory_counts_an_mkl_packed_copy_at_its_weights_size():
    """An MKL-packed copy is an opaque tensor whose numel() overstates what it holds ~2.7x (the fp32
    model read 7,097 MiB instead of ~2.1 GB): each copy counts as its weight, as RSS grows."""
    from minivllm.loader.install_quantized import stored_bytes
    from minivllm.model.packed_linear import PackedLinear, packing_supported

    layer = PackedLinear(576, 3072, bias=False)
    if not packing_supported(layer.weight):
        pytest.skip("torch was built without MKL here: no packed copies to count")
    plain = stored_bytes(layer)
    assert plain == 3072 * 576 * 4
    layer.pack((4, 8))
    assert stored_bytes(layer) == 3 * plain


def test_torchs_packed_copies_are_built_only_when_used():
    """torch's int4/int8 packings are built at first use, once per weight for both activation dtypes, so
    a plan kept from an earlier load that names our kernel never builds them (the load's peak RSS)."""
    w4 = quantize_int4("w4", torch.randn(64, 128) * 0.05, 32)
    w8 = quantize_int8("w8", torch.randn(64, 128) * 0.05, 32)
    x = torch.randn(3, 128)
    # torch's int8 kernel takes one scale per row: a grouped weight is re-rounded to that form first
    for weight, built, form in ((w4, "packed", w4), (w8, "q", to_per_channel(w8))):
        theirs = [
            k
            for k in matmul_paths.candidates(weight, CPU, torch.float32)
            if k.name.startswith(("int4pack/", "int8pack/"))
        ]
        assert len(theirs) == 2 and not any(built in vars(k) for k in theirs)
        exact = next(k for k in theirs if k.name.endswith("/fp32"))
        torch.testing.assert_close(exact(x), x @ form.dequantize(torch.float32).T, atol=1e-4, rtol=1e-4)
        bf16 = next(k for k in theirs if k.name.endswith("/bf16"))
        assert built not in vars(bf16)
        bf16(x)
        if weight is w4:  # one packed copy serves both activation dtypes
            assert bf16.packed is exact.packed


@pytest.mark.skipif(native.available() is not None, reason="the native kernels are not built here")
def test_native_int8_kernels_read_a_q8_0_weights_own_scales():
    """Scales per block of 32 (GGUF Q8_0) are the native kernels' own layout: they read the weight's tensor, not a
    copy (~0.1 GiB at 1B parameters), and a coarser group repeats its scale into a new one."""
    q = torch.randint(-127, 128, (64, 128), dtype=torch.int8)
    per_block = Int8Weight(q, torch.rand(64, 4) + 0.1, 32)
    kernels = [
        k
        for k in matmul_paths.candidates(per_block, torch.device("cpu"), torch.float32)
        if k.name.startswith("int8avx2")
    ]
    assert kernels and all(k.scale.data_ptr() == per_block.scale.data_ptr() for k in kernels)
    coarse = Int8Weight(q, torch.rand(64, 2) + 0.1, 64)
    native_kernel = next(
        k for k in matmul_paths.candidates(coarse, torch.device("cpu"), torch.float32) if k.name.startswith("int8avx2")
    )
    assert native_kernel.scale.shape == (64, 4) and torch.equal(native_kernel.scale[:, ::2], coarse.scale)
    x = torch.randn(3, 128)
    torch.testing.assert_close(kernels[-1](x), x @ per_block.dequantize().T, atol=1e-3, rtol=1e-4)


@pytest.mark.skipif(native.available() is not None, reason="the native kernels are not built here")
@pytest.mark.parametrize("k", [128, 224])  # 224: seven blocks, a group of eight's tail
def test_fp16_block_scales_give_the_bits_of_the_same_scales_in_fp32(k):
    """GGUF Q8_0 stores its scales in fp16: the kernels and the embedding lookup read them there (half the bytes),
    with the results of those values in fp32."""
    q = torch.randint(-127, 128, (40, k), dtype=torch.int8)
    half = (torch.rand(40, k // 32) * 0.01 + 1e-4).half()
    x = torch.randn(5, k)
    for acts in ("int8", "int8x2", "fp32"):
        kernel = matmul_paths.Int8Native
        assert torch.equal(kernel(q, half, acts)(x), kernel(q, half.float(), acts)(x)), acts
    ids = torch.tensor([3, 0, 39, 3])
    assert torch.equal(native.int8_embedding(ids, q, half), native.int8_embedding(ids, q, half.float()))
    assert torch.equal(native.int8_embedding(ids, q, half), Int8Weight(q, half, 32).dequantize()[ids])
