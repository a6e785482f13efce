"""Architecture hyper-parameters of the shared decoder (model/families.py), read from a `transformers` config."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from minivllm.model.families import FAMILIES, SUPPORTED_MODEL_TYPES, UnsupportedModelError, family_of

__all__ = ["LlamaConfig", "SUPPORTED_MODEL_TYPES", "UnsupportedModelError"]


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = "llama"
    family: str = "llama"  # the HF model_type (model/families.py)
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on Q and K before the rotary embedding
    rotary_dim: int | None = None  # leading dims of a head that rotate (`partial_rotary_factor`); None: all
    sliding_window: int | None = None  # tokens a query attends to (itself included); None: the whole context
    hidden_act: str = "silu"  # the MLP gate's activation: silu, or gelu_tanh (GeGLU)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size)
    sandwich_norms: bool = False  # RMSNorms on the attention's and the MLP's outputs too
    attn_scale: float | None = None  # the attention's scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # attention scores become cap * tanh(score / cap)
    final_softcap: float | None = None  # logits become cap * tanh(logit / cap)
    local_rope_theta: float | None = None  # the rope base of the `local_layers` (unscaled); None: one rope
    local_layers: tuple[int, ...] = field(default_factory=tuple)  # the sliding-window layers
    # mixture of experts (model/moe.py): the `moe_layers` route each token to `num_experts_per_tok` of
    # `num_experts` gated MLPs of `moe_intermediate_size`; the other layers keep the dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1 (Mixtral: always)
    moe_layers: tuple[int, ...] = field(default_factory=tuple)

    @property
    def attention_window(self) -> int | None:
        """The sliding window of a model whose every layer has it (Mistral): served exactly at any length,
        blocks that left it freed. None without one, or where only some layers have it (Gemma)."""
        family = FAMILIES.get(self.family)
        return self.sliding_window if family is not None and family.window_every_layer else None

    @property
    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        qkv = h * (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim
        o = self.num_attention_heads * self.head_dim * h
        biases = (qkv // h if self.qkv_bias else 0) + (h if self.o_bias else 0)
        norms = (4 if self.sandwich_norms else 2) * h + (2 * self.head_dim if self.qk_norm else 0)
        per_layer = qkv + o + norms + biases
        experts = self.num_experts * (3 * h * self.moe_intermediate_size + h)  # and the router's row each
        mlps = sum(experts if n in self.moe_layers else 3 * h * i for n in range(self.num_hidden_layers))
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_hidden_layers * per_layer + mlps + h + head

    def to_json_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json_dict(cls, values: dict[str, Any]) -> LlamaConfig:
        """The inverse of `to_json_dict` after a JSON round trip (a list back to a tuple); a TypeError
        when a field is missing or unknown."""
        return cls(
            **{
                **values,
                "eos_token_ids": tuple(values.get("eos_token_ids") or ()),
                "local_layers": tuple(values.get("local_layers") or ()),
                "moe_layers": tuple(values.get("moe_layers") or ()),
            }
        )

    @classmethod
    def from_hf(cls, hf: Any, name: str = "llama") -> LlamaConfig:
        """Build from a `transformers.PretrainedConfig` (v4 `rope_scaling` or v5 `rope_parameters`)."""
        family = family_of(hf, name)
        heads = hf.num_attention_heads
        rope_theta, rope_scaling = _rope_settings(hf)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            max_position_embeddings=hf.max_position_embeddings,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            bos_token_id=hf.bos_token_id,
            eos_token_ids=eos_ids,
            name=name,
            family=family.model_type,
            rotary_dim=_rotary_dim(hf, head_dim),
            sliding_window=family.sliding_window(hf),
            hidden_act=family.activation,
            **family.pieces(hf),
        )


def _rope_parameters(hf: Any) -> dict[str, Any]:
    params = _global_layers(getattr(hf, "rope_parameters", None) or {})
    legacy = _global_layers(getattr(hf, "rope_scaling", None) or {})
    return {**legacy, **params}


def _global_layers(params: dict[str, Any]) -> dict[str, Any]:
    """Rope settings given per layer type (Gemma 3): the global layers' (the local base is read apart)."""
    return (params.get("full_attention") or {}) if "full_attention" in params else params


def _rope_settings(hf: Any) -> tuple[float, dict[str, Any] | None]:
    merged = _rope_parameters(hf)
    theta = merged.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None
    scaling = {k: v for k, v in merged.items() if k not in ("rope_theta", "partial_rotary_factor", "type")}
    scaling["rope_type"] = "longrope" if rope_type == "su" else rope_type  # Phi-3's older name for it
    if scaling["rope_type"] == "longrope":
        scaling.update(_longrope_lengths(hf, scaling))
    return float(theta), scaling


def _longrope_lengths(hf: Any, scaling: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE's pretraining length and attention factor, resolved now as transformers resolves them (the
    config's own `original_max_position_embeddings` first; the factor from the two lengths), so that a later
    cap of `max_position_embeddings` (a sliding window's) cannot change them."""
    original = getattr(hf, "original_max_position_embeddings", None) or scaling.get(
        "original_max_position_embeddings", hf.max_position_embeddings
    )
    factor = scaling.get("factor") or hf.max_position_embeddings / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"original_max_position_embeddings": int(original), "attention_factor": float(attention)}


def _rotary_dim(hf: Any, head_dim: int) -> int | None:
    factor = _rope_parameters(hf).get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    if factor is None or factor == 1.0:
        return None
    return int(head_dim * factor)
