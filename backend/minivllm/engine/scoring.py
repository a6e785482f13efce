"""Logits at every position of whole sequences, outside the engine loop: parity tests, the
quantization quality report, perplexity."""

from __future__ import annotations

import itertools

import torch

from minivllm.arith import ceil_div
from minivllm.core.step_work import SeqWork
from minivllm.engine.model_runner import ModelRunner
from minivllm.model.attention import KVCache


def forward_prefills(
    loaded, sequences: list[list[int]], block_size: int = 16, hidden_states_out: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """All sequences as prefills of ONE flattened forward pass through a scratch KV pool. Returns
    each sequence's fp32 logits [len, vocab]; `hidden_states_out` gets every layer's states for
    the whole flattened batch (HF's output_hidden_states convention)."""
    kv, tables = _scratch_pool(loaded, sequences, block_size, loaded.dtype)
    hidden = [] if hidden_states_out is None else hidden_states_out
    ModelRunner(loaded.model, kv).execute(
        [], [SeqWork(list(s), 0, t) for s, t in zip(sequences, tables)], hidden_states_out=hidden
    )
    return _logits_by_sequence(loaded, hidden[-1], [len(s) for s in sequences])


def forward_in_chunks(
    loaded, sequences: list[list[int]], chunk: int, kv_dtype: torch.dtype | None = None, block_size: int = 16
) -> list[torch.Tensor]:
    """Like forward_prefills, but each sequence runs `chunk` tokens a step, so every chunk after its
    first reads the prefix's K/V back from the pool, in `kv_dtype` (default: what `auto` gives): what a
    narrower pool costs shows in the logits, as it does in serving."""
    kv, tables = _scratch_pool(loaded, sequences, block_size, kv_dtype or loaded.kv_auto_dtype)
    runner = ModelRunner(loaded.model, kv)
    parts: list[list[torch.Tensor]] = [[] for _ in sequences]
    for start in range(0, max(map(len, sequences)), chunk):
        active = [(i, s[start : start + chunk]) for i, s in enumerate(sequences) if start < len(s)]
        hidden: list[torch.Tensor] = []  # asking for hidden states keeps every row (no logits-row pick)
        runner.execute([], [SeqWork(piece, start, tables[i]) for i, piece in active], hidden_states_out=hidden)
        for (i, _), logits in zip(active, _logits_by_sequence(loaded, hidden[-1], [len(p) for _, p in active])):
            parts[i].append(logits)
    return [torch.cat(p) for p in parts]


def _scratch_pool(loaded, sequences, block_size: int, dtype: torch.dtype) -> tuple[KVCache, list[list[int]]]:
    """A KV pool just large enough for the sequences, and each one's block table (block 0 unused)."""
    cfg = loaded.config
    blocks = [ceil_div(len(s), block_size) for s in sequences]
    kv = KVCache(
        cfg.num_hidden_layers, sum(blocks) + 1, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype, loaded.device
    )
    starts = itertools.accumulate(blocks[:-1], initial=1)
    return kv, [list(range(first, first + n)) for first, n in zip(starts, blocks)]


def _logits_by_sequence(loaded, final_hidden: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    logits, start = [], 0
    for n in sizes:
        with torch.inference_mode():
            logits.append(loaded.model.compute_logits(final_hidden[start : start + n]))
        start += n
    return logits
