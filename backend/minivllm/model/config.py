"""Architecture hyper-parameters of the shared decoder (Llama, Qwen2, Qwen3), read from a `transformers` config."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from minivllm.model.families import SUPPORTED_MODEL_TYPES, UnsupportedModelError, family_of

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

    @property
    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        qkv = h * (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim
        o = self.num_attention_heads * self.head_dim * h
        biases = (qkv // h if self.qkv_bias else 0) + (h if self.o_bias else 0)
        per_layer = qkv + o + 3 * h * i + 2 * h + biases + (2 * self.head_dim if self.qk_norm else 0)
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_hidden_layers * per_layer + h + head

    def to_json_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json_dict(cls, values: dict[str, Any]) -> LlamaConfig:
        """The inverse of `to_json_dict` after a JSON round trip (a list back to a tuple); a TypeError
        when a field is missing or unknown."""
        return cls(**{**values, "eos_token_ids": tuple(values.get("eos_token_ids") or ())})

    @classmethod
    def from_hf(cls, hf: Any, name: str = "llama") -> LlamaConfig:
        """Build from a `transformers.PretrainedConfig` (v4 `rope_scaling` or v5 `rope_parameters`)."""
        family = family_of(hf, name)
        heads = hf.num_attention_heads
        rope_theta, rope_scaling = _rope_settings(hf)
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            max_position_embeddings=hf.max_position_embeddings,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            bos_token_id=hf.bos_token_id,
            eos_token_ids=eos_ids,
            name=name,
            family=family.model_type,
            **family.pieces(hf),
        )


def _rope_settings(hf: Any) -> tuple[float, dict[str, Any] | None]:
    params = getattr(hf, "rope_parameters", None) or {}
    legacy = getattr(hf, "rope_scaling", None) or {}
    merged = {**legacy, **params}
    theta = merged.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None
    scaling = {k: v for k, v in merged.items() if k != "rope_theta"}
    scaling["rope_type"] = rope_type
    return float(theta), scaling
