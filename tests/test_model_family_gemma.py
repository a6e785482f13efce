"""Gemma 2 and Gemma 3 (text) against transformers' own `Gemma2ForCausalLM` / `Gemma3ForCausalLM` (the oracle).

Gemma's pieces: embeddings times sqrt(hidden), RMSNorms scaling by (1 + w), norms on the attention's and
the MLP's outputs as well as their inputs, GeGLU, `query_pre_attn_scalar`, soft-capped attention scores
and logits (Gemma 2), per-head Q/K norms and a rope base of their own for the sliding-window layers with
linear scaling on the global ones (Gemma 3). Sliding-window layers alternate with global ones; the context
is capped at the window, where both are full attention. Each variant is a tiny random checkpoint built
with transformers' config class (norm weights randomised around 0, HF's (1 + w) form), loaded through
our loader: hidden states after every layer and logits within 1e-4 of HF's, greedy tokens through our
engine equal to HF `generate`, and the same through a GGUF file laid out as llama.cpp's converter
writes one (norms stored with their +1 folded in).
"""

from __future__ import annotations

import random

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
    native_step_on,
    report,
    save_tiny,
)

from engine_utils import make_engine, random_decode_works
from minivllm.loader import UnsupportedModelError, load_model

WINDOW = 96
GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
}

# (transformers class prefix, config kwargs); 6 layers: Gemma 3's default pattern makes layer 5 global.
# query_pre_attn_scalar equals head_dim (16) except where named: a GGUF has no such field, and llama.cpp
# scales by head_dim ** -0.5 (hidden / heads for the 27B models).
VARIANTS = {
    "gemma2-softcaps": ("Gemma2", dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    "gemma2-no-caps-scalar-24": (
        "Gemma2",
        dict(attn_logit_softcapping=None, final_logit_softcapping=None, query_pre_attn_scalar=24),
    ),
    "gemma3-text": ("Gemma3Text", dict(rope_parameters=GEMMA3_ROPE)),
}
GGUF_VARIANTS = ["gemma2-softcaps", "gemma3-text"]  # the scalar-24 variant has no GGUF form (above)


def make_tiny_gemma(kind: str, directory, tokenizer, seed: int = 0, **overrides):
    """A random `transformers` Gemma 2 / Gemma 3 text model with the embedded tokenizer's vocabulary."""
    import transformers

    torch.manual_seed(seed)
    settings = dict(query_pre_attn_scalar=16, sliding_window=WINDOW) | overrides
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.1,  # peakier logits than HF's 0.02: fewer near-ties in greedy decoding
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **settings,
    )
    cls = transformers.Gemma2ForCausalLM if kind == "Gemma2" else transformers.Gemma3ForCausalLM
    model = cls(config).eval()
    return save_tiny(model, directory, tokenizer, norms=(-0.5, 0.5))  # Gemma's norms scale by 1 + w


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory, embedded_tokenizer):
    kind, overrides = VARIANTS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_gemma(kind, directory, embedded_tokenizer, seed=len(request.param), **overrides)
    return request.param, hf, load_model(str(directory), dtype="float32", device="cpu")


def test_config_read_from_checkpoint(pair):
    name, hf, loaded = pair
    cfg, hcfg = loaded.config, hf.config
    assert cfg.family == hcfg.model_type and cfg.hidden_act == "gelu_tanh"
    assert cfg.embed_scale and cfg.sandwich_norms and cfg.tie_word_embeddings
    assert (cfg.sliding_window, cfg.max_position_embeddings) == (WINDOW, WINDOW)  # capped at the window
    assert cfg.attn_scale == hcfg.query_pre_attn_scalar**-0.5
    assert (cfg.attn_softcap, cfg.final_softcap) == (hcfg.attn_logit_softcapping, hcfg.final_logit_softcapping)
    assert cfg.num_parameters == sum(p.numel() for p in hf.parameters())
    if name.startswith("gemma3"):
        assert cfg.qk_norm and cfg.local_rope_theta == 10000.0 and cfg.local_layers == (0, 1, 2, 3, 4)
        assert (cfg.rope_theta, cfg.rope_scaling) == (1_000_000.0, {"rope_type": "linear", "factor": 8.0})
    else:
        assert not cfg.qk_norm and cfg.local_rope_theta is None


def test_hidden_states_and_logits_match_hf(pair, capsys):
    name, hf, loaded = pair
    hidden, logits = assert_parity(loaded, hf, name, lengths=(WINDOW, 37))
    report(capsys, f"{name}: max abs diff hidden states {hidden:.2e}, logits {logits:.2e} (atol {ATOL})")


def test_greedy_matches_hf_alone_batched_and_preempted(pair):
    name, hf, loaded = pair
    assert_greedy_matches_hf(loaded, hf, name)  # 13 + 32 tokens at most: within the window


def test_native_step_serves_gemma(pair):
    """The native decode step runs Gemma's pieces (scale, sandwich norms, GeGLU, Q/K norms, the local rope,
    soft-capped attention scores)."""
    name, hf, loaded = pair
    assert_native_step_matches(loaded, hf, name)


def test_native_step_caps_attention_scores_as_hf_does(tmp_path, embedded_tokenizer):
    """A cap of 1 bends every score (the real models' 50 barely touches a tiny model's): the native step's
    tokens and logits still equal the eager layers' and HF's, and the same step without its cap does not."""
    hf = make_tiny_gemma("Gemma2", tmp_path, embedded_tokenizer, seed=5, attn_logit_softcapping=1.0)
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    assert loaded.config.attn_softcap == 1.0
    assert_native_step_matches(loaded, hf, "gemma2-cap-1")
    engine = make_engine(loaded, max_num_seqs=4, num_blocks=32)
    works = random_decode_works(random.Random(3), 4, 32, max_width=5, vocab=loaded.config.vocab_size)
    eager = engine.runner.execute(works, [])
    with native_step_on(loaded) as calls:
        loaded.model.native_step.softcap = 0.0
        uncapped = engine.runner.execute(works, [])
    assert calls and (uncapped - eager).abs().max().item() > 100 * ATOL


@pytest.mark.parametrize("variant", ["gemma2-softcaps", "gemma3-text"])
def test_compiled_step_serves_gemma(variant, tmp_path, embedded_tokenizer):
    """The compiled decode step over Gemma's layers (soft-capped attention, the local rope): greedy tokens
    equal HF's."""
    from minivllm.model.compiled import CompiledLayers, graph_count, layers_per_graph

    kind, overrides = VARIANTS[variant]
    hf = make_tiny_gemma(kind, tmp_path, embedded_tokenizer, seed=7, **overrides)
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    loaded.model.compiled = CompiledLayers(layers_per_graph(len(loaded.model.layers)))
    before = graph_count()
    tokens, _ = greedy_through_engine(loaded, PROMPTS, max_num_seqs=4)
    assert loaded.model.compiled.active and loaded.model.compiled.steady, loaded.model.compiled.error
    assert graph_count() > before
    assert tokens == {f"r{i}": hf_greedy(hf, p) for i, p in enumerate(PROMPTS)}


def test_window_refuses_a_longer_context(tmp_path, embedded_tokenizer):
    make_tiny_gemma("Gemma2", tmp_path, embedded_tokenizer)
    with pytest.raises(UnsupportedModelError, match=f"sliding-window attention over {WINDOW} tokens"):
        load_model(str(tmp_path), device="cpu", max_model_len=WINDOW + 1)


def test_multimodal_gemma3_is_refused(tmp_path):
    from transformers import Gemma3Config

    Gemma3Config().save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="Gemma3ForCausalLM"):
        load_model(str(tmp_path), device="cpu")


# ---- the same weights through a GGUF file ---------------------------------------------------------------

GGUF_NAMES = {  # llama.cpp's Gemma tensor names (gguf-py's TENSOR_NAMES), written out here as the oracle
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
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_name(hf_name: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in globals_:
        return globals_[hf_name]
    _, _, layer, *module, kind = hf_name.split(".")
    return f"blk.{layer}.{GGUF_NAMES['.'.join(module)]}.{kind}"


def write_gemma_gguf(hf, path, tokenizer_source) -> None:
    """The HF model's weights in F32 as llama.cpp's converter writes a Gemma 2 / 3 file: norms + 1, Q/K not
    permuted, the LM head tied, soft-caps and Gemma 3's linear rope scaling as fields."""
    from gguf import GGUFWriter, RopeScalingType

    from minivllm.bench.random_gguf import add_tokenizer_fields

    cfg = hf.config
    arch = "gemma2" if cfg.model_type == "gemma2" else "gemma3"
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_sliding_window(cfg.sliding_window)
    if cfg.attn_logit_softcapping is not None:
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    add_tokenizer_fields(writer, tokenizer_source)
    # tied: no LM head; llama.cpp's converter folds Gemma's norm offset (1 + w) into the weights
    finish_gguf(
        writer,
        (
            (gguf_name(name), (t.detach().float() + (1.0 if name.endswith("norm.weight") else 0.0)).numpy())
            for name, t in hf.state_dict().items()
            if name != "lm_head.weight"
        ),
    )


@pytest.mark.parametrize("variant", GGUF_VARIANTS)
def test_gguf_of_the_same_weights_matches_hf(variant, tmp_path, embedded_tokenizer, embedded_path, capsys):
    kind, overrides = VARIANTS[variant]
    hf = make_tiny_gemma(kind, tmp_path / "hf", embedded_tokenizer, seed=11, **overrides)
    from_dir = load_model(str(tmp_path / "hf"), dtype="float32", device="cpu").config
    path = tmp_path / f"{variant}.gguf"
    write_gemma_gguf(hf, path, embedded_path)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    for field in (
        "family",
        "head_dim",
        "sliding_window",
        "max_position_embeddings",
        "attn_scale",
        "attn_softcap",
        "final_softcap",
        "qk_norm",
        "rope_theta",
        "rope_scaling",
        "local_rope_theta",
        "local_layers",
        "tie_word_embeddings",
    ):
        assert getattr(loaded.config, field) == getattr(from_dir, field), field
    hidden, logits = assert_parity(loaded, hf, f"{variant} (GGUF)", lengths=(WINDOW, 37))
    report(capsys, f"{variant} (GGUF): max abs diff hidden states {hidden:.2e}, logits {logits:.2e} (atol {ATOL})")
    assert_greedy_matches_hf(loaded, hf, f"{variant} (GGUF)")
