"""Llama and Qwen2 GGUF files of named public shapes with random weights, for speed comparisons on the models users
bring (no model can be downloaded here). F16 weights, the embedded model's tokenizer (and so its 49,152-token
vocabulary, not the original's) and chat template; `quantized` turns one into any type llama.cpp's
`llama-quantize` writes. Random weights: the speed and memory are a real model's, the text is not.

    python scripts/make_random_gguf.py tinyllama-1.1b --quant Q4_K_M   # prints the file's path
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minivllm.console import progress


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    rope_theta: float
    tied_embeddings: bool
    context: int = 2048
    rms_eps: float = 1e-5
    arch: str = "llama"  # the GGUF architecture: llama, or qwen2 (a Q|K|V bias)


SHAPES = {  # the published configs' shapes (rope scaling left out: it does not change the speed)
    "tinyllama-1.1b": LlamaShape(2048, 5632, 22, 32, 4, 10000.0, tied_embeddings=False),
    "llama-3.2-1b": LlamaShape(2048, 8192, 16, 32, 8, 500000.0, tied_embeddings=True),
    "llama-3.2-3b": LlamaShape(3072, 8192, 28, 24, 8, 500000.0, tied_embeddings=True),
    "qwen2.5-1.5b": LlamaShape(1536, 8960, 28, 12, 2, 1000000.0, tied_embeddings=True, rms_eps=1e-6, arch="qwen2"),
    "tiny": LlamaShape(64, 128, 2, 4, 2, 10000.0, tied_embeddings=False),  # seconds to write: for tests
    "tiny-qwen2": LlamaShape(64, 128, 2, 4, 2, 10000.0, tied_embeddings=True, arch="qwen2"),
}
WEIGHT_STD = 0.02  # HF's initializer range: activations stay in a trained model's range through the layers


def _tensor_shapes(shape: LlamaShape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape [rows, columns]) in llama.cpp's names and order."""
    head_dim = shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim
    tensors = [("token_embd.weight", (vocab, shape.hidden))]
    for i in range(shape.layers):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (shape.hidden,)),
            (f"blk.{i}.attn_q.weight", (shape.hidden, shape.hidden)),
            (f"blk.{i}.attn_k.weight", (kv, shape.hidden)),
            (f"blk.{i}.attn_v.weight", (kv, shape.hidden)),
            *_biases(shape, i, kv),
            (f"blk.{i}.attn_output.weight", (shape.hidden, shape.hidden)),
            (f"blk.{i}.ffn_norm.weight", (shape.hidden,)),
            (f"blk.{i}.ffn_gate.weight", (shape.intermediate, shape.hidden)),
            (f"blk.{i}.ffn_up.weight", (shape.intermediate, shape.hidden)),
            (f"blk.{i}.ffn_down.weight", (shape.hidden, shape.intermediate)),
        ]
    tensors.append(("output_norm.weight", (shape.hidden,)))
    if not shape.tied_embeddings:
        tensors.append(("output.weight", (vocab, shape.hidden)))
    return tensors


def _biases(shape: LlamaShape, layer: int, kv: int) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2's Q, K and V biases (llama.cpp requires them for the architecture); none for Llama."""
    if shape.arch != "qwen2":
        return []
    return [(f"blk.{layer}.attn_{p}.bias", (n,)) for p, n in (("q", shape.hidden), ("k", kv), ("v", kv))]


def _add_metadata(writer, shape: LlamaShape, name: str, tokenizer_gguf: Path) -> int:
    """The shape's hyperparameters and the tokenizer's fields; returns the vocabulary's size."""
    writer.add_name(f"random-{name}")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_file_type(1)  # MOSTLY_F16
    return add_tokenizer_fields(writer, tokenizer_gguf)


def add_tokenizer_fields(writer, source: Path) -> int:
    """Every `tokenizer.*` field of another GGUF (vocabulary, merges, special ids, chat template); returns
    the vocabulary's size."""
    from gguf import GGUFReader, GGUFValueType

    fields = GGUFReader(str(source)).fields
    for key, field in fields.items():
        if key.startswith("tokenizer."):
            writer.add_key_value(
                key,
                field.contents(),
                field.types[0],
                sub_type=field.types[1] if field.types[0] == GGUFValueType.ARRAY else None,
            )
    return len(fields["tokenizer.ggml.tokens"].data)


def write_random_gguf(name: str, path: Path, seed: int = 0, tokenizer_gguf: Path | None = None) -> Path:
    """A GGUF of shape SHAPES[name] with random F16 weights (unit norms, F32 biases), written one tensor at a
    time: memory stays at one tensor, not the file."""
    from gguf import GGUFWriter

    from minivllm.loader.gguf_loader import embedded_model_path

    shape = SHAPES[name]
    tokenizer_gguf = tokenizer_gguf or embedded_model_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    writer = GGUFWriter(str(partial), shape.arch)
    tensors = _tensor_shapes(shape, _add_metadata(writer, shape, name, tokenizer_gguf))
    for tensor_name, dims in tensors:
        dtype = np.float32 if len(dims) == 1 else np.float16  # norms in F32, as llama.cpp's converter writes
        writer.add_tensor_info(tensor_name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    total = sum(int(np.prod(d)) for _, d in tensors)
    done = 0
    for i, (tensor_name, dims) in enumerate(tensors):
        if tensor_name.endswith(".bias"):
            data = rng.standard_normal(dims, dtype=np.float32) * WEIGHT_STD
        elif len(dims) == 1:
            data = np.ones(dims, dtype=np.float32)
        else:
            data = (rng.standard_normal(dims, dtype=np.float32) * WEIGHT_STD).astype(np.float16)
        writer.write_tensor_data(data)
        done += data.size
        if i % 20 == 0 or i == len(tensors) - 1:
            progress(f"writing {path.name}: {done / total:.0%} of {total / 1e9:.2f}B parameters")
    writer.close()
    partial.rename(path)
    return path


def find_llama_quantize() -> Path:
    """llama.cpp's `llama-quantize`, built beside `llama-batched-bench` by scripts/build_llamacpp.sh."""
    from minivllm.bench.llamacpp import find_llamacpp_bench

    binary = find_llamacpp_bench().with_name("llama-quantize")
    if not binary.is_file():
        raise FileNotFoundError(f"{binary} is missing: run `bash scripts/build_llamacpp.sh` (it builds llama-quantize)")
    return binary


def quantized(name: str, quant: str, cache: Path, seed: int = 0) -> Path:
    """The random `name`-shaped file in llama.cpp's type `quant` (F16: as written), made once into `cache`."""
    f16 = cache / f"random-{name}-F16.gguf"
    if not f16.is_file():
        write_random_gguf(name, f16, seed)
    if quant.upper() == "F16":
        return f16
    out = cache / f"random-{name}-{quant}.gguf"
    if not out.is_file():
        progress(f"llama-quantize {f16.name} -> {out.name} ({quant})")
        partial = out.with_suffix(".partial")
        proc = subprocess.run(
            [str(find_llama_quantize()), str(f16), str(partial), quant], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"llama-quantize failed ({proc.returncode}):\n" + "\n".join(proc.stderr.splitlines()[-15:])
            )
        partial.rename(out)
    return out
