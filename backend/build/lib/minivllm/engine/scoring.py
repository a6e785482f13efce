"""Logits at every position of whole sequences, outside the engine loop: parity tests, the
quantization quality report, perplexity."""

from __future__ import annotations

import torch

from minivllm.engine.model_runner import ModelRunner, SeqWork
from minivllm.model.attention import KVCache
from minivllm.arith import ceil_div


def forward_prefills(loaded, sequences: list[list[int]], block_size: int = 16,
                     hidden_states_out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """All sequences as prefills of ONE flattened forward pass through a scratch KV pool. Returns
    each sequence's fp32 logits [len, vocab]; `hidden_states_out` gets every layer's states for
    the whole flattened batch (HF's output_hidden_states convention)."""
    cfg = loaded.config
    blocks = [ceil_div(len(s), block_size) for s in sequences]
    kv = KVCache(cfg.num_hidden_layers, sum(blocks) + 1, block_size, cfg.num_key_value_heads, cfg.head_dim,
                 loaded.dtype, loaded.device)
    works, next_block = [], 1  # block 0 left unused
    for s, n in zip(sequences, blocks):
        works.append(SeqWork(list(s), 0, list(range(next_block, next_block + n))))
        next_block += n
    hidden = [] if hidden_states_out is None else hidden_states_out
    ModelRunner(loaded.model, kv).execute([], works, hidden_states_out=hidden)
    logits, start = [], 0
    for s in sequences:
        with torch.inference_mode():
            logits.append(loaded.model.compute_logits(hidden[-1][start:start + len(s)]))
        start += len(s)
    return logits
