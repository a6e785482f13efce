"""The decoder families mini-vllm serves, and the pieces each adds to the shared decoder (model/llama.py).

Llama, Mistral, Phi-3, Qwen2/2.5, Qwen3, Gemma 2 and Gemma 3 (text), and the mixtures of experts Qwen3-MoE and
Mixtral, are one decoder (RMSNorm, GQA attention
with rotary positions, a gated MLP); they differ in pieces, which a family turns on here:
  qkv_bias        a bias on the fused Q|K|V product (Qwen2 always; Llama and Qwen3 where `attention_bias` is set)
  o_bias          a bias on the output product (Llama and Qwen3 where `attention_bias` is set)
  qk_norm         a per-head RMSNorm on Q and K before the rotary embedding (Qwen3, Gemma 3)
  hidden_act      the gate's activation: silu, or GELU's tanh form (Gemma: GeGLU)
  embed_scale     embeddings times sqrt(hidden) (Gemma)
  sandwich_norms  an RMSNorm on the attention's and the MLP's outputs too (Gemma)
  attn_scale      the attention's scale, query_pre_attn_scalar ** -0.5 (Gemma), not head_dim ** -0.5
  attn_softcap, final_softcap   cap * tanh(x / cap) on attention scores / logits (Gemma 2)
  local_rope_theta, local_layers   a rope base of their own for the sliding-window layers (Gemma 3)
  num_experts, ...  a sparse MoE block in place of the MLP on the `moe_layers` (Qwen3-MoE, Mixtral: model/moe.py)
and in how the checkpoint stores them (Phi-3 keeps Q|K|V and gate|up fused, as this decoder runs them; a
Gemma norm's weight w means (1 + w), folded in at load: `norm_offset`).
A family is found by the HF config's `model_type`, which is also the GGUF file's `general.architecture`
(Mistral's GGUF files say `llama`, and load as Llama: the same decoder; a Gemma 3 file reads as `gemma3_text`).

Sliding windows: a query attends to the last `sliding_window` tokens (itself included). Where every layer
has the window (`window_every_layer`: Llama, Mistral, Mixtral) it is served exactly at any length: masks and
kernels start at the window (model/attention.py) and blocks that left it are freed (core/block_manager.py).
Elsewhere (Gemma's alternating local layers, Phi-3, Qwen) the context is capped at the window, where it
is full attention (loader/context.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class UnsupportedModelError(ValueError):
    """The checkpoint is not an architecture mini-vllm implements, or uses a setting it does not."""


@dataclass(frozen=True)
class Family:
    model_type: str  # HF `model_type`, and the GGUF architecture name
    architecture: str  # the HF class a checkpoint's config names
    pieces: Callable[[Any], dict[str, Any]]  # HF config -> the decoder pieces it turns on (LlamaConfig fields)
    rotary_interleaved_in_gguf: bool  # llama.cpp's converter permutes Q/K rows for this family
    sliding_window: Callable[[Any], int | None]  # HF config -> the window its attention uses, if any
    fused_checkpoint: bool = False  # the checkpoint stores qkv_proj and gate_up_proj fused (Phi-3)
    norm_offset: float = 0.0  # an HF checkpoint's norm weights w scale by (w + offset) (Gemma: 1)
    activation: str = "silu"  # the MLP gate's: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)
    window_every_layer: bool = False  # the window applies to every layer: served exactly past it


def _attention_bias(hf: Any) -> dict[str, bool]:
    bias = bool(getattr(hf, "attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias}


def _window(hf: Any) -> int | None:
    """Mistral's and Phi-3's `sliding_window`: on every layer where set (null: none)."""
    return getattr(hf, "sliding_window", None) or None


def _qwen_window(hf: Any) -> int | None:
    """Qwen's window is off unless `use_sliding_window`; then it applies to the layers `layer_types` names."""
    layer_types = getattr(hf, "layer_types", None) or []
    if "sliding_attention" in layer_types or (not layer_types and getattr(hf, "use_sliding_window", False)):
        return getattr(hf, "sliding_window", None) or None
    return None


def _gemma2(hf: Any) -> dict[str, Any]:
    return {
        **_attention_bias(hf),
        "embed_scale": True,
        "sandwich_norms": True,
        "attn_scale": float(hf.query_pre_attn_scalar) ** -0.5,
        "attn_softcap": getattr(hf, "attn_logit_softcapping", None),
        "final_softcap": getattr(hf, "final_logit_softcapping", None),
    }


def _gemma3(hf: Any) -> dict[str, Any]:
    layer_types = getattr(hf, "layer_types", None) or []
    local = (getattr(hf, "rope_parameters", None) or {}).get("sliding_attention") or {}
    return {
        **_gemma2(hf),
        "qk_norm": True,
        "local_rope_theta": float(local.get("rope_theta", getattr(hf, "rope_local_base_freq", 10000.0))),
        "local_layers": tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention"),
    }


def _sparse_layers(hf: Any) -> tuple[int, ...]:
    """Qwen3-MoE's sparse layers, by HF's rule: every `decoder_sparse_step`-th layer not in `mlp_only_layers`."""
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    return tuple(i for i in range(hf.num_hidden_layers) if i not in dense and (i + 1) % step == 0)


def _qwen3_moe(hf: Any) -> dict[str, Any]:
    return {
        **_attention_bias(hf),
        "qk_norm": True,
        "num_experts": hf.num_experts,
        "num_experts_per_tok": hf.num_experts_per_tok,
        "moe_intermediate_size": hf.moe_intermediate_size,
        "norm_topk_prob": bool(hf.norm_topk_prob),
        "moe_layers": _sparse_layers(hf) if hf.num_experts > 0 else (),
    }


def _mixtral(hf: Any) -> dict[str, Any]:
    """Every layer sparse; the top-k weights are a softmax over the chosen logits (renormalised)."""
    return {
        "num_experts": hf.num_local_experts,
        "num_experts_per_tok": hf.num_experts_per_tok,
        "moe_intermediate_size": hf.intermediate_size,
        "norm_topk_prob": True,
        "moe_layers": tuple(range(hf.num_hidden_layers)),
    }


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family(
            "llama",
            "LlamaForCausalLM",
            _attention_bias,
            rotary_interleaved_in_gguf=True,
            sliding_window=_window,
            window_every_layer=True,
        ),
        Family(
            "mistral",
            "MistralForCausalLM",
            lambda hf: {},
            rotary_interleaved_in_gguf=True,
            sliding_window=_window,
            window_every_layer=True,
        ),
        Family(
            "phi3",
            "Phi3ForCausalLM",
            lambda hf: {},
            rotary_interleaved_in_gguf=False,
            sliding_window=_window,
            fused_checkpoint=True,
        ),
        Family(
            "qwen2",
            "Qwen2ForCausalLM",
            lambda hf: {"qkv_bias": True},
            rotary_interleaved_in_gguf=False,
            sliding_window=_qwen_window,
        ),
        Family(
            "qwen3",
            "Qwen3ForCausalLM",
            lambda hf: {**_attention_bias(hf), "qk_norm": True},
            rotary_interleaved_in_gguf=False,
            sliding_window=_qwen_window,
        ),
        Family(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            _qwen3_moe,
            rotary_interleaved_in_gguf=False,
            sliding_window=_qwen_window,
        ),
        Family(
            "mixtral",
            "MixtralForCausalLM",
            _mixtral,
            rotary_interleaved_in_gguf=True,
            sliding_window=_window,
            window_every_layer=True,
        ),
        Family(
            "gemma2",
            "Gemma2ForCausalLM",
            _gemma2,
            rotary_interleaved_in_gguf=False,
            sliding_window=_window,
            norm_offset=1.0,
            activation="gelu_tanh",
        ),
        Family(
            "gemma3_text",
            "Gemma3ForCausalLM",
            _gemma3,
            rotary_interleaved_in_gguf=False,
            sliding_window=_window,
            norm_offset=1.0,
            activation="gelu_tanh",
        ),
    )
}

ACTIVATION_NAMES = {"silu": ("silu",), "gelu_tanh": ("gelu_pytorch_tanh", "gelu_tanh")}  # transformers' names

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def supported_architectures() -> str:
    return ", ".join(f"{f.architecture} (model_type '{f.model_type}')" for f in FAMILIES.values())


def family_of(hf: Any, name: str) -> Family:
    """The family of an HF config, or an UnsupportedModelError naming the supported ones."""
    model_type = getattr(hf, "model_type", None)
    if model_type not in FAMILIES:
        archs = getattr(hf, "architectures", None) or [model_type]
        raise UnsupportedModelError(
            f"model '{name}' has architecture {archs} (model_type={model_type!r}); "
            f"mini-vllm supports {supported_architectures()}"
        )
    family = FAMILIES[model_type]
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")  # Gemma's name, others'
    if act not in ACTIVATION_NAMES[family.activation]:
        raise UnsupportedModelError(
            f"model '{name}' uses activation {act!r}; the {model_type} decoder runs {family.activation}"
        )
    return family
