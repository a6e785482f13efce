"""The decoder families mini-vllm serves, and the pieces each adds to the shared decoder (model/llama.py).

Llama, Qwen2/2.5 and Qwen3 are one decoder (RMSNorm, GQA attention with rotary positions, SwiGLU MLP);
they differ only in attention pieces, which a family turns on here:
  qkv_bias  a bias on the fused Q|K|V product (Qwen2 always; Llama and Qwen3 where `attention_bias` is set)
  o_bias    a bias on the output product (Llama and Qwen3 where `attention_bias` is set)
  qk_norm   a per-head RMSNorm on Q and K before the rotary embedding (Qwen3)
A family is found by the HF config's `model_type`, which is also the GGUF file's `general.architecture`
for these three (transformers' GGUF reader fills `model_type` from it).
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
    pieces: Callable[[Any], dict[str, bool]]  # HF config -> the decoder pieces it turns on
    rotary_interleaved_in_gguf: bool  # llama.cpp's converter permutes Q/K rows for this family


def _attention_bias(hf: Any) -> dict[str, bool]:
    bias = bool(getattr(hf, "attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias}


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "LlamaForCausalLM", _attention_bias, rotary_interleaved_in_gguf=True),
        Family("qwen2", "Qwen2ForCausalLM", lambda hf: {"qkv_bias": True}, rotary_interleaved_in_gguf=False),
        Family(
            "qwen3",
            "Qwen3ForCausalLM",
            lambda hf: {**_attention_bias(hf), "qk_norm": True},
            rotary_interleaved_in_gguf=False,
        ),
    )
}

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
    _refuse_sliding_window(hf, name)
    return FAMILIES[model_type]


def _refuse_sliding_window(hf: Any, name: str) -> None:
    """Qwen configs carry sliding-window settings, off by default; the paged attention here is full-context."""
    layer_types = getattr(hf, "layer_types", None) or []
    if "sliding_attention" in layer_types or (not layer_types and getattr(hf, "use_sliding_window", False)):
        raise UnsupportedModelError(
            f"model '{name}' enables sliding-window attention (use_sliding_window: true, window "
            f"{getattr(hf, 'sliding_window', None)}); mini-vllm attends over the full context only (setting "
            f"use_sliding_window to false in config.json serves it so, differing from it past the window)"
        )
