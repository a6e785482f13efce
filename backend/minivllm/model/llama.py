"""The shared decoder of every family (model/families.py) in plain PyTorch, reading its KV cache through
block tables.

Embedding -> N x (RMSNorm, GQA attention with rotary positions, residual, RMSNorm, gated MLP,
residual) -> RMSNorm -> LM head (tied to the embedding or not). Q/K/V and gate/up projections are
fused into one matrix each at load time: one GEMM instead of three (two) per layer. A family's own
pieces are optional: a Q|K|V bias (Qwen2), an output bias, per-head Q/K RMSNorms before the rotary
embedding (Qwen3, Gemma 3), and Gemma's scaled embedding, GeGLU, norms on the attention's and MLP's
outputs, soft-capped scores and logits, a rope base of its own for the sliding-window layers, and a
sparse mixture-of-experts block in place of the MLP on some layers (Qwen3-MoE, Mixtral: model/moe.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model.attention import AttentionMetadata, KVCache, paged_attention
from minivllm.model.compiled import CompiledLayers, run_layer
from minivllm.model.config import LlamaConfig
from minivllm.model.moe import SparseMoE
from minivllm.model.native_step import NativeDecodeStep
from minivllm.model.packed_linear import PackedLinear
from minivllm.model.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, index: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(cfg.hidden_size, q_size + 2 * kv_size, bias=False)
        self.o_proj = PackedLinear(q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.attn_scale or self.head_dim**-0.5
        self.softcap = cfg.attn_softcap
        # the local rope's tables follow the global ones in a step's `rope` (LlamaModel.rope_tables)
        self.local_rope = cfg.local_rope_theta is not None and index in cfg.local_layers
        # biases beside the products, not in them: a quantized product (QuantLinear) replaces the module
        self.qkv_bias = nn.Parameter(torch.empty(q_size + 2 * kv_size)) if cfg.qkv_bias else None
        self.o_bias = nn.Parameter(torch.empty(cfg.hidden_size)) if cfg.o_bias else None
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        qkv = qkv.view(tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = qkv[:, : self.num_heads + self.num_kv_heads]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], dim=1)
        # Q and K heads are contiguous, so one rotary call covers both.
        qk = RotaryEmbedding.rotate(qk, *(rope[2:] if self.local_rope else rope[:2]))
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        out = self.o_proj(paged_attention(q, k, v, k_pool, v_pool, meta, self.scale, self.softcap))
        return out if self.o_bias is None else out + self.o_bias


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gelu = cfg.hidden_act == "gelu_tanh"  # GeGLU (Gemma), else SwiGLU
        self.gate_up_proj = PackedLinear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = PackedLinear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up)


def mlp_for(cfg: LlamaConfig, index: int) -> nn.Module:
    """The layer's MLP: the MoE block on the config's sparse layers, else the dense one."""
    if index not in cfg.moe_layers:
        return MLP(cfg)
    return SparseMoE(
        cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
    )


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # before the MLP
        self.mlp = mlp_for(cfg, index)
        # Gemma's sandwich: norms on the attention's and the MLP's outputs, before their residual adds
        self.attn_out_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None
        self.mlp_out_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None

    def forward(self, x, rope, k_pool, v_pool, meta):
        attn = self.self_attn(self.input_layernorm(x), rope, k_pool, v_pool, meta)
        x = x + (attn if self.attn_out_norm is None else self.attn_out_norm(attn))
        mlp = self.mlp(self.post_attention_layernorm(x))
        return x + (mlp if self.mlp_out_norm is None else self.mlp_out_norm(mlp))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        positions = max_positions or cfg.max_position_embeddings
        self.rotary = RotaryEmbedding(cfg.head_dim, positions, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim)
        self.local_rotary = (  # the sliding-window layers' own base, unscaled (Gemma 3)
            None
            if cfg.local_rope_theta is None
            else RotaryEmbedding(cfg.head_dim, positions, cfg.local_rope_theta, None, cfg.rotary_dim)
        )
        # from an uninitialised table: the loader builds the model on the meta device, where the
        # default random init would import torch's compiler (~70 MiB resident) for nothing
        self.embed_tokens = nn.Embedding.from_pretrained(torch.empty(cfg.vocab_size, cfg.hidden_size), freeze=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = PackedLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.native_step: NativeDecodeStep | None = None  # set by the engine unless --enforce-eager (use_compilation)
        # built by the runner's warm-up where a decode step needs it (compiled.compiled_step_for)
        self.compiled: CompiledLayers | None = None
        self.may_compile = False  # whether it may be built: not --enforce-eager, a CPU, torch.compile there
        self.may_capture = False  # whether decode steps may replay CUDA graphs: not --enforce-eager, CUDA
        self.captured = None  # the runner's DecodeGraphs, once captured (model/cuda_graphs.py)
        self.eager_reason = "--enforce-eager"  # shown when `compiled` is None
        self.moe_blocks = tuple(layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE))

    @property
    def experts_touched(self) -> int | None:
        """Distinct experts the last forward ran, summed over its MoE layers (the expert weights it read);
        None for a dense model."""
        return sum(block.touched for block in self.moe_blocks) if self.moe_blocks else None

    @property
    def eager_only(self) -> str | None:
        """Why no compiled step or CUDA graph can serve decode steps, or None: MoE layers group rows by the
        experts they chose, sizes known only once the router has run (the C++ decode step groups them itself)."""
        return "mixture-of-experts layers (data-dependent expert groups)" if self.moe_blocks else None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        hidden_states_out: list[torch.Tensor] | None = None,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """Returns the final-normed hidden state of every token [T, hidden]. When `hidden_states_out`
        is given, it receives every layer's input and then the final normed output (HF's convention
        for `output_hidden_states`). `num_layers`: stop after that many layers and norm there (early
        exit: the speculative self-draft; only those layers' KV is written)."""
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale:  # sqrt(hidden) in the activations' dtype, as HF rounds it
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        num_layers = len(self.layers) if num_layers is None else num_layers
        for block in self.moe_blocks:  # an early exit leaves the later layers' counts at 0
            block.touched = 0
        if hidden_states_out is None and self.native_step is not None:  # decode steps, where it can
            normed = self.native_step.run(x, positions, self.rotary, kv_cache, meta, num_layers)  # and the final norm
            if normed is not None:
                return normed
        rope = self.rope_tables(positions, x.dtype)
        done = 0
        if self.compiled is not None and not meta.prefills and hidden_states_out is None:
            x, done = self.compiled.run(self.layers, x, rope, kv_cache, meta, num_layers)
        for i in range(done, num_layers):
            if hidden_states_out is not None:
                hidden_states_out.append(x)
            x = run_layer(self.layers[i], x, rope, kv_cache.k[i], kv_cache.v[i], meta)
        x = self.norm(x)
        if hidden_states_out is not None:
            hidden_states_out.append(x)
        return x

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and signed sin for a step's positions, then the local layers' pair where they have their own."""
        tables = self.rotary.tables(positions, dtype)
        return tables if self.local_rotary is None else (*tables, *self.local_rotary.tables(positions, dtype))

    def compilation(self) -> str:
        """How decode steps run, in words (the Engine tab shows it)."""
        if self.captured is not None:  # every decode step it holds replays what was captured
            return self.captured.describe()
        modes = [m.describe() for m in (self.native_step, self.compiled) if m is not None]
        if self.compiled is None and not self.may_compile:  # what the steps the native one cannot take do
            modes.append(f"eager ({self.eager_reason})")
        return "; otherwise ".join(modes)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_softcap
        if cap is not None:  # in the model's dtype, as HF caps them (Gemma 2)
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
