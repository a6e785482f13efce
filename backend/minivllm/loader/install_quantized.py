"""Put quantized weights into a built model: swap modules, choose kernels, count the memory."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from minivllm.quant.chooser import GroupChoice, choose_kernels, describe
from minivllm.quant.formats import Int8Weight, KQuantWeight, QuantizedWeight, weight_bytes
from minivllm.quant.linear import KQuantEmbedding, QuantEmbedding, QuantLinear
from minivllm.quant.matmul_paths import lm_head_candidates


@dataclass
class QuantReport:
    """What the loader tells the user and `/api/state` shows."""

    mode: str  # "none", "int4 g32 (embedding and LM head: int8)", ...
    weight_bytes: int  # everything the model keeps for its parameters, as stored
    fp32_bytes: int  # the same parameters in fp32, for the ratio
    kernel_choices: list[GroupChoice] = field(default_factory=list)
    choose_seconds: float = 0.0  # time spent timing kernels at load
    dequantized_note: str | None = None  # GGUF types that had no native path
    requantized_note: str | None = None  # 4-bit weights rounded a second time (policy.compounded_rounding_note)
    quantized: bool = False  # whether any weight is held in 4 or 8 bits
    huge_page_bytes: int = 0  # weights moved onto 2 MiB pages (loader/huge_pages.py); 0: left on 4 KiB pages

    @property
    def ratio(self) -> float:
        return self.weight_bytes / self.fp32_bytes if self.fp32_bytes else 1.0

    def kernel_lines(self) -> list[str]:
        return describe(self.kernel_choices)


def install_quantized(
    model: nn.Module, quantized: dict[str, QuantizedWeight], device: torch.device, dtype: torch.dtype, tied: bool
) -> None:
    """Replace the (meta) modules whose weights are quantized."""
    if "embed_tokens.weight" in quantized:
        table = quantized["embed_tokens.weight"]
        model.embed_tokens = (
            KQuantEmbedding(table, dtype) if isinstance(table, KQuantWeight) else QuantEmbedding(table, device, dtype)
        )
        if tied:  # one int8 table serves the lookup and the head
            model.lm_head = _lm_head(model.embed_tokens.as_weight(), device, dtype)
    for name, weight in quantized.items():
        if name == "embed_tokens.weight" or (tied and name == "lm_head.weight"):
            continue
        if name == "lm_head.weight":
            model.lm_head = _lm_head(weight, device, dtype)
            continue
        parent, attr = _parent(model, name.removesuffix(".weight"))
        setattr(parent, attr, QuantLinear(name.removesuffix(".weight"), weight, device, dtype))


def _lm_head(weight: QuantizedWeight, device: torch.device, dtype: torch.dtype) -> QuantLinear:
    if not isinstance(weight, Int8Weight):  # the policy keeps heads at 8 bits; anything else as it is
        return QuantLinear("lm_head", weight, device, dtype)
    return QuantLinear("lm_head", weight, device, dtype, kernels=lm_head_candidates(weight, device, dtype))


def choose_model_kernels(model: nn.Module, forced_kernel: str | None) -> tuple[list[GroupChoice], float]:
    """The chosen plans and the seconds the timing took."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    started = time.perf_counter()
    choices = choose_kernels(layers, forced_kernel) if layers else []
    return choices, time.perf_counter() - started


def _parent(model: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    *path, attr = dotted.split(".")
    parent = model
    for part in path:
        parent = getattr(parent, part)
    return parent, attr


def weight_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor the model keeps for weights: parameters and the quantized modules' stored forms."""
    tensors = list(model.parameters())
    for module in model.modules():
        if isinstance(module, (QuantLinear, QuantEmbedding, KQuantEmbedding)):
            tensors += module.stored_tensors()
    return tensors


def stored_bytes(model: nn.Module) -> int:
    """Bytes of every distinct tensor the model keeps for weights (shared storage counted once)."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in weight_tensors(model)}
    # an MKL-packed fp32 copy is opaque, and its numel() says 2.7x what it holds: RSS grows by about
    # its weight's size (measured: 7.3 MiB per copy of a 6.75 MiB [3072x576] weight)
    packed = sum(len(m.packs) * weight_bytes(m.weight) for m in model.modules() if getattr(m, "packs", None))
    return sum(seen.values()) + packed


def fp32_bytes(cfg) -> int:
    return cfg.num_parameters * 4


def streamed_bytes(model: nn.Module, rows: int) -> int:
    """Bytes of weights one forward pass over `rows` tokens reads: each linear's weight in the form
    its kernel for that row count uses (an embedding lookup reads only its rows: not counted). A MoE
    block's experts count at the share such a step is expected to run (`expected_expert_share`)."""
    from minivllm.model.moe import SparseMoE

    share = {}  # id of an expert's product -> the share of its block's experts a step reads
    for block in model.modules():
        if isinstance(block, SparseMoE):
            expected = expected_expert_share(len(block.experts), block.top_k, rows)
            share.update({id(m): expected for m in block.experts.modules()})
    return int(sum(share.get(id(m), 1.0) * _product_bytes(m, rows) for m in model.modules()))


def expected_expert_share(experts: int, top_k: int, rows: int) -> float:
    """The expected fraction of experts that `rows` rows choosing `top_k` each touch, were routing uniform."""
    return 1.0 - (1.0 - top_k / experts) ** rows


def _product_bytes(module: nn.Module, rows: int) -> int:
    from minivllm.model.packed_linear import PackedLinear

    if isinstance(module, QuantLinear):
        return module.kernel_for(rows).streamed_bytes(rows)
    if isinstance(module, PackedLinear):
        return weight_bytes(module.weight)
    return 0
