"""The Mistral family against transformers' own `MistralForCausalLM` (the oracle).

Mistral is Llama's decoder. Without a sliding window it is served as it is; with one, exactly at any
length, its context uncapped (tests/test_sliding_window.py runs it far past the window). llama.cpp writes
Mistral files with the `llama` architecture (Q/K rows permuted for its rotary layout), which load as Llama;
a file named just "mistral" is read by transformers as `mistral`, and its sliding window is the file's
(none, unless written), not the config class's default.
"""

from __future__ import annotations

import pytest
import torch
from test_model_families import (
    ATOL,
    assert_greedy_matches_hf,
    assert_native_step_matches,
    assert_parity,
    finish_gguf,
    report,
    save_tiny,
)

from minivllm.loader import load_model

WINDOW = 64


def make_tiny_mistral(directory, tokenizer, seed: int = 0, **overrides):
    """A random `transformers` Mistral with the embedded tokenizer's vocabulary, saved to `directory`."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.MistralConfig(
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
    return save_tiny(transformers.MistralForCausalLM(config).eval(), directory, tokenizer)


VARIANTS = {"mistral-no-window": dict(sliding_window=None), "mistral-window-64": dict(sliding_window=WINDOW)}


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory, embedded_tokenizer):
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_mistral(directory, embedded_tokenizer, seed=len(request.param), **VARIANTS[request.param])
    return request.param, hf, load_model(str(directory), dtype="float32", device="cpu")


def test_config_read_from_checkpoint(pair):
    name, hf, loaded = pair
    cfg = loaded.config
    assert cfg.family == "mistral" and not (cfg.qkv_bias or cfg.o_bias or cfg.qk_norm)
    assert cfg.num_parameters == sum(p.numel() for p in hf.parameters())
    window = hf.config.sliding_window
    assert (cfg.sliding_window, cfg.attention_window, cfg.max_position_embeddings) == (window, window, 512)


def test_hidden_states_and_logits_match_hf(pair, capsys):
    name, hf, loaded = pair
    hidden, logits = assert_parity(loaded, hf, name, lengths=(150, 37))  # 150: past the window of 64
    report(capsys, f"{name}: max abs diff hidden states {hidden:.2e}, logits {logits:.2e} (atol {ATOL})")


def test_greedy_matches_hf_alone_batched_and_preempted(pair):
    name, hf, loaded = pair
    assert_greedy_matches_hf(loaded, hf, name)  # 13 + 32 tokens at most: within the window


def test_native_step_serves_mistral(pair):
    """The C++ decode step serves Mistral's layers, windowed or not (past the window: test_sliding_window.py)."""
    name, hf, loaded = pair
    assert_native_step_matches(loaded, hf, name)


def test_window_keeps_the_context(tmp_path, embedded_tokenizer):
    make_tiny_mistral(tmp_path, embedded_tokenizer, sliding_window=WINDOW)
    assert load_model(str(tmp_path), device="cpu").config.max_position_embeddings == 512
    assert load_model(str(tmp_path), device="cpu", max_model_len=WINDOW + 1).config.sliding_window == WINDOW


# ---- GGUF: llama.cpp's `llama` layout ------------------------------------------------------------------

GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def llama_cpp_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's Q/K row order for its rotary layout: each head's two halves interleaved."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
    )


def write_llama_gguf(hf, path, tokenizer_source, name: str) -> None:
    from gguf import GGUFWriter

    from minivllm.bench.random_gguf import add_tokenizer_fields

    cfg = hf.config
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.sliding_window:
        writer.add_sliding_window(cfg.sliding_window)
    add_tokenizer_fields(writer, tokenizer_source)
    for hf_name, tensor in hf.state_dict().items():
        if hf_name in GLOBAL_NAMES:
            writer.add_tensor(GLOBAL_NAMES[hf_name], tensor.detach().float().numpy())
            continue
        _, _, layer, *module, kind = hf_name.split(".")
        module = ".".join(module)
        if module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = cfg.num_attention_heads if module == "self_attn.q_proj" else cfg.num_key_value_heads
            tensor = llama_cpp_permute(tensor, heads)
        writer.add_tensor(f"blk.{layer}.{GGUF_LAYER_NAMES[module]}.{kind}", tensor.detach().float().numpy())
    finish_gguf(writer, [])


@pytest.mark.parametrize("file_name, family", [("Mistral-Tiny-Instruct", "llama"), ("mistral", "mistral")])
def test_gguf_of_the_same_weights_matches_hf(tmp_path, embedded_tokenizer, embedded_path, capsys, file_name, family):
    """A Mistral GGUF (arch `llama`) loads as its family, Q/K rows un-permuted, with no window it does
    not have; hidden states, logits and greedy tokens equal HF's Mistral on the same weights."""
    hf = make_tiny_mistral(tmp_path / "hf", embedded_tokenizer, seed=3, sliding_window=None)
    path = tmp_path / "mistral.gguf"
    write_llama_gguf(hf, path, embedded_path, file_name)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    assert (loaded.config.family, loaded.config.sliding_window) == (family, None)
    assert loaded.config.max_position_embeddings == 512
    hidden, logits = assert_parity(loaded, hf, f"mistral GGUF '{file_name}'")
    report(capsys, f"mistral GGUF ({family}): max abs diff hidden states {hidden:.2e}, logits {logits:.2e}")
    assert_greedy_matches_hf(loaded, hf, f"mistral GGUF '{file_name}'")
