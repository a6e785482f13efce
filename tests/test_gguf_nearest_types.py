"""GGUF types beyond Q4_1 / Q8_0 / K-quants: Q4_0 and Q5_0 move exactly into native formats; Q5_1, Q3_K
(and the other types no kernel reads) are re-rounded to the nearest native one under `auto`, with a
warning, and read as their exact dequantization otherwise. The oracle is gguf-py's dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants

from minivllm.loader import _dequantized_note
from minivllm.loader.gguf_tensors import read_gguf_tensors
from minivllm.quant.formats import Int4Weight, Int8Weight, KQuantWeight
from minivllm.quant.kquant_pack import quantize_q4_k

ROWS, COLS = 48, 512
NAMES = {
    "Q4_0": "blk.0.attn_q.weight",
    "Q5_0": "blk.0.attn_output.weight",
    "Q5_1": "blk.0.ffn_up.weight",
    "Q3_K": "blk.0.ffn_gate.weight",
}
HF = {
    "Q4_0": "model.layers.0.self_attn.q_proj.weight",
    "Q5_0": "model.layers.0.self_attn.o_proj.weight",
    "Q5_1": "model.layers.0.mlp.up_proj.weight",
    "Q3_K": "model.layers.0.mlp.gate_proj.weight",
}


def q3_k_blocks(rng) -> np.ndarray:
    """Valid random Q3_K super-blocks (gguf-py has no Q3_K quantizer): every bit random but the trailing
    fp16 d, finite and small."""
    size = quants.GGML_QUANT_SIZES[GGMLQuantizationType.Q3_K][1]
    blocks = rng.integers(0, 256, (ROWS, COLS // 256, size), dtype=np.uint8)
    d = (rng.random((ROWS, COLS // 256)) * 0.001 + 1e-5).astype(np.float16)
    blocks[..., -2:] = d.view(np.uint8).reshape(ROWS, COLS // 256, 2)
    return blocks.reshape(ROWS, -1)


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    rng = np.random.default_rng(5)
    raw = {
        kind: quants.quantize((rng.standard_normal((ROWS, COLS)) * 0.02).astype(np.float32), GGMLQuantizationType[kind])
        for kind in ("Q4_0", "Q5_0", "Q5_1")
    }
    raw["Q3_K"] = q3_k_blocks(rng)
    path = tmp_path_factory.mktemp("types") / "mixed.gguf"
    writer = GGUFWriter(str(path), "llama")
    for kind, data in raw.items():
        writer.add_tensor(NAMES[kind], data, raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    exact = {
        kind: torch.from_numpy(quants.dequantize(data, GGMLQuantizationType[kind]).reshape(ROWS, COLS).copy())
        for kind, data in raw.items()
    }
    return path, exact


def read(path, nearest_native: bool):
    return read_gguf_tensors(path, 4, 4, rotary_interleaved=False, nearest_native=nearest_native)


def test_q4_0_and_q5_0_are_native_formats_holding_the_files_exact_values(mixed_file):
    path, exact = mixed_file
    got = read(path, nearest_native=True)
    q4_0, q5_0 = got.tensors[HF["Q4_0"]], got.tensors[HF["Q5_0"]]
    assert isinstance(q4_0, Int4Weight) and q4_0.group_size == 32
    assert isinstance(q5_0, Int8Weight) and q5_0.group_size == 32
    assert torch.equal(q4_0.dequantize(), exact["Q4_0"]) and torch.equal(q5_0.dequantize(), exact["Q5_0"])
    assert HF["Q4_0"] not in got.dequantized and HF["Q5_0"] not in got.rerounded


def test_other_types_are_re_rounded_to_the_nearest_native_format_under_auto(mixed_file):
    path, exact = mixed_file
    got = read(path, nearest_native=True)
    q5_1, q3_k = got.tensors[HF["Q5_1"]], got.tensors[HF["Q3_K"]]
    assert isinstance(q5_1, Int8Weight) and q5_1.group_size == 32
    assert isinstance(q3_k, KQuantWeight) and q3_k.kinds == ["Q4_K"]
    assert got.rerounded == {HF["Q5_1"]: "int8 g32", HF["Q3_K"]: "Q4_K"}
    # int8 g32: within half a step of each block's largest magnitude / 127
    step = exact["Q5_1"].reshape(ROWS, -1, 32).abs().amax(-1, keepdim=True) / 127
    assert ((q5_1.dequantize() - exact["Q5_1"]).reshape(ROWS, -1, 32).abs() <= step / 2 + 1e-7).all()
    error = (q3_k.dequantize() - exact["Q3_K"]).abs().mean() / exact["Q3_K"].abs().mean()
    assert error < 0.15  # a 4-bit grid over the 3-bit codes' values
    note = _dequantized_note(got)
    assert note.startswith("warning: 2 tensor(s) of GGUF type Q3_K, Q5_1") and "Q3_K -> Q4_K" in note
    assert "Q5_1 -> int8 g32" in note and "--quantization none" in note


def test_without_nearest_native_the_other_types_are_their_exact_dequantization(mixed_file):
    path, exact = mixed_file
    got = read(path, nearest_native=False)
    for kind in ("Q5_1", "Q3_K"):
        assert torch.equal(got.tensors[HF[kind]], exact[kind])
    assert not got.rerounded and "dequantized at load" in _dequantized_note(got)


def test_the_q4_k_packer_writes_blocks_gguf_py_reads_as_it_does():
    from gguf import quants as q

    w = torch.randn(16, 768) * 0.03
    w[0] = w[0].abs()  # a row with no negative value: the minimum is 0, never above
    w[1] = 0
    packed = quantize_q4_k(w)
    raw = packed.parts[0][1].numpy()
    theirs = torch.from_numpy(q.dequantize(raw, GGMLQuantizationType.Q4_K).reshape(16, 768).copy())
    assert torch.equal(packed.dequantize(), theirs)
    assert torch.equal(theirs[1], torch.zeros(768))
    step = (w.reshape(16, -1, 32).amax(-1) - w.reshape(16, -1, 32).amin(-1).clamp(max=0)) / 15
    assert ((theirs - w).reshape(16, -1, 32).abs().amax(-1) <= step * 0.75 + 1e-6).all()
