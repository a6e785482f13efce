"""Tiny random Llama checkpoints saved in the HF format, for parity tests of the loader and model."""

from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_llama(
    directory: Path,
    *,
    seed: int = 0,
    tie: bool = False,
    kv_heads: int = 2,
    rope_scaling: dict | None = None,
    vocab: int = 256,
    layers: int = 3,
    init_std: float | None = None,
    intermediate: int = 160,
    head_dim: int = 16,
):
    """Build a random `transformers.LlamaForCausalLM`, save it (config.json + safetensors) and return it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if init_std is not None:  # larger than HF's 0.02: peakier logits, fewer near-ties (beam search tests)
        cfg.initializer_range = init_std
    if rope_scaling:
        cfg.rope_parameters = {"rope_theta": 500000.0, **rope_scaling}
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF inits norms at 1: randomise them so a wrong norm placement shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    return model
