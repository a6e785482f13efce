"""Engine configuration and KV-pool sizing."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from minivllm.core.kv_window import KVWindow
from minivllm.errors import ConfigError
from minivllm.model.attention import KVCache
from minivllm.model.config import LlamaConfig

# --kv-cache-dtype: the KV pool's element type (vLLM's option). auto: the model's activation dtype, or
# fp16 for quantized weights on a CPU (LoadedModel.kv_auto_dtype). A narrower pool holds twice the tokens
# in the same memory and halves what decode attention reads. int8 / fp8_e4m3: 8 bits a value with a scale per
# token and KV head (model/kv_quant.py), ~1.9x fp16's tokens; int8 is read by the native and Triton kernels,
# fp8 by torch only (gather + dequantize).
KV_CACHE_DTYPES = {
    "auto": None,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
}


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The --kv-cache-dtype name of a pool's element type (fp8_e4m3 for torch's float8_e4m3fn)."""
    return next(name for name, d in KV_CACHE_DTYPES.items() if d == dtype)


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
    # Optimisations that `minivllm bench ablation` turns off one at a time (core/scheduler.py
    # SchedulerConfig says what each switch does); recompute_kv also turns prefix caching off.
    enable_chunked_prefill: bool = True
    static_batching: bool = False
    recompute_kv: bool = False
    kv_offload_dir: str | None = None  # the prefix cache's disk tier (engine/kv_disk_tier.py); None: RAM only
    kv_offload_size: str | int = "4GiB"  # the most the disk tier keeps; least recently used files go first
    # StreamingLLM (core/kv_window.py): keep each sequence's first kv_sinks tokens and its last ~kv_window
    # in the KV cache, so a conversation of any length runs in flat memory; None: full attention
    kv_window: int | None = None
    kv_sinks: int = 4
    tensor_parallel_size: int = 1  # ranks the model is split over (engine/tp_workers.py)

    @property
    def window(self) -> KVWindow | None:
        return None if self.kv_window is None else KVWindow(self.kv_window, self.kv_sinks, self.block_size)

    def length_limit(self, max_model_len: int) -> int:
        """The most tokens a sequence may reach: max_model_len, unbounded under a KV window."""
        return max_model_len if self.kv_window is None else 2**62

    def _validate_window(self, speculative) -> None:
        if self.kv_window is not None and self.kv_window < 1:
            raise ConfigError(f"kv_window must be >= 1, got {self.kv_window}", "kv_window")
        if self.kv_sinks < 0:
            raise ConfigError(f"kv_sinks must be >= 0, got {self.kv_sinks}", "kv_sinks")
        refused = {
            "kv_cache_dtype": self.kv_cache_dtype in ("int8", "fp8_e4m3"),  # shifting keys would requantize them
            "speculative_config": speculative is not None,  # a rollback cannot undo a drop
            "recompute_kv": self.recompute_kv,  # recomputes from position 0 over blocks it dropped
            "enable_chunked_prefill": not self.enable_chunked_prefill,  # a long context never fits one step
        }
        for name, bad in refused.items():
            if bad and self.kv_window is not None:
                raise ConfigError(f"kv_window cannot be combined with {name} (--kv-window with it is refused)", name)

    def check_window_positions(self, model: LlamaConfig) -> None:
        """A windowed sequence's rotary positions reach sinks + window + one drop + a step's tokens: the
        model's rotary tables (max_model_len when set, else max_position_embeddings) must reach that far."""
        window = self.window
        if window is None:
            return
        tables = self.max_model_len or model.max_position_embeddings
        needed = window.max_cache_tokens(self.max_num_batched_tokens)
        if needed > tables:
            raise ConfigError(
                f"kv_window {self.kv_window} + kv_sinks {self.kv_sinks} (in blocks of {self.block_size}, plus a drop "
                f"of {window.drop_blocks} blocks) + max_num_batched_tokens {self.max_num_batched_tokens} = {needed} "
                f"cache positions, past the model's {tables} rotary positions; lower kv_window or "
                "max_num_batched_tokens",
                "kv_window",
            )

    @property
    def kv_offload_bytes(self) -> int:
        """The disk tier's bound in bytes; 0 without one."""
        return parse_memory(self.kv_offload_size) if self.kv_offload_dir else 0

    def _validate_offload(self) -> None:
        if not self.enable_prefix_caching:
            raise ConfigError("kv_offload_dir keeps prefix-cache blocks: it needs prefix caching on", "kv_offload_dir")
        try:
            size = parse_memory(self.kv_offload_size)
        except ValueError as e:
            raise ConfigError(str(e), "kv_offload_size") from None
        if size < 1:
            raise ConfigError(f"kv_offload_size must be positive, got {self.kv_offload_size!r}", "kv_offload_size")

    @property
    def caches_prefixes(self) -> bool:
        """Prefix caching in effect: never without a KV cache (recompute_kv), which it is a part of."""
        return self.enable_prefix_caching and not self.recompute_kv

    def with_changes(self, **changes) -> EngineConfig:
        return replace(self, **changes)

    def resolved_max_model_len(self, model: LlamaConfig) -> int:
        limit = min(model.max_position_embeddings, 8192)
        if self.max_model_len is not None and self.max_model_len > model.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {model.max_position_embeddings}"
            )
        self.check_window_positions(model)
        if self.kv_window is not None and model.attention_window is not None:
            raise ConfigError(
                f"kv_window cannot be combined with the model's own sliding-window attention "
                f"({model.attention_window} tokens), which mini-vllm serves exactly",
                "kv_window",
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

    def validate(self, speculative=None) -> None:
        """Raises ConfigError naming the first setting that can never work (`speculative`: the engine's
        speculative decoding setup, which a KV window refuses)."""
        for name in ("block_size", "num_blocks", "max_num_batched_tokens", "max_num_seqs", "tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}", name)
        if self.kv_offload_dir is not None:
            self._validate_offload()
        self._validate_window(speculative)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
                "kv_cache_dtype",
            )
