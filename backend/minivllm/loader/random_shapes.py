"""Randomly initialised models of named shapes: `tiny` for tests, real shapes for speed benchmarks."""

from __future__ import annotations

import torch

from minivllm.loader.weights import hf_tensor_names
from minivllm.model.config import LlamaConfig

# what every Qwen2.5 / Qwen3 shape shares: the tokenizer's vocabulary and ids, the norm's epsilon, the rope base
_QWEN = dict(vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0, eos_token_ids=(151645,), bos_token_id=151643)
# the dense Qwen3 sizes (0.6B, 1.7B) differ only in their widths
_QWEN3_DENSE = dict(
    **_QWEN,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
    family="qwen3",
    qk_norm=True,
)
# what every Gemma 2 / 3 shape shares: 256-wide heads scaled by 256 ** -0.5, GeGLU, scaled embeddings, sandwich norms
_GEMMA = dict(
    head_dim=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    eos_token_ids=(1, 107),
    bos_token_id=2,
    hidden_act="gelu_tanh",
    embed_scale=True,
    sandwich_norms=True,
    attn_scale=256**-0.5,
)

SHAPES: dict[str, dict] = {
    # vocab of the embedded tokenizer, so a tiny model can serve real text in tests
    "tiny": dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_ids=(2,),
        bos_token_id=1,
    ),
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        eos_token_ids=(2,),
        bos_token_id=1,
        rope_theta=100000.0,
    ),
    # GPT-2-small-sized, heads and columns that split by 2, 3 and 4 (`bench throughput --tensor-parallel-size`)
    "llama-125m": dict(
        vocab_size=49152,
        hidden_size=768,
        intermediate_size=2304,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        eos_token_ids=(2,),
        bos_token_id=1,
    ),
    "tinyllama-1.1b": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=2048,
        eos_token_ids=(2,),
        bos_token_id=1,
    ),
    "llama-3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        eos_token_ids=(128001,),
        bos_token_id=128000,
    ),
    "qwen2.5-1.5b": dict(
        **_QWEN,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        family="qwen2",
        qkv_bias=True,
    ),
    "qwen3-0.6b": dict(**_QWEN3_DENSE, hidden_size=1024, intermediate_size=3072),
    "qwen3-1.7b": dict(**_QWEN3_DENSE, hidden_size=2048, intermediate_size=6144),
    # Gemma's pieces (model/families.py); the loader caps the context at the sliding window
    "gemma-2-2b": dict(
        **_GEMMA,
        vocab_size=256000,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        sliding_window=4096,
        family="gemma2",
        attn_softcap=50.0,
        final_softcap=30.0,
    ),
    "gemma-3-1b": dict(
        **_GEMMA,
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=32768,
        sliding_window=512,
        rope_theta=1000000.0,
        family="gemma3_text",
        qk_norm=True,
        local_rope_theta=10000.0,
        local_layers=tuple(i for i in range(26) if i % 6 != 5),  # five local layers to one global
    ),
    # Qwen3-30B-A3B's layers (128 experts of 768, 8 a token) at 2 of its 48: its MoE decode work at a size a
    # 24 GiB box loads (drawn in fp32: ~14 GB resident at peak; 1.3 GiB once in int4, `--quantization int4`)
    "qwen3-30b-a3b-2l": dict(
        **_QWEN,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        family="qwen3_moe",
        qk_norm=True,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        moe_layers=(0, 1),
    ),
}


def random_config(shape: str) -> LlamaConfig:
    if shape not in SHAPES:
        raise ValueError(f"unknown random shape {shape!r}; known: {', '.join(SHAPES)}")
    return LlamaConfig(name=f"random:{shape}", **SHAPES[shape])


def random_tensors(cfg: LlamaConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-named tensors, N(0, 0.02) like HF's initializer (biases too), norms at 1; seeded."""
    gen = torch.Generator().manual_seed(seed)
    shapes = _hf_shapes(cfg)
    out = {}
    for name in hf_tensor_names(cfg):
        shape = shapes(name)
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=dtype)
        else:
            out[name] = torch.randn(shape, generator=gen).mul_(0.02).to(dtype)  # in place: no second copy
    return out


def _hf_shapes(cfg: LlamaConfig):
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    table = {
        "embed_tokens": (cfg.vocab_size, h),
        "lm_head": (cfg.vocab_size, h),
        "norm": (h,),
        "q_proj": (cfg.num_attention_heads * d, h),
        "k_proj": (cfg.num_key_value_heads * d, h),
        "v_proj": (cfg.num_key_value_heads * d, h),
        "o_proj": (h, cfg.num_attention_heads * d),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
        "input_layernorm": (h,),
        "post_attention_layernorm": (h,),
        "pre_feedforward_layernorm": (h,),
        "post_feedforward_layernorm": (h,),
        "q_norm": (d,),
        "k_norm": (d,),
    }

    m = cfg.moe_intermediate_size
    experts = {"gate": (cfg.num_experts, h), "gate_proj": (m, h), "up_proj": (m, h), "down_proj": (h, m)}

    def shape(name: str) -> tuple[int, ...]:
        weight_shape = (experts if ".experts." in name or name.endswith("mlp.gate.weight") else table)[
            name.split(".")[-2]
        ]
        return weight_shape[:1] if name.endswith(".bias") else weight_shape  # a bias: one per output row

    return shape
