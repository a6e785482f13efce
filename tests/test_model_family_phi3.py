"""The Phi-3 family against transformers' own `Phi3ForCausalLM` (the oracle).

Phi-3 checkpoints store Q|K|V and gate|up fused, as the shared decoder runs them; its LongRoPE keeps
short and long per-frequency factors and an attention factor on cos and sin; some configs rotate only
part of each head; Phi-3-mini-4k sets a sliding window. Each variant is a tiny random checkpoint built with
transformers' config class, saved with the embedded tokenizer and loaded through our loader: fp32 hidden
states after every layer and logits within 1e-4 of HF's, greedy tokens through our engine equal to HF
`generate` (alone, batched, preempted), and the same through a GGUF file laid out as llama.cpp's
converter writes a Phi-3 (`attn_qkv`, `ffn_up` holding gate|up, `rope_factors_long/short`).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_model_families import (
    ATOL,
    PROMPTS,
    assert_greedy_matches_hf,
    assert_native_step_matches,
    assert_parity,
    finish_gguf,
    greedy_through_engine,
    hf_greedy,
    report,
    save_tiny,
    untied_tensors,
)

from minivllm.loader import UnsupportedModelError, load_model

EOT = 7  # the end-of-turn token id the GGUF files name
ORIGINAL_LEN = 64  # LongRoPE's pretraining length in the tiny configs
LONGROPE = {  # 4 factors each: a rotary width of 8 (head_dim 16, partial_rotary_factor 0.5)
    "rope_type": "longrope",
    "short_factor": [1.0, 1.3, 1.7, 2.5],
    "long_factor": [1.5, 3.0, 5.0, 9.0],
}
WHOLE_HEAD_LONGROPE = {  # 8 factors each: every dim of a 16-wide head rotates
    "rope_type": "longrope",
    "short_factor": [1.0, 1.1, 1.2, 1.4, 1.7, 2.0, 2.4, 3.0],
    "long_factor": [1.0, 1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 12.0],
}

# (transformers config kwargs, the max_model_len the fixture loads at)
VARIANTS = {
    "phi3-untied": (dict(tie_word_embeddings=False), None),
    "phi3-partial-longrope-tied": (
        dict(tie_word_embeddings=True, partial_rotary_factor=0.5, rope_scaling=LONGROPE),
        ORIGINAL_LEN,  # short factors: every sequence here is within the pretraining length
    ),
    "phi3-sliding-window": (dict(sliding_window=48), None),  # the context is capped at 48
}


def make_tiny_phi3(directory, tokenizer, seed: int = 0, **overrides):
    """A random `transformers` Phi-3 with the embedded tokenizer's vocabulary, saved to `directory`."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Phi3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        original_max_position_embeddings=ORIGINAL_LEN,
        rms_norm_eps=1e-6,
        initializer_range=0.1,  # peakier logits than HF's 0.02: fewer near-ties in greedy decoding
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **overrides,
    )
    model = transformers.Phi3ForCausalLM(config).eval()
    return save_tiny(model, directory, tokenizer)


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory, embedded_tokenizer):
    overrides, max_len = VARIANTS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_phi3(directory, embedded_tokenizer, seed=len(request.param), **overrides)
    loaded = load_model(str(directory), dtype="float32", device="cpu", max_model_len=max_len)
    return request.param, hf, loaded, directory


def test_config_read_from_checkpoint(pair):
    name, hf, loaded, _ = pair
    cfg = loaded.config
    assert cfg.family == "phi3" and not (cfg.qkv_bias or cfg.o_bias or cfg.qk_norm)
    assert cfg.num_parameters == sum(p.numel() for p in hf.parameters())
    assert cfg.rotary_dim == (8 if "partial" in name else None)
    if "longrope" in name:
        assert cfg.rope_scaling["rope_type"] == "longrope"
        assert cfg.rope_scaling["original_max_position_embeddings"] == ORIGINAL_LEN
        factor = 256 / ORIGINAL_LEN  # transformers' default: sqrt(1 + ln(factor) / ln(original length))
        assert cfg.rope_scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(factor) / math.log(64)))
    if "sliding" in name:
        assert (cfg.sliding_window, cfg.max_position_embeddings) == (48, 48)
    else:
        assert cfg.sliding_window is None


def test_hidden_states_and_logits_match_hf(pair, capsys):
    name, hf, loaded, _ = pair
    hidden, logits = assert_parity(loaded, hf, name)
    report(capsys, f"{name}: max abs diff hidden states {hidden:.2e}, logits {logits:.2e} (atol {ATOL})")


def test_greedy_matches_hf_alone_batched_and_preempted(pair):
    name, hf, loaded, _ = pair
    assert_greedy_matches_hf(loaded, hf, name)


def test_longrope_long_factors_past_the_pretraining_length(tmp_path, embedded_tokenizer, capsys):
    """Loaded for more than the pretraining length, the model rotates with the long factors: HF's choice
    for any sequence longer than that length, at every position of it (prefill and greedy decode)."""
    hf = make_tiny_phi3(tmp_path, embedded_tokenizer, seed=5, partial_rotary_factor=0.5, rope_scaling=LONGROPE)
    long = load_model(str(tmp_path), dtype="float32", device="cpu", max_model_len=256)
    hidden, logits = assert_parity(long, hf, "phi3 longrope (long factors)", lengths=(150, 97))
    report(capsys, f"phi3 longrope, long factors: max abs diff hidden states {hidden:.2e}, logits {logits:.2e}")
    prompt = torch.randint(3, 1000, (ORIGINAL_LEN + 6,), generator=torch.Generator().manual_seed(1)).tolist()
    tokens, _ = greedy_through_engine(long, [prompt], max_model_len=256)
    assert tokens["r0"] == hf_greedy(hf, prompt)
    # the short factors would differ there: the choice is the one that matters
    short = load_model(str(tmp_path), dtype="float32", device="cpu", max_model_len=ORIGINAL_LEN)
    assert not torch.equal(short.model.rotary.cos[:ORIGINAL_LEN], long.model.rotary.cos[:ORIGINAL_LEN])


def test_sliding_window_caps_the_context_or_refuses(tmp_path, embedded_tokenizer, capsys):
    make_tiny_phi3(tmp_path, embedded_tokenizer, sliding_window=48)
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    assert loaded.config.max_position_embeddings == 48
    lines = [line for line in capsys.readouterr().err.splitlines() if "sliding window" in line]
    assert len(lines) == 1 and "48" in lines[0]
    assert load_model(str(tmp_path), device="cpu", max_model_len=40).config.max_position_embeddings == 48
    with pytest.raises(UnsupportedModelError, match="sliding-window attention over 48 tokens"):
        load_model(str(tmp_path), device="cpu", max_model_len=100)


def test_native_step_serves_phi3(pair):
    """The native decode step over Phi-3's layers: whole-head and partial rotary (LongRoPE's attention factor
    lives in its tables), a sliding window within the capped context."""
    name, hf, loaded, _ = pair
    assert_native_step_matches(loaded, hf, name)


def test_native_step_serves_longrope(tmp_path, embedded_tokenizer):
    """LongRoPE over whole heads through the native decode step (its factors and attention factor live in
    the rotary tables the C++ step reads), past the pretraining length: greedy tokens equal HF's."""
    from minivllm.kernels.cpu import native
    from minivllm.model.native_step import NativeDecodeStep
    from minivllm.model.packed_linear import PackedLinear

    if native.available() is not None:
        pytest.skip(f"the native kernels are not built here: {native.available()}")
    hf = make_tiny_phi3(tmp_path, embedded_tokenizer, seed=9, rope_scaling=WHOLE_HEAD_LONGROPE)
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu", max_model_len=256)
    for module in loaded.model.modules():
        if isinstance(module, PackedLinear):
            module.native = True  # our fp32 kernel, whichever won the timing at load
    loaded.model.native_step = NativeDecodeStep.for_model(loaded.model)
    assert loaded.model.native_step is not None
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (ORIGINAL_LEN + 6, ORIGINAL_LEN + 15)]
    tokens, _ = greedy_through_engine(loaded, prompts, max_model_len=256)
    assert tokens == {f"r{i}": hf_greedy(hf, p) for i, p in enumerate(prompts)}


def test_compiled_step_serves_partial_rotary(tmp_path, embedded_tokenizer):
    """Partial rotary and LongRoPE through the compiled decode step: greedy tokens equal HF's."""
    from minivllm.model.compiled import CompiledLayers, graph_count, layers_per_graph

    hf = make_tiny_phi3(tmp_path, embedded_tokenizer, seed=7, partial_rotary_factor=0.5, rope_scaling=LONGROPE)
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu", max_model_len=ORIGINAL_LEN)
    loaded.model.compiled = CompiledLayers(layers_per_graph(len(loaded.model.layers)))
    before = graph_count()
    tokens, _ = greedy_through_engine(loaded, PROMPTS, max_num_seqs=4)
    assert loaded.model.compiled.active and loaded.model.compiled.steady, loaded.model.compiled.error
    assert graph_count() > before
    assert tokens == {f"r{i}": hf_greedy(hf, p) for i, p in enumerate(PROMPTS)}


# ---- the same weights through a GGUF file ---------------------------------------------------------------

GGUF_NAMES = {  # llama.cpp's Phi-3 tensor names (gguf-py's TENSOR_NAMES), written out here as the oracle
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name == "lm_head.weight":
        return "output.weight"
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    _, _, layer, *module, kind = hf_name.split(".")
    return f"blk.{layer}.{GGUF_NAMES['.'.join(module)]}.{kind}"


def write_phi3_gguf(hf, path, tokenizer_source) -> None:
    """The HF model's weights in F32 as llama.cpp's converter lays out a Phi-3 file: fused products, Q/K
    rows not permuted (NeoX rotation), LongRoPE's factors as tensors and its lengths as fields."""
    import numpy as np
    from gguf import GGUFWriter

    from minivllm.bench.random_gguf import add_tokenizer_fields

    cfg = hf.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    writer = GGUFWriter(str(path), "phi3")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.sliding_window:
        writer.add_sliding_window(cfg.sliding_window)
    if rope["rope_type"] == "longrope":
        factor = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(
            float(np.sqrt(1 + np.log(factor) / np.log(rope["original_max_position_embeddings"])))
        )
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    add_tokenizer_fields(writer, tokenizer_source)
    writer.add_eot_token_id(EOT)  # Phi-3's <|end|>, which closes a chat turn
    finish_gguf(writer, untied_tensors(hf, gguf_name))


def test_gguf_of_the_same_weights_matches_hf(pair, embedded_path, tmp_path, capsys):
    name, hf, fixture_loaded, _ = pair
    path = tmp_path / f"{name}.gguf"
    write_phi3_gguf(hf, path, embedded_path)
    loaded = load_model(str(path), dtype="float32", device="cpu", max_model_len=VARIANTS[name][1])
    for field in ("family", "rotary_dim", "sliding_window", "max_position_embeddings"):
        assert getattr(loaded.config, field) == getattr(fixture_loaded.config, field), field
    ours, theirs = loaded.config.rope_scaling or {}, fixture_loaded.config.rope_scaling or {}
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():  # the factors went through float32
        assert ours[key] == (pytest.approx(value, rel=1e-6) if not isinstance(value, str) else value), key
    assert loaded.tokenizer is not None and len(loaded.tokenizer) == hf.config.vocab_size
    assert loaded.config.eos_token_ids == (2, EOT)  # the file's eos, then its end-of-turn token
    hidden, logits = assert_parity(loaded, hf, f"{name} (GGUF)")
    report(capsys, f"{name} (GGUF): max abs diff hidden states {hidden:.2e}, logits {logits:.2e} (atol {ATOL})")
    tokens, _ = greedy_through_engine(loaded, PROMPTS)
    assert tokens == {f"r{i}": hf_greedy(hf, p) for i, p in enumerate(PROMPTS)}
