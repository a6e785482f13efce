"""Map Hugging Face tensor names (Llama's, or a family's fused ones) onto the fused from-scratch model."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, MutableMapping

import torch

from minivllm.loader.huge_pages import move_to_huge_pages
from minivllm.loader.install_quantized import (
    QuantReport,
    choose_model_kernels,
    fp32_bytes,
    install_quantized,
    stored_bytes,
    weight_tensors,
)
from minivllm.model import tensor_parallel
from minivllm.model.config import LlamaConfig
from minivllm.model.families import FAMILIES
from minivllm.model.llama import LlamaModel
from minivllm.model.packed_linear import pack_model
from minivllm.quant.formats import QuantizedWeight
from minivllm.quant.policy import QuantConfig, apply_policy, compounded_rounding_note, dequantize, describe_mode, fuse

NO_HUGE_PAGES_ENV = "MINIVLLM_NO_HUGE_PAGES"  # 1: weights stay where loading put them (A/B benchmarks)


class CorruptCheckpointError(ValueError):
    """A checkpoint is missing tensors or has tensors of the wrong shape."""


# A layer's products in checkpoint order (random:<shape> weights are drawn in this order: keep it)
SPLIT_PRODUCTS = tuple(
    f"{part}.weight"
    for part in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
)
# Phi-3's checkpoints: fused as this model runs them
FUSED_PRODUCTS = (
    "self_attn.qkv_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_up_proj.weight",
    "mlp.down_proj.weight",
)


# A layer's norms, HF name -> ours. Gemma's `post_attention_layernorm` is on the attention's output, and its
# `pre_feedforward_layernorm` is what Llama calls `post_attention_layernorm` (the norm before the MLP).
LLAMA_NORMS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
}
SANDWICH_NORMS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "attn_out_norm.weight",
    "pre_feedforward_layernorm.weight": "post_attention_layernorm.weight",
    "post_feedforward_layernorm.weight": "mlp_out_norm.weight",
}


def layer_norm_names(cfg: LlamaConfig) -> dict[str, str]:
    return SANDWICH_NORMS if cfg.sandwich_norms else LLAMA_NORMS


def with_norm_offset(cfg: LlamaConfig, hf: MutableMapping[str, torch.Tensor]) -> MutableMapping[str, torch.Tensor]:
    """An HF checkpoint's norm weights with the family's offset folded in: Gemma's norms scale by (1 + w),
    which is an ordinary RMSNorm of weight 1 + w (llama.cpp's converter folds it the same way)."""
    offset = FAMILIES[cfg.family].norm_offset
    if offset:
        for name in [n for n in hf if n.endswith("norm.weight")]:
            hf[name] = hf[name] + offset
    return hf


def hf_tensor_names(cfg: LlamaConfig) -> list[str]:
    """The parameter names the HF model of this config's family (LlamaForCausalLM, Qwen2ForCausalLM, ...) has
    (a MoE layer's in Qwen3-MoE's spelling: `mixtral_names` renames Mixtral's)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    products = FUSED_PRODUCTS if FAMILIES[cfg.family].fused_checkpoint else SPLIT_PRODUCTS
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + n for n in (products if i not in cfg.moe_layers else products[:4] + moe_names(cfg))]
        names += [p + n for n in layer_norm_names(cfg)]
        names += [p + n for n in _family_piece_names(cfg)]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def moe_names(cfg: LlamaConfig) -> tuple[str, ...]:
    """A MoE layer's router and experts, relative to the layer (experts' products in checkpoint order)."""
    experts = (f"mlp.experts.{e}.{p}_proj.weight" for e in range(cfg.num_experts) for p in ("gate", "up", "down"))
    return ("mlp.gate.weight", *experts)


MIXTRAL_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def mixtral_names(cfg: LlamaConfig, hf: MutableMapping[str, torch.Tensor]) -> MutableMapping[str, torch.Tensor]:
    """Mixtral's MoE tensors (`block_sparse_moe.gate`, `.experts.E.w1|w3|w2`) renamed to Qwen3-MoE's
    (`mlp.gate`, `mlp.experts.E.gate_proj|up_proj|down_proj`), in place."""
    if cfg.family != "mixtral":
        return hf
    for name in [n for n in hf if ".block_sparse_moe." in n]:
        new = name.replace(".block_sparse_moe.", ".mlp.")
        for old, ours in MIXTRAL_EXPERT_NAMES.items():
            new = new.replace(f".{old}.weight", f".{ours}.weight")
        hf[new] = hf.pop(name)
    return hf


def _family_piece_names(cfg: LlamaConfig) -> list[str]:
    """A layer's tensors beyond Llama's (model/families.py), relative to the layer."""
    names = [f"self_attn.{p}_proj.bias" for p in "qkv"] if cfg.qkv_bias else []
    names += ["self_attn.o_proj.bias"] if cfg.o_bias else []
    return names + (["self_attn.q_norm.weight", "self_attn.k_norm.weight"] if cfg.qk_norm else [])


def fused_state_dict(cfg: LlamaConfig, hf: MutableMapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names -> this model's names, concatenating q|k|v and gate|up. Takes the tensors out of `hf` as
    it goes, so each fused part is freed once its fused weight exists, not when the load returns."""
    hf = mixtral_names(cfg, hf)
    missing = [n for n in hf_tensor_names(cfg) if n not in hf]
    if missing:
        raise CorruptCheckpointError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    embedding = hf.pop("model.embed_tokens.weight")
    out = {"embed_tokens.weight": embedding, "norm.weight": hf.pop("model.norm.weight")}
    for i in range(cfg.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        _fuse_into(out, hf, attn, dst + "self_attn.", "qkv_proj", [f"{p}_proj" for p in "qkv"])
        out[dst + "self_attn.o_proj.weight"] = hf.pop(attn + "o_proj.weight")
        mlps = [(src + "mlp.", dst + "mlp.")]
        if i in cfg.moe_layers:
            out[dst + "mlp.gate.weight"] = hf.pop(src + "mlp.gate.weight")
            mlps = [(f"{src}mlp.experts.{e}.", f"{dst}mlp.experts.{e}.") for e in range(cfg.num_experts)]
        for mlp_src, mlp_dst in mlps:
            _fuse_into(out, hf, mlp_src, mlp_dst, "gate_up_proj", ["gate_proj", "up_proj"])
            out[mlp_dst + "down_proj.weight"] = hf.pop(mlp_src + "down_proj.weight")
        for norm, ours in layer_norm_names(cfg).items():
            out[dst + ours] = hf.pop(src + norm)
        out.update(_family_pieces(cfg, hf, attn, dst + "self_attn."))
    out["lm_head.weight"] = embedding if cfg.tie_word_embeddings else hf.pop("lm_head.weight")
    return out


def _fuse_into(out: dict, hf: MutableMapping, src: str, dst: str, fused: str, parts: list[str]) -> None:
    """`dst + fused` from the parts under `src` concatenated, or taken as it is where stored fused (Phi-3)."""
    if f"{src}{fused}.weight" in hf:
        out[f"{dst}{fused}.weight"] = hf.pop(f"{src}{fused}.weight")
    else:
        out[f"{dst}{fused}.weight"] = fuse([hf.pop(f"{src}{part}.weight") for part in parts])


def _family_pieces(cfg: LlamaConfig, hf: MutableMapping[str, torch.Tensor], src: str, dst: str) -> dict:
    """One layer's attention biases and Q/K norms, HF names (under `src`) -> ours (under `dst`)."""
    out = {}
    if cfg.qkv_bias:
        out[dst + "qkv_bias"] = torch.cat([dequantize(hf.pop(src + f"{p}_proj.bias")) for p in "qkv"])
    if cfg.o_bias:
        out[dst + "o_bias"] = dequantize(hf.pop(src + "o_proj.bias"))
    if cfg.qk_norm:
        for norm in ("q_norm.weight", "k_norm.weight"):
            out[dst + norm] = hf.pop(src + norm)
    return out


def build_model(
    cfg: LlamaConfig,
    hf_tensors: MutableMapping[str, torch.Tensor | QuantizedWeight],
    dtype: torch.dtype,
    device: str | torch.device,
    max_positions: int | None = None,
    quant: QuantConfig = QuantConfig("none"),
) -> tuple[LlamaModel, QuantReport]:
    """The model, with each weight in the precision `quant` decides, and a report of that. The model's
    tensors are taken out of `hf_tensors` (it is left holding only what the model does not use)."""
    device = torch.device(device)
    tp = tensor_parallel.current()  # a tensor-parallel rank builds its slice (model/tensor_parallel.py)
    model = _skeleton(cfg, max_positions, tp)
    state = fused_state_dict(cfg, hf_tensors)
    if cfg.tie_word_embeddings:
        del state["lm_head.weight"]  # the embedding serves as the head
    requantized_note = compounded_rounding_note(state, quant)
    state = apply_policy(state, quant, dtype)
    if tp is not None:
        state = tensor_parallel.shard_state(state, cfg, tp, dtype)
    _check_shapes(model, state)
    floats = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    quantized = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    model.load_state_dict(floats, strict=False, assign=True)
    if cfg.tie_word_embeddings and "embed_tokens.weight" not in quantized:
        model.lm_head.weight = model.embed_tokens.weight
    install_quantized(model, quantized, device, dtype, cfg.tie_word_embeddings)
    model = model.to(device).eval()
    choices, seconds = choose_model_kernels(model, quant.kernel)
    if os.environ.get("MINIVLLM_NO_PACK") != "1":  # escape hatch for A/B benchmarks
        pack_model(model)
    report = QuantReport(
        describe_mode(state),
        stored_bytes(model),
        fp32_bytes(cfg),
        choices,
        seconds,
        quantized=bool(quantized),
        requantized_note=requantized_note,
    )
    if device.type == "cpu" and os.environ.get(NO_HUGE_PAGES_ENV) != "1":
        report.huge_page_bytes = move_to_huge_pages(weight_tensors(model))
    if tp is not None:
        tensor_parallel.install_collectives(model, tp)
    return model, report


def _skeleton(cfg: LlamaConfig, max_positions: int | None, tp) -> LlamaModel:
    """The model on the meta device; a tensor-parallel rank's with its heads, columns and vocabulary rows
    (its config keeps the whole vocabulary: the logits are gathered)."""
    if tp is None:
        with torch.device("meta"):
            return LlamaModel(cfg, max_positions)
    rank_cfg = tensor_parallel.shard_config(cfg, tp.world)
    with torch.device("meta"):
        model = LlamaModel(tensor_parallel.local_vocab_config(rank_cfg, tp), max_positions)
    model.config = rank_cfg
    return model


def _check_shapes(model: LlamaModel, state: Mapping[str, torch.Tensor | QuantizedWeight]) -> None:
    expected = {k: v.shape for k, v in model.state_dict().items()}
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name]):
            raise CorruptCheckpointError(
                f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name])}"
            )


def iter_progress(items: Iterable, total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(items, total=total, desc=desc, unit="tensor", leave=False)
