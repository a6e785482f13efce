"""Read a GGUF's tensors in the precision they are stored in.

Q4_1 and Q8_0 blocks become Int4Weight / Int8Weight without a detour through floats, Q4_K / Q5_K / Q6_K
super-blocks a KQuantWeight holding the file's bytes as they are; F32/F16/BF16 tensors become torch
tensors. Two more types hold exactly what a native format holds, and are moved into it: Q4_0 (d*(q-8))
is Int4Weight with m = -8d, Q5_0 (d*(q-16)) is Int8Weight in blocks of 32. Any other GGML type is
dequantized by the `gguf` package and, with `nearest_native`, re-rounded to the nearest native format:
Q5_1 to int8 g32; Q2_K, Q3_K, the IQ and TQ types to Q4_K, beside the K-quants such files mix them with
(int4 g32 where a row is not whole super-blocks); the embedding and LM head never below int8 g32. A
second rounding: the caller warns about it. Names are mapped to Hugging Face's, and Q/K rows are un-permuted: llama.cpp
stores them interleaved for its rotary layout, and a row permutation commutes with row-wise
quantization, so the blocks can be moved as they are.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from minivllm.quant.formats import (
    KQUANT_BYTES,
    SUPER_BLOCK,
    Int4Weight,
    Int8Weight,
    KQuantWeight,
    QuantizedWeight,
    quantize_int4,
    quantize_int8,
)
from minivllm.quant.kquant_pack import quantize_q4_k

GROUP = 32  # elements per Q4_1 / Q8_0 block
Q4_1_BYTES = 20  # f16 d, f16 m, 16 bytes of nibbles
Q8_0_BYTES = 34  # f16 d, 32 int8
Q4_0_BYTES = 18  # f16 d, 16 bytes of nibbles
Q5_0_BYTES = 22  # f16 d, 32 high bits, 16 bytes of nibbles
NATIVE_TYPES = ("Q4_1", "Q8_0", "Q4_0", "Q5_0", *KQUANT_BYTES, "F32", "F16", "BF16")  # no dequantization
EIGHT_BIT_NEAREST = ("Q5_1",)  # re-rounded to int8 g32 (4 bits would lose more than the file's own rounding)
TABLE_NAMES = ("model.embed_tokens.weight", "lm_head.weight")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",  # Qwen3's per-head norms
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router
    "ffn_gate_exps": "mlp.experts.gate_proj",  # every expert's, stacked: split per expert (`split_experts`)
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Gemma's four norms a layer, by HF's names (its `post_attention_layernorm` is on the attention's output)
_SANDWICH_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_FUSED_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}  # Phi-3: Q|K|V and gate|up in one
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass
class GGUFTensors:
    tensors: dict[str, torch.Tensor | QuantizedWeight]  # HF names
    types: dict[str, str] = field(default_factory=dict)  # HF name -> GGML type name
    dequantized: list[str] = field(default_factory=list)  # names whose GGML type has no native path
    rerounded: dict[str, str] = field(default_factory=dict)  # of those, name -> the native format it now holds


def hf_name(gguf_name: str, fused_products: bool = False, sandwich_norms: bool = False) -> str | None:
    """The HF name of a GGUF tensor; `fused_products`: the family stores Q|K|V and gate|up fused (Phi-3);
    `sandwich_norms`: four norms a layer (Gemma)."""
    parts = gguf_name.split(".")
    names = {
        **_LAYER_NAMES,
        **(_FUSED_NAMES if fused_products else {}),
        **(_SANDWICH_NAMES if sandwich_norms else {}),
    }
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    return None


def rotary_unpermute_index(rows: int, heads: int) -> torch.Tensor:
    """Row index that undoes llama.cpp's Q/K interleaving (HF row r = GGUF row index[r])."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)


def read_gguf_tensors(
    path: Path,
    num_heads: int,
    num_kv_heads: int,
    rotary_interleaved: bool = True,
    nearest_native: bool = False,
    fused_products: bool = False,
    sandwich_norms: bool = False,
) -> GGUFTensors:
    """`rotary_interleaved`: whether llama.cpp permuted this family's Q/K rows (Llama; not Qwen2/Qwen3/Phi-3).
    `fused_products`: Q|K|V and gate|up are stored fused (Phi-3's `attn_qkv`, and `ffn_up` holding gate|up).
    `sandwich_norms`: Gemma's four norms a layer (stored with their +1 folded in, as this model runs them).
    `nearest_native`: re-round the types no kernel reads into the nearest one that does (else: floats)."""
    from minivllm.loader.gguf_cache import tensor_records

    out = GGUFTensors({})
    for record in tensor_records(path):
        name = hf_name(record.name, fused_products, sandwich_norms)
        if name is None:
            continue
        out.types[name] = record.kind
        value = _convert(record)
        if record.kind not in NATIVE_TYPES:
            out.dequantized.append(name)
            if nearest_native and value.dim() == 2:
                value = _nearest_native(name, record.kind, value)
                out.rerounded[name] = _format(value)
        heads = num_heads if name.endswith("q_proj.weight") else num_kv_heads if name.endswith("k_proj.weight") else 0
        if heads and rotary_interleaved:
            index = rotary_unpermute_index(value.shape[0], heads)
            value = value.rows(index) if not isinstance(value, torch.Tensor) else value[index]
        if ".mlp.experts." in name:
            out.tensors.update(split_experts(name, value, int(record.shape[-1])))
        else:
            out.tensors[name] = value
    return out


def split_experts(name: str, stacked, count: int) -> dict[str, torch.Tensor | QuantizedWeight]:
    """A stacked expert tensor (the experts' rows one after another; quantized row by row) as one weight
    per expert, under each expert's HF name (`...mlp.experts.{e}.gate_proj.weight`)."""
    rows = stacked.shape[0] // count
    prefix, product = name.rsplit(".experts.", 1)
    return {
        f"{prefix}.experts.{e}.{product}": (
            stacked[e * rows : (e + 1) * rows]
            if isinstance(stacked, torch.Tensor)
            else stacked.rows(torch.arange(e * rows, (e + 1) * rows))
        )
        for e in range(count)
    }


def _convert(record) -> torch.Tensor | QuantizedWeight:
    rows = int(np.prod(record.shape[1:]))  # ggml lists dimensions innermost first
    cols = int(record.shape[0])
    values = record.values()
    if record.kind == "Q4_1":
        return q4_1_blocks(values, rows, cols)
    if record.kind == "Q8_0":
        return q8_0_blocks(values, rows, cols)
    if record.kind == "Q4_0":
        return q4_0_blocks(values, rows, cols)
    if record.kind == "Q5_0":
        return q5_0_blocks(values, rows, cols)
    if record.kind in KQUANT_BYTES:
        # one copy of the mapped bytes, as they are: the kernels read these super-blocks
        return KQuantWeight([(record.kind, _mapped_bytes(values).reshape(rows, -1).clone())])
    if record.kind in ("F32", "F16"):
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(rows, cols).squeeze(0)
    from gguf import GGMLQuantizationType, quants

    values = quants.dequantize(values, GGMLQuantizationType[record.kind])
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(rows, cols).squeeze(0)


def q4_1_blocks(raw: np.ndarray, rows: int, cols: int) -> Int4Weight:
    """The blocks regrouped into Int4Weight's rows (every d, every m, then the nibble bytes as stored):
    one copy of the file's bytes, nothing unpacked."""
    blocks = _mapped_bytes(raw).reshape(rows, cols // GROUP, Q4_1_BYTES)
    count = cols // GROUP
    packed = torch.empty(rows, count * Q4_1_BYTES, dtype=torch.uint8)
    packed[:, : 2 * count].view(rows, count, 2).copy_(blocks[..., 0:2])
    packed[:, 2 * count : 4 * count].view(rows, count, 2).copy_(blocks[..., 2:4])
    packed[:, 4 * count :].view(rows, count, Q4_1_BYTES - 4).copy_(blocks[..., 4:])
    return Int4Weight(packed, GROUP)


def q8_0_blocks(raw: np.ndarray, rows: int, cols: int) -> Int8Weight:
    blocks = _mapped_bytes(raw).reshape(rows, cols // GROUP, Q8_0_BYTES)
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, cols)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]  # the file's fp16 scales: half the bytes of fp32
    return Int8Weight(q, d, GROUP)


def _mapped_bytes(raw: np.ndarray) -> torch.Tensor:
    """The file's mapped bytes as a torch view, for torch's strided copies (parallel; numpy's took 5 of the 8 s
    that loading a 1.1B Q8_0 file took). The map is read-only and the view is only copied from, so torch's
    warning that it cannot protect a non-writable array does not apply."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(raw)


def _leading_d(blocks: np.ndarray) -> np.ndarray:
    """The fp16 scale d that Q8_0, Q4_0 and Q5_0 blocks [..., bytes] start with."""
    return blocks[..., 0:2].copy().view(np.float16)[..., 0]


def q4_0_blocks(raw: np.ndarray, rows: int, cols: int) -> Int4Weight:
    """Q4_0 is d*(q - 8): Q4_1's d*q + m with m = -8d, exact in fp16 (a power-of-two multiple of an fp16 d),
    with the same nibble order."""
    blocks = raw.reshape(rows, cols // GROUP, Q4_0_BYTES)
    m = (_leading_d(blocks).astype(np.float32) * -8).astype(np.float16)
    if not np.isfinite(m).all():
        raise ValueError("a Q4_0 scale is too large for its minimum (-8d) to be an fp16 value")
    packed = np.concatenate(
        [blocks[..., 0:2].reshape(rows, -1), m.view(np.uint8).reshape(rows, -1), blocks[..., 2:].reshape(rows, -1)],
        axis=1,
    )
    return Int4Weight(torch.from_numpy(packed), GROUP)


def q5_0_blocks(raw: np.ndarray, rows: int, cols: int) -> Int8Weight:
    """Q5_0 is d*(q - 16), q of 5 bits: int8 codes -16..15 with d per block of 32, exactly (Q8_0's form).
    Element j of a block: byte j's low nibble (j < 16) or byte j-16's high one, and bit j of the high bits."""
    blocks = raw.reshape(rows, cols // GROUP, Q5_0_BYTES)
    d = _leading_d(blocks).astype(np.float32)
    high = blocks[..., 2:6].copy().view("<u4")  # [rows, blocks, 1]
    nibbles = blocks[..., 6:]
    low = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # [rows, blocks, 32]
    fifth = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    codes = (low | (fifth << 4)).astype(np.int8) - np.int8(16)
    return Int8Weight(torch.from_numpy(codes.reshape(rows, cols)), torch.from_numpy(d), GROUP)


def _nearest_native(name: str, kind: str, value: torch.Tensor) -> QuantizedWeight:
    """A dequantized tensor re-rounded into the native format nearest its type (module docstring)."""
    if name in TABLE_NAMES or kind in EIGHT_BIT_NEAREST:
        return quantize_int8(name, value, GROUP)
    if value.shape[1] % SUPER_BLOCK == 0:
        return quantize_q4_k(value)
    return quantize_int4(name, value, GROUP)


def _format(value: QuantizedWeight) -> str:
    return "/".join(value.kinds) if isinstance(value, KQuantWeight) else f"int{value.bits} g{value.group_size}"
