"""The Qwen2/2.5 and Qwen3 families against transformers' own `Qwen2ForCausalLM` / `Qwen3ForCausalLM` (the oracle).

Each variant is a tiny random checkpoint built from transformers' config class, saved with the embedded
tokenizer and loaded through our loader: fp32 hidden states after every layer and logits at every position
within 1e-4 of HF's, 32 greedy tokens through our engine equal to HF `generate`, the same in a batch as
alone and through preemption, and the same through a GGUF file written with gguf-py from the same weights.
Biases and norms are randomised (HF initialises them to 0 and 1), so a missing or misplaced piece shows.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from test_model_parity import hf_forward, our_forward

from engine_utils import EventLog, assert_all_blocks_free, make_engine, random_decode_works, run
from minivllm.events import types as ev
from minivllm.loader import UnsupportedModelError, load_model
from minivllm.sampling.params import SamplingParams

ATOL = 1e-4
GREEDY_TOKENS = 32
PROMPTS = [[1, 17, 42, 99, 7], [1, 3, 3, 3], [1, 88, 12, 64, 23, 101, 45, 9, 77, 5, 6, 120, 31]]

# kwargs of the transformers config class; head_dim 32 in Qwen3 is not hidden/heads (16), as in real Qwen3s
VARIANTS = {
    "qwen2-untied": ("Qwen2", dict(tie_word_embeddings=False)),
    "qwen2.5-tied": ("Qwen2", dict(tie_word_embeddings=True)),
    "qwen3-tied-head-dim-32": ("Qwen3", dict(tie_word_embeddings=True, head_dim=32)),
    "qwen3-attention-bias-untied": ("Qwen3", dict(tie_word_embeddings=False, attention_bias=True)),
}


def save_tiny(model, directory, tokenizer, norms: tuple[float, float] = (0.5, 1.5)):
    """Norm weights drawn from `norms` (HF's constant init would hide a misplaced norm), then the model and
    the tokenizer saved to `directory`; returns the model."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(*norms)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


def finish_gguf(writer, tensors) -> None:
    """Adds (GGUF name, array) pairs, then writes the file and closes it."""
    for name, array in tensors:
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def make_tiny(kind: str, directory, tokenizer, seed: int = 0, **overrides):
    """A random `transformers` Qwen2/Qwen3 model with the embedded tokenizer's vocabulary, saved to
    `directory` (config.json, safetensors, tokenizer) and returned."""
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.1,  # peakier logits than HF's 0.02: fewer near-ties in greedy decoding
        bos_token_id=1,
        eos_token_id=2,
        **overrides,
    )
    model = getattr(transformers, f"{kind}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory, embedded_tokenizer):
    kind, overrides = VARIANTS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_tiny(kind, directory, embedded_tokenizer, seed=len(request.param), **overrides)
    return request.param, hf, load_model(str(directory), dtype="float32", device="cpu"), directory


def hf_greedy(hf, prompt: list[int], max_new: int = GREEDY_TOKENS) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def greedy_through_engine(loaded, prompts, **config) -> tuple[dict[str, list[int]], EventLog]:
    engine = make_engine(loaded, **config)
    log = EventLog(engine)
    for i, prompt in enumerate(prompts):
        engine.add_request(
            f"r{i}",
            prompt_token_ids=prompt,
            params=SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True),
        )
    done = run(engine)
    assert_all_blocks_free(engine)
    return {rid: out.outputs[0].token_ids for rid, out in done.items()}, log


def assert_parity(loaded, hf, name: str, lengths=(150, 37)) -> tuple[float, float]:
    """Every layer's hidden states and the logits at every position within ATOL of HF's, the sequences
    (each no longer than the loaded context) in one flattened pass; returns the worst differences."""
    limit = loaded.model.rotary.cos.shape[0]  # the length the model was loaded for
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, loaded.config.vocab_size, (min(n, limit),), generator=gen).tolist() for n in lengths]
    worst_hidden = worst_logits = 0.0
    for ids, (states, logits) in zip(sequences, our_forward(loaded, sequences)):
        ref_states, ref_logits = hf_forward(hf, ids)
        assert len(states) == len(ref_states)
        for i, (a, b) in enumerate(zip(states, ref_states)):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=lambda m: f"{name} hidden state {i}: {m}")
            worst_hidden = max(worst_hidden, (a - b).abs().max().item())
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0, msg=lambda m: f"{name} logits: {m}")
        worst_logits = max(worst_logits, (logits - ref_logits).abs().max().item())
    return worst_hidden, worst_logits


def report(capsys, line: str) -> None:
    with capsys.disabled():
        print(f"\n[parity] {line}", flush=True)


def assert_greedy_matches_hf(loaded, hf, name: str) -> None:
    """32 greedy tokens through our engine equal to HF `generate`: each prompt alone, all batched, and
    batched through a pool so tight that sequences are preempted and recomputed."""
    expected = {f"r{i}": hf_greedy(hf, p) for i, p in enumerate(PROMPTS)}
    for i, prompt in enumerate(PROMPTS):
        alone, _ = greedy_through_engine(loaded, [prompt])
        assert alone["r0"] == expected[f"r{i}"], f"{name} prompt {i} alone differs from HF"
    batched, _ = greedy_through_engine(loaded, PROMPTS)
    assert batched == expected
    # 3 x (<=13 + 32) tokens in 4-token blocks need ~34 blocks: 16 forces preemption and recompute
    tight, log = greedy_through_engine(loaded, PROMPTS, num_blocks=16, block_size=4)
    assert any(e.preempted for e in log.of(ev.StepScheduled)), "the pool was never tight"
    assert tight == expected


def test_config_read_from_checkpoint(pair):
    name, hf, loaded, _ = pair
    cfg, hcfg = loaded.config, hf.config
    assert cfg.family == hcfg.model_type
    head_dim = getattr(hcfg, "head_dim", None) or hcfg.hidden_size // hcfg.num_attention_heads  # Qwen2 has none
    assert (cfg.head_dim, cfg.tie_word_embeddings) == (head_dim, hcfg.tie_word_embeddings)
    assert cfg.qkv_bias == (cfg.family == "qwen2" or hcfg.attention_bias)
    assert cfg.qk_norm == (cfg.family == "qwen3")
    assert cfg.num_parameters == sum(p.numel() for p in hf.parameters())  # HF counts a tied table once
    if cfg.tie_word_embeddings:
        assert loaded.model.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_hidden_states_and_logits_match_hf(pair, capsys):
    name, hf, loaded, _ = pair
    hidden, logits = assert_parity(loaded, hf, name)
    report(capsys, f"{name}: max abs diff hidden states {hidden:.2e}, logits {logits:.2e} (atol {ATOL})")


def test_greedy_matches_hf_alone_batched_and_preempted(pair):
    name, hf, loaded, _ = pair
    assert_greedy_matches_hf(loaded, hf, name)


def test_int4_serves_the_family(pair):
    """--quantization int4: the products in 4 bits, the biases and Q/K norms in floats beside them. The
    logits match HF's model holding the same rounded weights (what is left is the kernels' activation
    rounding), far closer than they are to the unrounded model's."""
    from minivllm.engine.scoring import forward_prefills
    from minivllm.quant.linear import QuantLinear

    name, hf, _, directory = pair
    int4 = load_model(str(directory), dtype="float32", device="cpu", quantization="int4")
    attention = int4.model.layers[0].self_attn
    assert isinstance(attention.qkv_proj, QuantLinear) and isinstance(attention.o_proj, QuantLinear)
    ids = list(range(3, 60))
    ours = forward_prefills(int4, [ids])[0]
    with torch.no_grad():
        unrounded = hf(torch.tensor([ids])).logits[0]
        rounded = hf_with_rounded_weights(hf)(torch.tensor([ids])).logits[0]
    to_rounded, to_unrounded = ((ours - ref).norm() / ref.norm() for ref in (rounded, unrounded))
    assert to_rounded < 0.03 and to_rounded < to_unrounded / 4, f"{name}: {to_rounded:.3f}, {to_unrounded:.3f}"


def hf_with_rounded_weights(hf):
    """A copy of the HF model with each weight rounded as `--quantization int4` rounds it: products to int4
    g32, the embedding and LM head to per-channel int8 (both per row: rounding q, k, v apart equals rounding
    them fused)."""
    import copy

    from minivllm.quant.formats import quantize_int4, quantize_int8

    rounded = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if name.endswith("_proj.weight"):
                p.copy_(quantize_int4(name, p.detach(), 32).dequantize())
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                p.copy_(quantize_int8(name, p.detach()).dequantize())
    return rounded


@contextlib.contextmanager
def fp32_kernel(module: torch.nn.Module, ours: bool):
    """Every fp32 product in `module` on our fp32 kernel (`ours`) or MKL for the duration, whichever won the
    timing at load."""
    from minivllm.model.packed_linear import PackedLinear

    products = [m for m in module.modules() if isinstance(m, PackedLinear)]
    before = [m.native for m in products]
    try:
        for m in products:
            m.native = ours
        yield
    finally:
        for m, native in zip(products, before):
            m.native = native


@contextlib.contextmanager
def native_step_on(loaded):
    """The model's native decode step for the duration, every product on our fp32 kernel (whichever won the
    timing at load); yields the row counts of the step's calls."""
    from minivllm.model.native_step import NativeDecodeStep

    calls: list[int] = []
    real = torch.ops.minivllm_native.decode_layers
    with fp32_kernel(loaded.model, ours=True):
        try:
            loaded.model.native_step = NativeDecodeStep.for_model(loaded.model)
            assert loaded.model.native_step is not None, f"{loaded.config.family}: no native step"
            torch.ops.minivllm_native.decode_layers = lambda *a: calls.append(a[0].shape[0]) or real(*a)
            yield calls
        finally:
            torch.ops.minivllm_native.decode_layers = real
            loaded.model.native_step = None


def assert_native_step_matches(loaded, hf, name: str, prompts=PROMPTS) -> None:
    """The native decode step serves the family: it runs every decode step, its greedy tokens over 32 steps
    equal the eager layers' and HF `generate`'s, and a batch of decode rows' logits are within ATOL of the
    eager layers' (which match HF's: test_hidden_states_and_logits_match_hf)."""
    from minivllm.kernels.cpu import native

    if native.available() is not None:
        pytest.skip(f"the native kernels are not built here: {native.available()}")
    eager, _ = greedy_through_engine(loaded, prompts)
    engine = make_engine(loaded, max_num_seqs=4, num_blocks=32)
    width = min(5, loaded.model.rotary.cos.shape[0] // 16)  # blocks of 16 within the loaded context
    works = random_decode_works(random.Random(3), 4, 32, max_width=width, vocab=loaded.config.vocab_size)
    eager_logits = engine.runner.execute(works, [])
    with native_step_on(loaded) as calls:
        tokens, _ = greedy_through_engine(loaded, prompts)
        assert calls and set(calls) <= set(range(1, len(prompts) + 1)), f"{name}: decode steps {calls}"
        assert len(calls) >= GREEDY_TOKENS - 1, f"{name}: only {len(calls)} native decode steps"
        native_logits = engine.runner.execute(works, [])
    assert tokens == eager, f"{name}: native greedy tokens differ from the eager layers'"
    assert tokens == {f"r{i}": hf_greedy(hf, p) for i, p in enumerate(prompts)}, f"{name}: differs from HF"
    torch.testing.assert_close(native_logits, eager_logits, atol=ATOL, rtol=0)


def test_native_step_serves_the_family(pair):
    """Qwen2's QKV bias, Qwen3's Q/K norms and an O bias, inside the C++ decode step."""
    name, hf, loaded, _ = pair
    assert_native_step_matches(loaded, hf, name)


def test_compiled_step_serves_the_family(tmp_path, embedded_tokenizer):
    """The compiled decode step compiles the layers as they are, biases and Q/K norms included: its
    greedy tokens equal HF's (Qwen3 with attention biases: every piece at once)."""
    from minivllm.model.compiled import CompiledLayers, graph_count, layers_per_graph

    hf = make_tiny("Qwen3", tmp_path, embedded_tokenizer, seed=7, head_dim=32, attention_bias=True)
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    loaded.model.compiled = CompiledLayers(layers_per_graph(len(loaded.model.layers)))
    before = graph_count()
    tokens, _ = greedy_through_engine(loaded, PROMPTS, max_num_seqs=4)
    assert loaded.model.compiled.active and loaded.model.compiled.steady, loaded.model.compiled.error
    assert graph_count() > before  # the decode steps ran compiled graphs
    assert tokens == {f"r{i}": hf_greedy(hf, p) for i, p in enumerate(PROMPTS)}


# ---- the same weights through a GGUF file ---------------------------------------------------------------

GGUF_LAYER_NAMES = {  # llama.cpp's tensor names (gguf-py's TENSOR_NAMES), written out here as the oracle
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name: str) -> str:
    if hf_name == "lm_head.weight":
        return "output.weight"
    if hf_name in ("model.embed_tokens.weight", "model.norm.weight"):
        return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[hf_name]
    _, _, layer, *module, kind = hf_name.split(".")
    return f"blk.{layer}.{GGUF_LAYER_NAMES['.'.join(module)]}.{kind}"


def untied_tensors(hf, gguf_name):
    """(GGUF name, fp32 array) of each weight, less a tied LM head."""
    tied = hf.config.tie_word_embeddings
    for name, tensor in hf.state_dict().items():
        if not (name == "lm_head.weight" and tied):
            yield gguf_name(name), tensor.detach().float().numpy()


def write_gguf(hf, path, tokenizer_source) -> None:
    """The HF model's weights in F32 as llama.cpp's converter lays out a Qwen2/Qwen3 file (Q/K rows not
    permuted: these families rotate the halves as HF does), with the embedded file's tokenizer fields."""
    from gguf import GGUFWriter

    from minivllm.bench.random_gguf import add_tokenizer_fields

    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = GGUFWriter(str(path), cfg.model_type)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    add_tokenizer_fields(writer, tokenizer_source)
    finish_gguf(writer, untied_tensors(hf, gguf_name))


def test_gguf_of_the_same_weights_matches_hf(pair, embedded_path, tmp_path, capsys):
    name, hf, _, _ = pair
    path = tmp_path / f"{name}.gguf"
    write_gguf(hf, path, embedded_path)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    assert (loaded.config.family, loaded.config.head_dim) == (
        hf.config.model_type,
        hf.config.head_dim if hf.config.model_type == "qwen3" else 16,
    )
    assert loaded.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert loaded.tokenizer is not None and len(loaded.tokenizer) == hf.config.vocab_size
    hidden, logits = assert_parity(loaded, hf, f"{name} (GGUF)")
    report(capsys, f"{name} (GGUF): max abs diff hidden states {hidden:.2e}, logits {logits:.2e} (atol {ATOL})")
    tokens, _ = greedy_through_engine(loaded, PROMPTS)
    assert tokens == {f"r{i}": hf_greedy(hf, p) for i, p in enumerate(PROMPTS)}


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    from transformers import GPTNeoXConfig

    GPTNeoXConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=100, intermediate_size=64
    ).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as info:
        load_model(str(tmp_path), device="cpu")
    message = str(info.value)
    assert "gpt_neox" in message
    for architecture in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert architecture in message


def test_stop_tokens_from_generation_config(tmp_path, embedded_tokenizer):
    """Qwen's chat checkpoints name <|im_end|> as a stop token in generation_config.json only."""
    import json

    make_tiny("Qwen2", tmp_path, embedded_tokenizer)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert load_model(str(tmp_path), device="cpu").config.eos_token_ids == (2, 7)


def test_sliding_window_caps_the_context_or_refuses(tmp_path, embedded_tokenizer, capsys):
    """A Qwen sliding window is served exactly by capping the context at it (within it, sliding-window
    attention is full attention); a longer max_model_len is refused."""
    hf = make_tiny(
        "Qwen2", tmp_path, embedded_tokenizer, use_sliding_window=True, sliding_window=64, max_window_layers=0
    )
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    assert (loaded.config.sliding_window, loaded.config.max_position_embeddings) == (64, 64)
    assert sum("sliding window of 64" in line for line in capsys.readouterr().err.splitlines()) == 1
    assert_parity(loaded, hf, "qwen2 sliding window", lengths=(64, 37))
    with pytest.raises(UnsupportedModelError, match="sliding-window attention over 64 tokens"):
        load_model(str(tmp_path), device="cpu", max_model_len=100)
