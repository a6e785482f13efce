"""GGUF K-quants (Q4_K, Q5_K, Q6_K) on our kernels (kernels/cpu/kquant_matmul.cpp), read in their own
super-blocks: every type and activation precision against the float64 product of gguf-py's dequantization,
alone and in batches, a row's bits independent of its batch, the VNNI loops equal to the AVX2 ones, parts
of different types stacked by rows, and a small Llama GGUF of Q4_K / Q6_K linears loading with no
dequantized fallback and answering as its fp32 dequantization does."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants
from test_native_kernels import needs_avx2, needs_vnni

from engine_utils import make_engine, random_decode_works, run
from minivllm.engine.scoring import forward_prefills
from minivllm.kernels.cpu import native
from minivllm.loader import gguf_loader, load_model
from minivllm.model.native_step import NativeDecodeStep
from minivllm.quant import kquant_groups, matmul_paths
from minivllm.quant.formats import KQUANT_BYTES, KQuantWeight, concat_rows
from minivllm.quant.linear import QuantLinear
from minivllm.quant.policy import QuantConfig
from minivllm.sampling.params import SamplingParams

CPU = torch.device("cpu")
KINDS = list(KQUANT_BYTES)
SHAPES = [(64, 256), (40, 768), (70, 2816)]  # 1, 3 and 11 super-blocks a row (K = 2816: no power of two)


def random_blocks(kind: str, n: int, k: int, seed: int = 0, d: float = 0.01) -> np.ndarray:
    """Valid random super-blocks, byte by byte (gguf-py has no K-quant quantizer): every code, scale and min
    bit random, the fp16 d (and dmin) finite and positive, up to about `d`."""
    rng = np.random.default_rng(seed)
    supers = k // 256
    blocks = rng.integers(0, 256, (n, supers, KQUANT_BYTES[kind]), dtype=np.uint8)

    def halves():
        return (rng.random((n, supers)) * d + d / 100).astype(np.float16).view(np.uint8).reshape(n, supers, 2)

    if kind == "Q6_K":
        blocks[..., 208:210] = halves()
    else:
        blocks[..., 0:2], blocks[..., 2:4] = halves(), halves()
    return blocks.reshape(n, -1)


def weight(kind: str, n: int, k: int, seed: int = 0) -> tuple[KQuantWeight, torch.Tensor]:
    """The weight and gguf-py's dequantization of it (float64)."""
    raw = random_blocks(kind, n, k, seed)
    reference = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[kind])).double()
    return KQuantWeight([(kind, torch.from_numpy(raw))]), reference


def kernel(w: KQuantWeight, acts: str) -> matmul_paths.KQuantNative:
    assert native.available() is None  # loads the operators
    return matmul_paths.KQuantNative(matmul_paths.pack_kquant(w), w.shape[0], acts)


@needs_avx2
def test_kquant_weights_get_our_kernels_at_every_activation_precision():
    w, _ = weight("Q4_K", 32, 256)
    names = [k.name for k in matmul_paths.candidates(w, CPU, torch.float32)]
    assert names == ["kquant/int8", "kquant/int8x2", "kquant/fp32"]


@needs_avx2
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_the_fp32_kernel_computes_gguf_pys_dequantized_product(kind, n, k, rows):
    """fp32 activations: x @ W^T of gguf-py's weights up to fp32 summation, bounded by the operands' size."""
    w, reference = weight(kind, n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    expected = x.double() @ reference.t()
    scale = x.double().abs() @ reference.abs().t()  # what fp32 rounding errors are relative to
    y = kernel(w, "fp32")(x)
    assert ((y.double() - expected).abs() <= 2e-6 * scale + 1e-9).all()


@needs_avx2
@pytest.mark.parametrize("acts,step", [("int8", 127 * 2), ("int8x2", 127 * 256)])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 8])
def test_integer_activations_err_by_their_blocks_rounding_only(kind, n, k, rows, acts, step):
    """Per block of 32 with scale max|x|/127, int8 keeps |x - scale*q| <= scale/2 and int8x2 <= scale/256:
    the output errs by at most sum_b |w_b| * max|x_b| / step (plus fp32 summation), for every output."""
    w, reference = weight(kind, n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(5)) * torch.linspace(0.1, 10, k)
    y = kernel(w, acts)(x)
    block_max = x.double().abs().reshape(rows, k // 32, 32).amax(-1)
    bound = torch.einsum("rb,nb->rn", block_max / step, reference.abs().reshape(n, k // 32, 32).sum(-1))
    err = (y.double() - x.double() @ reference.t()).abs()
    assert (err <= bound * 1.001 + 2e-6 * (x.double().abs() @ reference.abs().t())).all()


@needs_avx2
@pytest.mark.parametrize("n", [300, 304])  # rows the file's way, and regrouped by eights
@pytest.mark.parametrize("acts", matmul_paths.NATIVE_ACTS)
@pytest.mark.parametrize("kind", KINDS)
def test_each_row_gets_the_same_bits_alone_and_in_any_batch(kind, acts, n):
    w, _ = weight(kind, n, 768)
    run = kernel(w, acts)
    x = torch.randn(70, 768)  # more rows than one L1 chunk of activations
    batch = run(x)
    for rows in (1, 2, 3, 5, 8, 33, 70):
        assert torch.equal(run(x[:rows]), batch[:rows])
    assert all(torch.equal(run(x[i : i + 1]), batch[i : i + 1]) for i in range(0, 70, 9))


@needs_vnni
@pytest.mark.parametrize("acts", ["int8", "int8x2"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [200, 204])
def test_the_vnni_loops_give_the_avx2_loops_bits(kind, acts, n):
    w, _ = weight(kind, n, 2816)
    run = kernel(w, acts)
    x = torch.randn(7, 2816)
    try:
        assert native.use_vnni(True)
        with_vnni = run(x), run(x[:1])  # a lone row runs its own loop
        assert not native.use_vnni(False)
        assert torch.equal(run(x), with_vnni[0]) and torch.equal(run(x[:1]), with_vnni[1])
    finally:
        native.use_vnni(True)


@needs_avx2
@pytest.mark.parametrize("acts", matmul_paths.NATIVE_ACTS)
def test_parts_of_different_types_stack_by_rows_in_one_call(acts):
    """A fused q|k|v of Q4_K q, k and a Q6_K v: one weight of three parts, each part's rows computed from
    its own bytes, as each part alone computes them."""
    parts = [weight("Q4_K", 96, 512, 1)[0], weight("Q4_K", 32, 512, 2)[0], weight("Q6_K", 32, 512, 3)[0]]
    fused = concat_rows(parts)
    assert fused.kinds == ["Q4_K", "Q4_K", "Q6_K"] and fused.shape == (160, 512)
    x = torch.randn(5, 512)
    assert torch.equal(kernel(fused, acts)(x), torch.cat([kernel(p, acts)(x) for p in parts], dim=1))
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))


@needs_avx2
def test_a_weight_whose_header_does_not_fit_its_bytes_is_refused_with_the_reason():
    w, _ = weight("Q4_K", 16, 256)
    packed = matmul_paths.pack_kquant(w)
    assert native.available() is None
    with pytest.raises(RuntimeError, match="multiple of 256"):
        native.kquant_linear(torch.randn(2, 128), packed, 16, 0)
    with pytest.raises(RuntimeError, match="its header and K=512"):
        native.kquant_linear(torch.randn(2, 512), packed, 16, 0)  # bytes for K = 256
    header = packed[:64].clone().view(torch.int32)
    for field, value, message in (
        (2, 2, "its header and K=256"),  # Q4_K bytes named Q6_K
        (2, 7, "unknown K-quant type"),
        (0, 0, "not a K-quant weight's header"),
    ):
        damaged = packed.clone()
        changed = header.clone()
        changed[field] = value
        damaged[:64] = changed.view(torch.uint8)
        with pytest.raises(RuntimeError, match=message):
            native.kquant_linear(torch.randn(2, 256), damaged, 16, 0)
    with pytest.raises(RuntimeError, match="expected a contiguous fp32 output"):
        native.kquant_linear(torch.randn(2, 256), packed, 17, 0)  # a row count the header does not say


def header_types(packed: torch.Tensor) -> list[str]:
    fields = packed[:64].view(torch.int32).tolist()
    return [kquant_groups.KERNEL_TYPES[fields[2 + 2 * i]] for i in range(fields[1])]


@needs_avx2
def test_rows_in_eights_are_regrouped_with_the_same_numbers_and_others_kept_as_the_file_has_them():
    """K-quant parts are regrouped by eight rows (four codes of eight rows a vector) when every part's rows
    come in eights; the regrouped bytes hold the file's numbers: the fp32 loop, which puts the file's layout
    back, matches gguf-py's product, and a weight with a part in other counts keeps the file's layout."""
    assert native.available() is None  # loads the operators
    grouped = concat_rows([weight("Q4_K", 16, 512, 1)[0], weight("Q6_K", 8, 512, 2)[0], weight("Q5_K", 8, 512, 3)[0]])
    assert header_types(matmul_paths.pack_kquant(grouped)) == ["Q4_Kx8", "Q6_Kx8", "Q5_Kx8"]
    kept = concat_rows([weight("Q4_K", 16, 512, 1)[0], weight("Q6_K", 12, 512, 2)[0]])
    assert header_types(matmul_paths.pack_kquant(kept)) == ["Q4_K", "Q6_K"]
    x = torch.randn(3, 512)
    expected = x.double() @ grouped.dequantize().double().t()
    assert torch.allclose(kernel(grouped, "fp32")(x).double(), expected, rtol=0, atol=1e-4 * expected.abs().max())
    # a regrouped part the header places off a group of eight is refused, not read across groups
    packed = matmul_paths.pack_kquant(weight("Q4_K", 16, 256)[0])
    fields = packed[:64].view(torch.int32).clone()
    fields[3] = 12
    damaged = torch.cat([fields.view(torch.uint8), packed[64 : 64 + 12 * 148]])
    with pytest.raises(RuntimeError, match="groups? of 8 rows"):
        native.kquant_linear(torch.randn(1, 256), damaged, 12, 0)
    # the load-time regrouping refuses rows not in eights and an output of the wrong size, with the reason
    rows = torch.from_numpy(random_blocks("Q4_K", 12, 256))
    with pytest.raises(RuntimeError, match="N in eights"):
        native.kquant_regroup(rows, 3, torch.empty(12 * 148, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="out must be contiguous uint8 of 1184 bytes"):
        native.kquant_regroup(rows[:8], 3, torch.empty(1000, dtype=torch.uint8))


# ---- a Llama GGUF of K-quant linears, through the loader ------------------------------------------------

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 768, 4, 2, 2
SHAPE_KEYS = {
    "llama.block_count": LAYERS,
    "llama.embedding_length": HIDDEN,
    "llama.feed_forward_length": FFN,
    "llama.attention.head_count": HEADS,
    "llama.attention.head_count_kv": KV_HEADS,
    "llama.rope.dimension_count": HIDDEN // HEADS,
    "llama.context_length": 512,
}
# typical |w| ~ 0.05 from random codes and scales: Q4_K's d*sc*q reaches ~1000 d, Q6_K's d*sc*(q-32) ~4000 d
D = {"Q4_K": 2e-4, "Q6_K": 5e-5}


def write_kquant_llama(path) -> None:
    """A 2-layer Llama in Q4_K_M's types: Q4_K everywhere but layer 0's attn_v and ffn_down and the output
    (Q6_K), so layer 0's fused q|k|v holds both types; the embedded model's tokenizer; random weights."""
    source = GGUFReader(str(gguf_loader.embedded_model_path()))
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    writer = GGUFWriter(str(path), "llama")
    for field in source.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in SHAPE_KEYS:
            continue
        sub_type = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    for key, value in SHAPE_KEYS.items():
        writer.add_uint32(key, value)
    seed = iter(range(100, 200))

    def add(name, kind, rows, cols):
        blocks = random_blocks(kind, rows, cols, next(seed), D[kind])
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=GGMLQuantizationType[kind])

    add("token_embd.weight", "Q4_K", vocab, HIDDEN)
    add("output.weight", "Q6_K", vocab, HIDDEN)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    kv = HIDDEN // HEADS * KV_HEADS
    for i in range(LAYERS):
        six = "Q6_K" if i == 0 else "Q4_K"
        for name, kind, rows, cols in (
            ("attn_q", "Q4_K", HIDDEN, HIDDEN),
            ("attn_k", "Q4_K", kv, HIDDEN),
            ("attn_v", six, kv, HIDDEN),
            ("attn_output", "Q4_K", HIDDEN, HIDDEN),
            ("ffn_gate", "Q4_K", FFN, HIDDEN),
            ("ffn_up", "Q4_K", FFN, HIDDEN),
            ("ffn_down", six, HIDDEN, FFN),
        ):
            add(f"blk.{i}.{name}.weight", kind, rows, cols)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("kquant") / "tiny-q4_k_m.gguf"
    write_kquant_llama(path)
    return path


@pytest.mark.slow
@needs_avx2
def test_a_q4_k_m_gguf_runs_its_own_blocks_and_answers_as_its_fp32_dequantization(kquant_gguf):
    native_model = load_model(str(kquant_gguf), quantization="auto")
    reference = load_model(str(kquant_gguf), quantization="none")
    assert native_model.quant.dequantized_note is None  # no "have no native kernel: dequantized"
    assert native_model.quant.mode == "Q4_K/Q6_K"
    layers = {name: m for name, m in native_model.model.named_modules() if isinstance(m, QuantLinear)}
    assert len(layers) == 4 * LAYERS + 1  # qkv, o, gate_up, down per layer + the head
    assert all(isinstance(m.kernel_for(1), matmul_paths.KQuantNative) for m in layers.values())
    assert layers["layers.0.self_attn.qkv_proj"].format == "Q4_K+Q6_K"  # fused as stored, not in floats
    assert layers["lm_head"].format == "Q6_K"
    ids = native_model.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then it rests.")
    ref = torch.cat(forward_prefills(reference, [ids])).log_softmax(-1)
    got = torch.cat(forward_prefills(native_model, [ids])).log_softmax(-1)
    kl = (ref.exp() * (ref - got)).sum(-1)
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert kl.mean() < 0.02 and top1 > 0.90  # the default 4-bit GGUF's tolerance (test_quant_engine.py)
    assert torch.equal(
        native_model.model.embed_tokens(torch.tensor(ids)), reference.model.embed_tokens(torch.tensor(ids))
    )  # the Q4_K table's rows, exactly
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = []
    for loaded in (native_model, reference):
        engine = make_engine(loaded, num_blocks=16)
        engine.add_request("a", prompt_token_ids=ids, params=greedy)
        tokens.append(run(engine)["a"].outputs[0].token_ids)
    assert tokens[0] == tokens[1]


@pytest.mark.slow
@needs_avx2
@pytest.mark.parametrize("acts", matmul_paths.NATIVE_ACTS)
def test_the_native_decode_step_runs_k_quant_products_as_the_eager_layers_do(kquant_gguf, acts):
    """Every layer's products on the K-quant kernel (layer 0's q|k|v of two types in one weight) inside the
    native decode step: the eager layers' logits, up to the last bits of norm, rotary and SiLU."""
    loaded = load_model(str(kquant_gguf), quantization=QuantConfig("auto", kernel=acts), max_model_len=256)
    step = NativeDecodeStep.for_model(loaded.model)
    assert step is not None
    engine = make_engine(loaded, max_num_seqs=4, block_size=16, num_blocks=64)
    rng = random.Random(0)
    for rows in (1, 3, 4):
        works = random_decode_works(rng, rows, engine.block_manager.num_blocks, max_width=6)
        assert step.kinds(rows) == [4 + list(matmul_paths.NATIVE_ACTS).index(acts)] * 4 * LAYERS
        eager = engine.runner.execute(works, [])
        loaded.model.native_step = step
        try:
            native_logits = engine.runner.execute(works, [])
        finally:
            loaded.model.native_step = None
        torch.testing.assert_close(native_logits, eager, atol=2e-4 * eager.abs().max().item(), rtol=0)
