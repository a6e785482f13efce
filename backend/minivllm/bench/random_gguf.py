"""Llama, Qwen2, Gemma 2 and Qwen3-MoE GGUF files of named public shapes with random weights, for speed
comparisons on the models users bring (no model can be downloaded here). F16 weights, the embedded model's
tokenizer (and so its 49,152-token vocabulary, not the original's) and chat template; `quantized` turns one into
any type llama.cpp's `llama-quantize` writes. Random weights: the speed and memory are a real model's, the text is
not.

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
    # the GGUF architecture: llama; qwen2 (a Q|K|V bias); gemma2 (post-norms, soft-capping, a sliding window on
    # alternate layers); qwen3moe (per-head Q/K norms, every layer's MLP a mixture of experts)
    arch: str = "llama"
    head_dim: int | None = None  # where it is not hidden / heads
    sliding_window: int | None = None
    softcaps: tuple[float, float] | None = None  # Gemma 2's attention and final logit soft-capping
    experts: tuple[int, int, int] | None = None  # (experts, experts a token, each expert's intermediate size)

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads


SHAPES = {  # the published configs' shapes (rope scaling left out: it does not change the speed)
    "tinyllama-1.1b": LlamaShape(2048, 5632, 22, 32, 4, 10000.0, tied_embeddings=False),
    "llama-3.2-1b": LlamaShape(2048, 8192, 16, 32, 8, 500000.0, tied_embeddings=True),
    "llama-3.2-3b": LlamaShape(3072, 8192, 28, 24, 8, 500000.0, tied_embeddings=True),
    "qwen2.5-1.5b": LlamaShape(1536, 8960, 28, 12, 2, 1000000.0, tied_embeddings=True, rms_eps=1e-6, arch="qwen2"),
    "gemma-2-2b": LlamaShape(
        2304,
        9216,
        26,
        8,
        4,
        10000.0,
        tied_embeddings=True,
        context=8192,
        rms_eps=1e-6,
        arch="gemma2",
        head_dim=256,
        sliding_window=4096,
        softcaps=(50.0, 30.0),
    ),
    # Qwen3-30B-A3B's layers (128 experts of 768, 8 a token) at 2 of its 48, as `random:qwen3-30b-a3b-2l`
    "qwen3-30b-a3b-2l": LlamaShape(
        2048,
        6144,
        2,
        32,
        4,
        1000000.0,
        tied_embeddings=False,
        rms_eps=1e-6,
        arch="qwen3moe",
        head_dim=128,
        experts=(128, 8, 768),
    ),
    "tiny": LlamaShape(64, 128, 2, 4, 2, 10000.0, tied_embeddings=False),  # seconds to write: for tests
    "tiny-qwen2": LlamaShape(64, 128, 2, 4, 2, 10000.0, tied_embeddings=True, arch="qwen2"),
    "tiny-gemma2": LlamaShape(
        64,
        128,
        2,
        4,
        2,
        10000.0,
        tied_embeddings=True,
        arch="gemma2",
        head_dim=32,
        sliding_window=16,
        softcaps=(50.0, 30.0),
    ),
    "tiny-qwen3moe": LlamaShape(
        64, 128, 2, 4, 2, 10000.0, tied_embeddings=False, arch="qwen3moe", head_dim=32, experts=(4, 2, 32)
    ),
}
WEIGHT_STD = 0.02  # HF's initializer range: activations stay in a trained model's range through the layers


def _tensor_shapes(shape: LlamaShape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape [rows, columns]) in llama.cpp's names and order."""
    q, kv = shape.heads * shape.head_size, shape.kv_heads * shape.head_size
    tensors = [("token_embd.weight", (vocab, shape.hidden))]
    for i in range(shape.layers):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (shape.hidden,)),
            (f"blk.{i}.attn_q.weight", (q, shape.hidden)),
            (f"blk.{i}.attn_k.weight", (kv, shape.hidden)),
            (f"blk.{i}.attn_v.weight", (kv, shape.hidden)),
            *_biases(shape, i, kv),
            *_qk_norms(shape, i),
            (f"blk.{i}.attn_output.weight", (shape.hidden, q)),
            *_post_norm(shape, i, "post_attention_norm"),
            (f"blk.{i}.ffn_norm.weight", (shape.hidden,)),
            *(_experts(shape, i) if shape.experts else _mlp(shape, i)),
            *_post_norm(shape, i, "post_ffw_norm"),
        ]
    tensors.append(("output_norm.weight", (shape.hidden,)))
    if not shape.tied_embeddings:
        tensors.append(("output.weight", (vocab, shape.hidden)))
    return tensors


def _mlp(shape: LlamaShape, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (f"blk.{layer}.ffn_gate.weight", (shape.intermediate, shape.hidden)),
        (f"blk.{layer}.ffn_up.weight", (shape.intermediate, shape.hidden)),
        (f"blk.{layer}.ffn_down.weight", (shape.hidden, shape.intermediate)),
    ]


def _experts(shape: LlamaShape, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen3-MoE's router and stacked experts [experts, rows, columns], as llama.cpp's converter writes them."""
    count, _, size = shape.experts
    return [
        (f"blk.{layer}.ffn_gate_inp.weight", (count, shape.hidden)),
        (f"blk.{layer}.ffn_gate_exps.weight", (count, size, shape.hidden)),
        (f"blk.{layer}.ffn_up_exps.weight", (count, size, shape.hidden)),
        (f"blk.{layer}.ffn_down_exps.weight", (count, shape.hidden, size)),
    ]


def _qk_norms(shape: LlamaShape, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen3's per-head Q and K RMSNorms."""
    if shape.arch != "qwen3moe":
        return []
    return [(f"blk.{layer}.attn_{p}_norm.weight", (shape.head_size,)) for p in ("q", "k")]


def _post_norm(shape: LlamaShape, layer: int, name: str) -> list[tuple[str, tuple[int, ...]]]:
    """Gemma 2's norms after attention and after the MLP."""
    return [(f"blk.{layer}.{name}.weight", (shape.hidden,))] if shape.arch == "gemma2" else []


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
    writer.add_rope_dimension_count(shape.head_size)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    if shape.head_dim:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if shape.softcaps:
        writer.add_attn_logit_softcapping(shape.softcaps[0])
        writer.add_final_logit_softcapping(shape.softcaps[1])
    if shape.experts:
        count, used, size = shape.experts
        writer.add_expert_count(count)
        writer.add_expert_used_count(used)
        writer.add_expert_feed_forward_length(size)
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
        dtype = _stored_dtype(tensor_name, dims)
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
            data = (rng.standard_normal(dims, dtype=np.float32) * WEIGHT_STD).astype(_stored_dtype(tensor_name, dims))
        writer.write_tensor_data(data)
        done += data.size
        if i % 20 == 0 or i == len(tensors) - 1:
            progress(f"writing {path.name}: {done / total:.0%} of {total / 1e9:.2f}B parameters")
    writer.close()
    partial.rename(path)
    return path


def _stored_dtype(name: str, dims: tuple[int, ...]) -> type:
    """F32 for norms and the MoE router (llama.cpp's converter keeps both in F32, and llama-quantize leaves them),
    F16 for the rest."""
    return np.float32 if len(dims) == 1 or ".ffn_gate_inp." in name else np.float16


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
