"""Decode steps through one native call: every decoder layer in C++ (`kernels/cpu/decode_step.cpp`).

Why: at one sequence a 4-bit step's weight products take ~4 ms, and the compiled step spent another
~2 ms around them (fp32: ~5 ms around ~18): inductor's Python wrapper calling ~12 kernels a layer,
each call's dispatch and allocations. The native step runs the same product and attention kernels,
with norm, rotary, the K/V write, SiLU and residuals as small vector loops, all from C++: one Python
call a step.

Where: a CPU with our kernels built, fp32 activations, a pool the native attention reads, and every
layer's four products on our kernels at the step's row count: 4-bit, int8 or GGUF K-quant weights (int8, int8x2 or
fp32 activations: the kernel plan's choice, looked up once per row count) or fp32 weights where our fp32
kernel won at load (packed_linear.choose_fp32_kernel). Any other step (torch's kernels, MKL, a row
count whose plan picks another kernel, CUDA) runs the compiled step (compiled.py) or eagerly. Only
decode steps (one token per sequence); prefill chunks and hidden-state capture run as before.

Families: a layer's pieces beyond Llama's go in as optional tensors (`PIECES`, empty where absent): Qwen2's
QKV bias, an O bias, Qwen3's and Gemma 3's Q/K norms, Gemma's norms on the attention's and MLP's outputs;
with them Gemma's GeGLU, attention scale, soft-capped scores (Gemma 2) and local layers' rope tables, and
Phi-3's partial rotary, and Mistral's sliding window (the attention reads from the window's first block).
Mixture-of-experts layers (Qwen3-MoE, Mixtral) pass their router (on our fp32 kernel) where a dense layer's gate/up
goes and their experts' weights in a list of their own (int8 experts' scales in another): the call routes each row
and runs every chosen expert's products once on the rows that chose it, and reports how many experts each layer ran.
"""

from __future__ import annotations

import torch

from minivllm.console import progress
from minivllm.kernels.cpu import native
from minivllm.model.attention import AttentionMetadata, KVCache, reads_pool_natively
from minivllm.model.moe import SparseMoE
from minivllm.model.native_products import ABSENT, native_scales, native_weight, product_kind
from minivllm.model.rope import RotaryEmbedding

WEIGHTS_PER_LAYER = 6  # input norm, QKV, O, post-attention norm, gate/up, down: decode_step.cpp's order
PRODUCTS_PER_LAYER = 4
# decode_step.cpp's order: the family's pieces, then the products' int8 scales (which the int8 kernels take)
PIECES = ("qkv_bias", "o_bias", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm", *(f"scales{i}" for i in range(4)))
SCALES = PIECES.index("scales0")


def optional_norms(layer: torch.nn.Module) -> tuple[torch.nn.Module | None, ...]:
    """A layer's norms beyond Llama's two, None where absent: Q, K, attention-output, MLP-output."""
    attention = layer.self_attn
    return attention.q_norm, attention.k_norm, layer.attn_out_norm, layer.mlp_out_norm


def pieces(layer: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """A layer's optional pieces in decode_step.cpp's `Piece` order (`PIECES`), an empty tensor where it has
    none: the QKV bias, the O bias, `optional_norms`' weights, then each product's int8 scales."""
    norms = (None if n is None else n.weight for n in optional_norms(layer))
    scales = [native_scales(p) for p in products(layer)]
    tensors = (layer.self_attn.qkv_bias, layer.self_attn.o_bias, *norms, *scales, *[None] * (4 - len(scales)))
    return tuple(ABSENT if t is None else t.detach() for t in tensors)


def layer_norms(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """Every RMSNorm a layer has (the step runs them all with one eps)."""
    optional = (n for n in optional_norms(layer) if n is not None)
    return [layer.input_layernorm, layer.post_attention_layernorm, *optional]


def products(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """A decoder layer's weight products, in the order the native step takes them; a MoE layer's MLP products
    are its experts' (`SparseMoE.native_plan`)."""
    attention = (layer.self_attn.qkv_proj, layer.self_attn.o_proj)
    return attention if isinstance(layer.mlp, SparseMoE) else (*attention, layer.mlp.gate_up_proj, layer.mlp.down_proj)


def layer_kinds(layer: torch.nn.Module, rows: int) -> list[int | None]:
    """A layer's four product kinds at `rows` rows: a MoE layer's last two are its experts' (None where our
    kernels do not run them all alike)."""
    kinds = [product_kind(p, rows) for p in products(layer)]
    if isinstance(layer.mlp, SparseMoE):
        plan = layer.mlp.native_plan(rows)
        kinds += plan.kinds if plan is not None else [None, None]
    return kinds


def product_kinds(layers, rows: int) -> list[int] | None:
    """Per layer and product, its kind at `rows` rows; None when any product there is not native."""
    kinds = [kind for layer in layers for kind in layer_kinds(layer, rows)]
    return None if None in kinds else kinds


class NativeDecodeStep:
    """Runs a decode step's layers in one native call where the model's kernels allow it (`run`)."""

    HOW = "every layer in one C++ call, our kernels"
    DESCRIPTION = f"native decode step ({HOW})"  # one rank's

    def __init__(self, model: torch.nn.Module):
        self.layers = tuple(model.layers)
        attention = self.layers[0].self_attn
        self.heads, self.scale = attention.num_heads, attention.scale
        self.eps = self.layers[0].input_layernorm.eps
        self.final_norm = model.norm.weight.detach()
        self.weights = tuple(t for layer in self.layers for t in self._layer_weights(layer))
        found = tuple(t for layer in self.layers for t in pieces(layer))
        self.pieces = found if any(t.numel() for t in found) else ()  # none: Llama's layers
        self.local_rotary = model.local_rotary  # the local layers' tables (Gemma 3), read at each call
        self.local_layers = [i for i, layer in enumerate(self.layers) if layer.self_attn.local_rope]
        self.gelu = getattr(self.layers[0].mlp, "gelu", False)  # a MoE layer's experts: SwiGLU
        self.softcap = model.config.attn_softcap or 0.0  # Gemma 2's; 0: none
        self.tp = getattr(model, "tp", None)  # its shared segment, read at each call (set once the ranks meet)
        self._kinds: dict[int, list[int] | None] = {}  # by row count; kernel plans are fixed once chosen
        self.moe_layers = [i for i, layer in enumerate(self.layers) if isinstance(layer.mlp, SparseMoE)]
        plans = [self.layers[i].mlp.native_plan(1) for i in self.moe_layers]  # for_model: none is None
        self.experts = [(*plan.gate_ups, *plan.downs) for plan in plans]
        self.expert_scales = [(*plan.gate_up_scales, *plan.down_scales) for plan in plans]  # empty: not int8
        moe = self.layers[self.moe_layers[0]].mlp if self.moe_layers else None
        self.top_k, self.renormalize = (moe.top_k, moe.renormalize) if moe else (1, False)

    @staticmethod
    def _layer_weights(layer) -> tuple[torch.Tensor, ...]:
        if isinstance(layer.mlp, SparseMoE):  # the router where the gate/up goes; the experts go apart
            mlp = (layer.mlp.gate.weight.detach(), ABSENT)
        else:
            mlp = (native_weight(layer.mlp.gate_up_proj), native_weight(layer.mlp.down_proj))
        qkv, o = native_weight(layer.self_attn.qkv_proj), native_weight(layer.self_attn.o_proj)
        return layer.input_layernorm.weight.detach(), qkv, o, layer.post_attention_layernorm.weight.detach(), *mlp

    @staticmethod
    def for_model(model: torch.nn.Module) -> NativeDecodeStep | None:
        """The model's native step, or None where it can never run (no native kernels, a product on
        torch's kernels or MKL, activations not fp32)."""
        if native.available() is not None or model.norm.weight.dtype != torch.float32:
            return None
        blocker = native_blocker(model)
        if blocker is not None:
            progress(f"native decode step off: {blocker}; decode steps take the compiled step (or run eagerly)")
            return None
        if any(norm.eps != model.norm.eps for layer in model.layers for norm in layer_norms(layer)):
            return None  # one eps for every norm in the call
        if any(native_weight(p) is None for layer in model.layers for p in products(layer)):
            return None
        if any(m.native_plan(1) is None for m in model.layers.modules() if isinstance(m, SparseMoE)):
            return None
        return NativeDecodeStep(model)

    @property
    def product_bytes(self) -> int:
        """Bytes of the layers' product weights (int8 scales included), which every call reads once (the norms'
        aside)."""
        products = sum(w.nbytes for i, w in enumerate(self.weights) if i % WEIGHTS_PER_LAYER in (1, 2, 4, 5))
        return products + sum(t.nbytes for i, t in enumerate(self.pieces) if i % len(PIECES) >= SCALES)

    def kinds(self, rows: int) -> list[int] | None:
        if rows not in self._kinds:
            self._kinds[rows] = product_kinds(self.layers, rows)
        return self._kinds[rows]

    def run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        num_layers: int,
    ) -> torch.Tensor | None:
        """x after the first `num_layers` layers and the final norm, or None when this step cannot run
        natively. The rotary tables go in whole: the call reads each row's position there."""
        if meta.prefills or not reads_pool_natively(kv_cache.k[0]):  # before a prefill's row count is looked up
            return None
        kinds = self.kinds(x.shape[0])
        if kinds is None:
            return None
        local = [i for i in self.local_layers if i < num_layers]
        moe = [i for i in self.moe_layers if i < num_layers]
        touched = torch.zeros(len(moe), dtype=torch.long) if moe else None
        out = torch.ops.minivllm_native.decode_layers(
            x,
            positions,
            rotary.cos,
            rotary.signed_sin,
            self.weights[: WEIGHTS_PER_LAYER * num_layers],
            kv_cache.k[:num_layers],
            kv_cache.v[:num_layers],
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_context_lens,
            kinds[: PRODUCTS_PER_LAYER * num_layers],
            self.heads,
            self.eps,
            self.scale,
            self.final_norm,
            self.pieces[: len(PIECES) * num_layers],
            (self.local_rotary.cos, self.local_rotary.signed_sin) if local else (),
            local,
            self.gelu,
            self.softcap,
            meta.window or 0,
            [w for experts in self.experts[: len(moe)] for w in experts],
            [s for scales in self.expert_scales[: len(moe)] for s in scales],
            moe,
            self.top_k,
            self.renormalize,
            touched,
            *self._tp_ranks(),
        )
        for i, count in zip(moe, touched.tolist() if moe else []):
            self.layers[i].mlp.touched = count
        return out

    def _tp_ranks(self) -> tuple[torch.Tensor | None, int, int]:
        """The shared segment the call all-reduces through, and this rank's place (none: one rank)."""
        tp = self.tp
        return (None, 0, 1) if tp is None else (tp.shm, tp.rank, tp.world)

    def describe(self) -> str:
        if self.tp is None:
            return self.DESCRIPTION
        return f"native decode step ({self.HOW}, all-reduces in shared memory over {self.tp.world} ranks)"


def native_blocker(model: torch.nn.Module) -> str | None:
    """Why decode_step.cpp cannot run this model's layers (Llama's, with the pieces in `PIECES`, GeGLU, an
    attention scale and soft cap, local rope tables, partial rotary, a sliding window and MoE MLPs), or None."""
    moe = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    if any(m.gate.weight.dtype != torch.float32 for m in moe):
        return "a mixture-of-experts router not in fp32"
    return None
