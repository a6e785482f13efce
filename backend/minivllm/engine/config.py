"""Engine configuration and KV-pool sizing."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from minivllm.errors import ConfigError
from minivllm.model.attention import KVCache
from minivllm.model.config import LlamaConfig

# --kv-cache-dtype: the KV pool's element type (vLLM's option). auto: the model's activation dtype, or
# fp16 for quantized weights on a CPU (LoadedModel.kv_auto_dtype). A narrower pool holds twice the tokens
# in the same memory and halves what decode attention reads.
KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory(text: str | int) -> int:
    """'2GiB', '512MB', '1.5 GiB', 1000 -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse memory size {text!r}; use e.g. '2GiB', '512MiB' or '1GB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # set directly, or derived from kv_cache_memory
    kv_cache_memory: str | int = "512MiB"
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's max_position_embeddings (capped at 8192)
    enable_prefix_caching: bool = True
    metrics_interval_s: float = 0.5
    max_kv_cache_memory: str | int | None = None  # the most a reconfiguration may give the KV pool
    # A request's stop list is compiled into an automaton per sequence and travels with the request
    # in every dashboard snapshot: its size is bounded.
    max_stop_strings: int = 64
    max_stop_chars: int = 4096
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES

    def with_changes(self, **changes) -> EngineConfig:
        return replace(self, **changes)

    def resolved_max_model_len(self, model: LlamaConfig) -> int:
        limit = min(model.max_position_embeddings, 8192)
        if self.max_model_len is not None and self.max_model_len > model.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {model.max_position_embeddings}"
            )
        return self.max_model_len or limit

    def kv_dtype(self, auto_dtype: torch.dtype) -> torch.dtype:
        """The KV pool's element type for a model whose `auto` choice is `auto_dtype`."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or auto_dtype

    def kv_pool(self, model: LlamaConfig, auto_dtype: torch.dtype) -> tuple[int, torch.dtype, int]:
        """(blocks, element type, bytes) of the KV pool these settings give a model."""
        dtype = self.kv_dtype(auto_dtype)
        blocks = self.resolved_num_blocks(model, dtype)
        return blocks, dtype, blocks * self.bytes_per_block(model, dtype)

    def bytes_per_block(self, model: LlamaConfig, dtype) -> int:
        return KVCache.bytes_per_block(
            model.num_hidden_layers, self.block_size, model.num_key_value_heads, model.head_dim, dtype
        )

    def resolved_num_blocks(self, model: LlamaConfig, dtype) -> int:
        if self.num_blocks is not None:
            blocks = self.num_blocks
        else:
            blocks = parse_memory(self.kv_cache_memory) // self.bytes_per_block(model, dtype)
        if blocks < 1:
            raise ValueError(
                f"the KV cache needs at least 1 block (got {blocks}); raise --kv-cache-memory or --num-blocks"
            )
        return blocks

    def max_single_token_rows(self, speculative) -> int:
        """The most single-token rows a step can hold: a sequence each, and with speculation
        (`SpeculativeConfig`) each speculating sequence's last token plus its drafts (a verify step)."""
        if speculative is None:
            return self.max_num_seqs
        speculating = min(self.max_num_seqs, speculative.disable_by_batch_size or self.max_num_seqs)
        rows = speculating * (1 + speculative.num_speculative_tokens) + self.max_num_seqs - speculating
        return min(rows, max(self.max_num_batched_tokens, self.max_num_seqs))

    def validate(self) -> None:
        """Raises ConfigError naming the first setting that can never work."""
        for name in ("block_size", "num_blocks", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}", name)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
                "kv_cache_dtype",
            )
