"""Read a Llama GGUF's tensors in the precision they are stored in.

Q4_1 and Q8_0 blocks become Int4Weight / Int8Weight without a detour through floats, Q4_K / Q5_K / Q6_K
super-blocks a KQuantWeight holding the file's bytes as they are; F32/F16/BF16
tensors become torch tensors; any other GGML type is dequantized by the `gguf` package (the caller
says so to the user). Names are mapped to Hugging Face's, and Q/K rows are un-permuted: llama.cpp
stores them interleaved for its rotary layout, and a row permutation commutes with row-wise
quantization, so the blocks can be moved as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from minivllm.quant.formats import KQUANT_BYTES, Int4Weight, Int8Weight, KQuantWeight, QuantizedWeight

GROUP = 32  # elements per Q4_1 / Q8_0 block
Q4_1_BYTES = 20  # f16 d, f16 m, 16 bytes of nibbles
Q8_0_BYTES = 34  # f16 d, 32 int8
NATIVE_TYPES = ("Q4_1", "Q8_0", *KQUANT_BYTES, "F32", "F16", "BF16")  # read with no dequantization

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",  # Qwen3's per-head norms
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass
class GGUFTensors:
    tensors: dict[str, torch.Tensor | QuantizedWeight]  # HF names
    types: dict[str, str] = field(default_factory=dict)  # HF name -> GGML type name
    dequantized: list[str] = field(default_factory=list)  # names whose GGML type has no native path


def hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    return None


def rotary_unpermute_index(rows: int, heads: int) -> torch.Tensor:
    """Row index that undoes llama.cpp's Q/K interleaving (HF row r = GGUF row index[r])."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)


def read_gguf_tensors(path: Path, num_heads: int, num_kv_heads: int, rotary_interleaved: bool = True) -> GGUFTensors:
    """`rotary_interleaved`: whether llama.cpp permuted this family's Q/K rows (Llama; not Qwen2/Qwen3)."""
    from minivllm.loader.gguf_cache import tensor_records

    out = GGUFTensors({})
    for record in tensor_records(path):
        name = hf_name(record.name)
        if name is None:
            continue
        out.types[name] = record.kind
        value = _convert(record)
        if record.kind not in NATIVE_TYPES:
            out.dequantized.append(name)
        heads = num_heads if name.endswith("q_proj.weight") else num_kv_heads if name.endswith("k_proj.weight") else 0
        if heads and rotary_interleaved:
            index = rotary_unpermute_index(value.shape[0], heads)
            value = value.rows(index) if not isinstance(value, torch.Tensor) else value[index]
        out.tensors[name] = value
    return out


def _convert(record) -> torch.Tensor | QuantizedWeight:
    rows = int(np.prod(record.shape[1:]))  # ggml lists dimensions innermost first
    cols = int(record.shape[0])
    values = record.values()
    if record.kind == "Q4_1":
        return q4_1_blocks(values, rows, cols)
    if record.kind == "Q8_0":
        return q8_0_blocks(values, rows, cols)
    if record.kind in KQUANT_BYTES:
        # one copy of the mapped bytes, as they are: the kernels read these super-blocks
        return KQuantWeight([(record.kind, torch.from_numpy(np.array(values, dtype=np.uint8).reshape(rows, -1)))])
    if record.kind in ("F32", "F16"):
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(rows, cols).squeeze(0)
    from gguf import GGMLQuantizationType, quants

    values = quants.dequantize(values, GGMLQuantizationType[record.kind])
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(rows, cols).squeeze(0)


def q4_1_blocks(raw: np.ndarray, rows: int, cols: int) -> Int4Weight:
    """The blocks regrouped into Int4Weight's rows (every d, every m, then the nibble bytes as stored):
    one copy of the file's bytes, nothing unpacked."""
    blocks = raw.reshape(rows, cols // GROUP, Q4_1_BYTES)
    packed = np.concatenate([blocks[..., 0:2].reshape(rows, -1), blocks[..., 2:4].reshape(rows, -1),
                             blocks[..., 4:].reshape(rows, -1)], axis=1)
    return Int4Weight(torch.from_numpy(packed), GROUP)


def q8_0_blocks(raw: np.ndarray, rows: int, cols: int) -> Int8Weight:
    blocks = raw.reshape(rows, cols // GROUP, Q8_0_BYTES)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(rows, cols)
    return Int8Weight(q, d, GROUP)
