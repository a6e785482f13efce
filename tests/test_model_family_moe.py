"""Mixtures of experts (Qwen3-MoE, Mixtral) against transformers' own `Qwen3MoeForCausalLM` /
`MixtralForCausalLM` (the oracle), and the grouped expert product (model/moe.py) against a per-token one.

Each variant is a tiny random checkpoint built from transformers' config class (8 experts, top 2), saved with
the embedded tokenizer and loaded through our loader: fp32 hidden states and logits at every position within
1e-4 of HF's, 32 greedy tokens equal to HF `generate` alone, batched and through preemption, and the same
through a GGUF file written with gguf-py from the same weights (stacked expert tensors, as llama.cpp writes).
"""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from test_model_families import (
    ATOL,
    PROMPTS,
    assert_greedy_matches_hf,
    assert_native_step_matches,
    assert_parity,
    finish_gguf,
    fp32_kernel,
    greedy_through_engine,
    hf_greedy,
    native_step_on,
    report,
    save_tiny,
)

from engine_utils import make_engine, random_decode_works
from minivllm.loader import load_model
from minivllm.model.moe import Expert, SparseMoE, grouped_experts, route

EXPERTS, TOP_K = 8, 2

# kwargs of the transformers config class: Qwen3-MoE with and without renormalised top-k weights, one with a
# dense layer between sparse ones (`mlp_only_layers`), and Mixtral
VARIANTS = {
    "qwen3-moe-norm-topk": ("Qwen3Moe", dict(norm_topk_prob=True)),
    "qwen3-moe-dense-layer-1": ("Qwen3Moe", dict(norm_topk_prob=False, mlp_only_layers=[1])),
    "mixtral": ("Mixtral", dict(num_local_experts=EXPERTS, intermediate_size=64)),
}


def make_tiny_moe(kind: str, directory, tokenizer, seed: int = 0, **overrides):
    """A random `transformers` Qwen3-MoE / Mixtral with the embedded tokenizer's vocabulary, saved to
    `directory` and returned."""
    import transformers

    torch.manual_seed(seed)
    experts = dict(num_experts=EXPERTS, moe_intermediate_size=64) if kind == "Qwen3Moe" else {}
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=overrides.pop("intermediate_size", 160),
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.1,  # peakier logits and routing than HF's 0.02: fewer near-ties
        num_experts_per_tok=TOP_K,
        bos_token_id=1,
        eos_token_id=2,
        **experts,
        **overrides,
    )
    return save_tiny(getattr(transformers, f"{kind}ForCausalLM")(config).eval(), directory, tokenizer)


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory, embedded_tokenizer):
    kind, overrides = VARIANTS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_moe(kind, directory, embedded_tokenizer, seed=len(request.param), **overrides)
    return request.param, hf, load_model(str(directory), dtype="float32", device="cpu")


def test_config_read_from_checkpoint(pair):
    name, hf, loaded = pair
    cfg = loaded.config
    assert cfg.family == hf.config.model_type
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (EXPERTS, TOP_K)
    assert cfg.moe_layers == ((0, 2) if "dense" in name else (0, 1, 2))
    assert cfg.norm_topk_prob == (name != "qwen3-moe-dense-layer-1")
    assert cfg.num_parameters == sum(p.numel() for p in hf.parameters())
    dense = [i for i, layer in enumerate(loaded.model.layers) if not isinstance(layer.mlp, SparseMoE)]
    assert dense == ([1] if "dense" in name else [])


def test_hidden_states_and_logits_match_hf(pair, capsys):
    name, hf, loaded = pair
    hidden, logits = assert_parity(loaded, hf, name)
    report(capsys, f"{name}: max abs diff hidden states {hidden:.2e}, logits {logits:.2e} (atol {ATOL})")


def test_greedy_matches_hf_alone_batched_and_preempted(pair):
    name, hf, loaded = pair
    assert_greedy_matches_hf(loaded, hf, name)


def test_steps_report_experts_touched(pair):
    """Every StepFinished of a MoE model counts the distinct experts its forward ran, summed over the MoE
    layers: at least top-k a layer, at most all of them."""
    from minivllm.events import types as ev

    name, _, loaded = pair
    _, log = greedy_through_engine(loaded, PROMPTS)
    counts = [e.experts_touched for e in log.of(ev.StepFinished)]
    layers = len(loaded.config.moe_layers)
    assert counts and all(TOP_K * layers <= c <= EXPERTS * layers for c in counts), counts


def test_native_step_serves_moe_layers(pair):
    """The C++ decode step routes each row and runs every chosen expert's products once on the rows that chose
    it, inside its one call: greedy tokens equal to the eager layers' and HF's, logits within ATOL of eager's."""
    from minivllm.model.native_step import native_blocker

    name, hf, loaded = pair
    assert native_blocker(loaded.model) is None
    assert_native_step_matches(loaded, hf, name)


def test_native_moe_steps_report_experts_touched(pair):
    """The native call counts the experts each MoE layer ran: the eager bounds hold for its steps too."""
    from minivllm.events import types as ev

    name, _, loaded = pair
    with native_step_on(loaded) as calls:
        _, log = greedy_through_engine(loaded, PROMPTS)
    assert calls, f"{name}: no native decode step ran"
    layers = len(loaded.config.moe_layers)
    counts = [e.experts_touched for e in log.of(ev.StepFinished)]
    assert all(TOP_K * layers <= c <= EXPERTS * layers for c in counts), counts


def test_native_expert_product_equals_the_python_one(pair):
    """Where our kernels run every expert's products, the block is one C++ call (`moe_experts`): its output and
    experts-touched count equal the Python grouped product's within float rounding (MKL's products there, ours
    here; the router and SiLU round in their own last bits)."""
    from minivllm.kernels.cpu import native

    if native.available() is not None:
        pytest.skip(f"the native kernels are not built here: {native.available()}")
    name, _, loaded = pair
    block = next(layer.mlp for layer in loaded.model.layers if isinstance(layer.mlp, SparseMoE))
    x = torch.randn(37, loaded.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with fp32_kernel(block, ours=False):
        assert block.native_experts(x) is None
        python_out, python_touched = block(x), block.touched
    with fp32_kernel(block, ours=True):
        assert block.native_experts(x) is not None
        native_out = block(x)
    assert block.touched == python_touched > TOP_K
    torch.testing.assert_close(native_out, python_out, atol=1e-5, rtol=0)


def test_malformed_moe_arguments_are_named_before_anything_runs(pair):
    """A top-k beyond the experts, or an expert weight missing, is an error that names it, raised before the
    call writes any K/V."""
    name, _, loaded = pair
    engine = make_engine(loaded, max_num_seqs=4, num_blocks=32)
    works = random_decode_works(random.Random(4), 2, 32, max_width=2, vocab=loaded.config.vocab_size)
    pools = [pool.clone() for pool in (*engine.kv_cache.k, *engine.kv_cache.v)]
    with native_step_on(loaded):
        step = loaded.model.native_step
        step.top_k = EXPERTS + 1
        with pytest.raises(RuntimeError, match=f"top_k must be within 1..{EXPERTS}, got {EXPERTS + 1}"):
            engine.runner.execute(works, [])
        step.top_k, whole = TOP_K, step.experts[0]
        step.experts[0] = whole[1:]
        with pytest.raises(RuntimeError, match="2 x E weights per MoE layer"):
            engine.runner.execute(works, [])
        step.experts[0] = whole
    assert all(torch.equal(a, b) for a, b in zip(pools, (*engine.kv_cache.k, *engine.kv_cache.v)))


@pytest.mark.parametrize("ours", [True, False], ids=["our-fp32-kernel", "mkl"])
def test_moe_models_get_no_compiled_step_and_run_eagerly_only_without_a_native_step(pair, capsys, ours):
    """No compiled step or CUDA graph serves MoE layers (data-dependent expert groups): the native step takes
    the decode steps where its kernels run the products, else one line says the steps run eagerly."""
    from minivllm.model.compiled import use_compilation

    name, _, loaded = pair
    with fp32_kernel(loaded.model, ours):
        capsys.readouterr()
        try:
            use_compilation(loaded.model, "cpu", enforce_eager=False)
            lines = [line for line in capsys.readouterr().err.splitlines() if "run eagerly" in line]
            assert (loaded.model.native_step is not None) == ours
            assert len(lines) == (0 if ours else 1) and all("mixture-of-experts" in line for line in lines)
            assert not loaded.model.may_compile and not loaded.model.may_capture
            assert "mixture-of-experts" in loaded.model.compilation()
        finally:
            loaded.model.native_step = None


def test_int4_experts_are_quantized_linears(tmp_path, embedded_tokenizer):
    """--quantization int4 puts every expert's products into QuantLinear (the router stays in floats), and
    the greedy tokens still come out (a smoke test: 4-bit rounding may change them)."""
    from minivllm.quant.linear import QuantLinear

    make_tiny_moe("Qwen3Moe", tmp_path, embedded_tokenizer, norm_topk_prob=True)
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu", quantization="int4")
    block = loaded.model.layers[0].mlp
    assert all(isinstance(p, QuantLinear) for e in block.experts for p in (e.gate_up_proj, e.down_proj))
    assert not isinstance(block.gate, QuantLinear)
    tokens, _ = greedy_through_engine(loaded, PROMPTS[:1])
    assert len(tokens["r0"]) == 32


def test_unsupported_architecture_lists_the_moe_families(tmp_path):
    from transformers import GPTNeoXConfig

    from minivllm.loader import UnsupportedModelError

    GPTNeoXConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=100, intermediate_size=64
    ).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="Qwen3MoeForCausalLM.*MixtralForCausalLM"):
        load_model(str(tmp_path), device="cpu")


# ---- the grouped product ---------------------------------------------------------------------------------


def per_token_reference(x, weights, chosen, experts):
    """Each token through each of its chosen experts, one at a time."""
    return torch.stack(
        [sum(w * experts[int(e)](x[t : t + 1])[0] for w, e in zip(weights[t], chosen[t])) for t in range(len(x))]
    )


def test_grouped_product_equals_per_token_and_reads_each_expert_once():
    torch.manual_seed(0)
    experts = torch.nn.ModuleList(Expert(32, 24) for _ in range(EXPERTS))
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(37, 32)
    weights, chosen = route(torch.randn(37, EXPERTS), TOP_K, renormalize=False)
    calls = [0] * EXPERTS
    for e, expert in enumerate(experts):
        expert.register_forward_hook(lambda *_, e=e: calls.__setitem__(e, calls[e] + 1))
    with torch.no_grad():
        out, touched = grouped_experts(x, weights, chosen, experts)
        grouped_calls = list(calls)
        reference = per_token_reference(x, weights, chosen, experts)
    active = set(chosen.flatten().tolist())
    assert touched == len(active)
    assert grouped_calls == [1 if e in active else 0 for e in range(EXPERTS)]  # once each, 37 rows x 2 slots
    assert sum(calls) - sum(grouped_calls) == 37 * TOP_K  # the reference's: once per (token, slot)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_grouped_product_skips_unchosen_experts():
    experts = torch.nn.ModuleList(Expert(16, 8) for _ in range(4))
    x = torch.randn(5, 16)
    chosen = torch.tensor([[3, 1]] * 5)
    weights = torch.full((5, 2), 0.5)
    with torch.no_grad():
        out, touched = grouped_experts(x, weights, chosen, experts)
    assert touched == 2
    torch.testing.assert_close(out, per_token_reference(x, weights, chosen, experts))


def test_route_renormalises_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, chosen = route(logits, 2, renormalize=True)
    assert chosen.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, torch.softmax(logits[:, :2], dim=-1))  # Mixtral's softmax over the top-k
    plain, _ = route(logits, 2, renormalize=False)
    torch.testing.assert_close(plain, torch.softmax(logits, dim=-1)[:, :2])


# ---- the same weights through a GGUF file (llama.cpp's `qwen3moe` layout: stacked experts) ---------------

GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def q8_0(array: np.ndarray) -> np.ndarray:
    """An expert stack in Q8_0 blocks, as gguf-py quantizes it (its bytes; the writer takes the raw type)."""
    from gguf import GGMLQuantizationType, quants

    return quants.quantize(array.astype(np.float32), GGMLQuantizationType.Q8_0)


def qwen3moe_gguf_tensors(hf, dtype=np.float32, experts=None, permute=None):
    """(GGUF name, array) of every weight; each layer's experts stacked [experts, rows, cols] per product
    (HF holds them stacked too, gate|up fused: `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`)."""
    for name, tensor in hf.state_dict().items():
        array = tensor.detach().float().numpy()
        if name in GLOBAL_NAMES:
            yield GLOBAL_NAMES[name], array
            continue
        _, _, layer, *module, kind = name.split(".")
        if module == ["mlp", "experts"] and kind == "gate_up_proj":
            gate, up = np.split(array, 2, axis=1)
            yield f"blk.{layer}.ffn_gate_exps.weight", (experts or dtype)(gate)
            yield f"blk.{layer}.ffn_up_exps.weight", (experts or dtype)(up)
        elif module == ["mlp", "experts"]:
            yield f"blk.{layer}.ffn_down_exps.weight", (experts or dtype)(array)
        else:
            if permute is not None and module[-1] in ("q_proj", "k_proj"):  # llama.cpp's rotary row order
                array = permute(array, module[-1])
            yield f"blk.{layer}.{GGUF_NAMES['.'.join(module)]}.{kind}", array if "norm" in name else array.astype(dtype)


def write_qwen3moe_gguf(hf, path, tokenizer_source, dtype=np.float32, experts=None) -> None:
    """`experts`: a function making the stacked experts' arrays (default: `dtype`)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from minivllm.bench.random_gguf import add_tokenizer_fields

    cfg = hf.config
    writer = GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    add_tokenizer_fields(writer, tokenizer_source)
    for name, array in qwen3moe_gguf_tensors(hf, dtype, experts):
        quantized = array.dtype == np.uint8
        writer.add_tensor(name, array, raw_dtype=GGMLQuantizationType.Q8_0 if quantized else None)
    finish_gguf(writer, [])


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory, embedded_tokenizer):
    """llama.cpp's qwen3moe renormalises the top-k weights: the HF oracle has norm_topk_prob."""
    directory = tmp_path_factory.mktemp("qwen3moe-gguf")
    return make_tiny_moe("Qwen3Moe", directory / "hf", embedded_tokenizer, seed=5, norm_topk_prob=True), directory


def test_gguf_of_the_same_weights_matches_hf(gguf_pair, embedded_path, capsys):
    hf, directory = gguf_pair
    path = directory / "qwen3moe.gguf"
    write_qwen3moe_gguf(hf, path, embedded_path)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    cfg = loaded.config
    assert (cfg.family, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        "qwen3_moe",
        EXPERTS,
        TOP_K,
        64,
    )
    assert cfg.norm_topk_prob and cfg.moe_layers == (0, 1, 2)
    hidden, logits = assert_parity(loaded, hf, "qwen3moe GGUF")
    report(capsys, f"qwen3moe GGUF: max abs diff hidden states {hidden:.2e}, logits {logits:.2e} (atol {ATOL})")
    assert_greedy_matches_hf(loaded, hf, "qwen3moe GGUF")


def test_gguf_f16_experts_load_per_expert(gguf_pair, embedded_path):
    """F16 stacked experts, sliced per expert at load: each expert's weight equals HF's, rounded to fp16."""
    hf, directory = gguf_pair
    path = directory / "qwen3moe-f16.gguf"
    write_qwen3moe_gguf(hf, path, embedded_path, dtype=np.float16)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    ours = loaded.model.layers[2].mlp.experts[5]
    gate_up = hf.model.layers[2].mlp.experts.gate_up_proj[5]
    torch.testing.assert_close(ours.gate_up_proj.weight, gate_up.half().float())
    rounded = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if "norm" not in name:  # the writer keeps norms in F32
                p.copy_(p.half().float())
    tokens, _ = greedy_through_engine(loaded, PROMPTS[:1])
    assert tokens["r0"] == hf_greedy(rounded, PROMPTS[0])


def test_gguf_q8_0_stacked_experts_become_quantized_linears(gguf_pair, embedded_path):
    """Q8_0 stacked experts are sliced per expert in their blocks (no floats between): every expert's products
    are QuantLinear, and expert e's weight is rows e*I..(e+1)*I of the stack as gguf-py dequantizes it."""
    from gguf import GGMLQuantizationType, quants

    from minivllm.quant.linear import QuantLinear

    hf, directory = gguf_pair
    path = directory / "qwen3moe-q8_0.gguf"
    write_qwen3moe_gguf(hf, path, embedded_path, experts=q8_0)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    down = hf.model.layers[1].mlp.experts.down_proj.detach().numpy()  # [experts, hidden, intermediate]
    stack = quants.dequantize(q8_0(down), GGMLQuantizationType.Q8_0)
    for e, expert in enumerate(loaded.model.layers[1].mlp.experts):
        assert isinstance(expert.gate_up_proj, QuantLinear) and isinstance(expert.down_proj, QuantLinear)
        assert expert.down_proj.format.startswith("int8")
        with torch.no_grad():  # the product with the identity: the weight, transposed (activations rounded)
            weight = expert.down_proj(torch.eye(expert.down_proj.in_features)).T
        torch.testing.assert_close(weight, torch.from_numpy(stack[e]), atol=2e-3, rtol=0.02)
    tokens, _ = greedy_through_engine(loaded, PROMPTS[:1])
    assert len(tokens["r0"]) == 32


def write_mixtral_gguf(hf, path, tokenizer_source) -> None:
    """Mixtral as llama.cpp's converter writes it: architecture `llama`, Q/K rows permuted, stacked experts."""
    from gguf import GGUFWriter
    from test_model_family_mistral import llama_cpp_permute

    from minivllm.bench.random_gguf import add_tokenizer_fields

    cfg = hf.config
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("Mixtral-Tiny")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_expert_count(cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    add_tokenizer_fields(writer, tokenizer_source)
    permute = lambda array, product: llama_cpp_permute(torch.from_numpy(array), heads[product]).numpy()  # noqa: E731
    finish_gguf(writer, qwen3moe_gguf_tensors(hf, permute=permute))


def test_mixtral_gguf_of_the_same_weights_matches_hf(tmp_path, embedded_tokenizer, embedded_path, capsys):
    """A `llama` GGUF with expert tensors loads as Mixtral (Q/K rows un-permuted, top-k renormalised)."""
    kind, overrides = VARIANTS["mixtral"]
    hf = make_tiny_moe(kind, tmp_path / "hf", embedded_tokenizer, seed=11, **overrides)
    path = tmp_path / "mixtral.gguf"
    write_mixtral_gguf(hf, path, embedded_path)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    cfg = loaded.config
    assert (cfg.family, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (
        "mixtral",
        EXPERTS,
        TOP_K,
        True,
    )
    hidden, logits = assert_parity(loaded, hf, "mixtral GGUF")
    report(capsys, f"mixtral GGUF: max abs diff hidden states {hidden:.2e}, logits {logits:.2e} (atol {ATOL})")
    tokens, _ = greedy_through_engine(loaded, PROMPTS)
    assert tokens == {f"r{i}": hf_greedy(hf, p) for i, p in enumerate(PROMPTS)}


def test_streamed_bytes_count_the_experts_a_step_is_expected_to_read(pair):
    """One row reads top-k of the experts; many rows nearly all of them (uniform routing's expectation)."""
    from minivllm.loader.install_quantized import expected_expert_share, streamed_bytes
    from minivllm.quant.formats import weight_bytes

    _, _, loaded = pair
    model = loaded.model
    experts = sum(weight_bytes(p) for block in model.moe_blocks for p in block.experts.parameters())
    dense = sum(weight_bytes(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)) - experts
    assert expected_expert_share(EXPERTS, TOP_K, 1) == TOP_K / EXPERTS
    for rows in (1, 4, 64):
        share = expected_expert_share(EXPERTS, TOP_K, rows)
        assert streamed_bytes(model, rows) == pytest.approx(dense + share * experts, rel=1e-6)


def test_random_qwen3_30b_a3b_shape_is_consistent():
    """The `random:qwen3-30b-a3b-2l` shape (bench throughput): every tensor has a shape, and they add up to
    the config's parameter count (the draws themselves are too large for a test)."""
    import math

    from minivllm.loader.random_shapes import _hf_shapes, random_config
    from minivllm.loader.weights import hf_tensor_names

    cfg = random_config("qwen3-30b-a3b-2l")
    shape = _hf_shapes(cfg)
    names = hf_tensor_names(cfg)
    assert shape("model.layers.1.mlp.gate.weight") == (128, 2048)
    assert shape("model.layers.1.mlp.experts.127.down_proj.weight") == (2048, 768)
    assert sum(math.prod(shape(n)) for n in names) == cfg.num_parameters


def test_q8_0_experts_run_on_our_int8_kernels_inside_the_native_calls(gguf_pair, embedded_path):
    """Q8_0 experts in the C++ calls, their fp16 block scales passed beside their codes: the block's one call
    (`moe_experts`) equals the Python grouped product (the same int8 kernels, expert by expert), the native
    decode step runs every decode step with the eager layers' greedy tokens, and an expert's missing scales are
    named before the step writes any K/V."""
    from minivllm.kernels.cpu import native
    from minivllm.model.native_products import INT8_KINDS

    if native.available() is not None:
        pytest.skip(f"the native kernels are not built here: {native.available()}")
    hf, directory = gguf_pair
    path = directory / "qwen3moe-q8_0-native.gguf"
    write_qwen3moe_gguf(hf, path, embedded_path, experts=q8_0)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    block = loaded.model.layers[0].mlp
    x = torch.randn(37, loaded.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with fp32_kernel(block, ours=True), torch.no_grad():
        plan = block.native_experts(x)
        assert plan is not None and set(plan.kinds) <= set(INT8_KINDS.values()), plan and plan.kinds
        assert all(s.dtype == torch.float16 and s.numel() for s in (*plan.gate_up_scales, *plan.down_scales))
        native_out, native_touched = block(x), block.touched
        python_out, python_touched = grouped_experts(x, *route(block.gate(x), TOP_K, True), block.experts)
    assert native_touched == python_touched > TOP_K
    torch.testing.assert_close(native_out, python_out, atol=1e-5, rtol=0)

    eager, _ = greedy_through_engine(loaded, PROMPTS)
    with native_step_on(loaded) as calls:
        tokens, _ = greedy_through_engine(loaded, PROMPTS)
        assert len(calls) >= 31, f"only {len(calls)} native decode steps"
        engine = make_engine(loaded, max_num_seqs=4, num_blocks=32)
        works = random_decode_works(random.Random(4), 2, 32, max_width=2, vocab=loaded.config.vocab_size)
        pools = [pool.clone() for pool in (*engine.kv_cache.k, *engine.kv_cache.v)]
        step = loaded.model.native_step
        whole = step.expert_scales[1]
        step.expert_scales[1] = (torch.empty(0), *whole[1:])
        with pytest.raises(RuntimeError, match="layer 1, expert 0: gate/up's int8 weight needs its scales"):
            engine.runner.execute(works, [])
        step.expert_scales[1] = whole
    assert tokens == eager, "native greedy tokens differ from the eager layers'"
    assert all(torch.equal(a, b) for a, b in zip(pools, (*engine.kv_cache.k, *engine.kv_cache.v)))


def test_experts_run_at_once_give_the_bits_of_experts_run_in_turn(pair):
    """With at least two active experts a thread, each thread takes whole experts (the kernels' loops then run on
    that thread alone); one thread runs them in turn. Each output is one thread's whole sum either way: the same
    bits, and the same experts touched."""
    from minivllm.kernels.cpu import native

    if native.available() is not None:
        pytest.skip(f"the native kernels are not built here: {native.available()}")
    _, _, loaded = pair
    block = next(layer.mlp for layer in loaded.model.layers if isinstance(layer.mlp, SparseMoE))
    x = torch.randn(16, loaded.config.hidden_size, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    with fp32_kernel(block, ours=True), torch.no_grad():
        try:
            torch.set_num_threads(2)
            at_once, touched = block(x), block.touched
            torch.set_num_threads(1)
            in_turn = block(x)
        finally:
            torch.set_num_threads(threads)
    assert touched >= 4, f"only {touched} experts ran: the parallel path needs two a thread"
    assert block.touched == touched and torch.equal(at_once, in_turn)
