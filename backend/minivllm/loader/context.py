"""A sliding-window model's context, capped at its window so that its attention is served exactly.

A query of a sliding-window layer attends to the last `sliding_window` tokens, itself included. A model
whose every layer has the window (`LlamaConfig.attention_window`: Mistral) is served exactly at any
length (model/attention.py) and keeps its context. Elsewhere (Gemma's alternating layers, Phi-3, Qwen)
within the window it is full attention, which the paged pool serves: such a model is loaded with
`max_position_embeddings` capped at the window (the engine's default max_model_len follows it), and a
longer max_model_len asked for is refused: past the window the outputs would differ from the model's.
"""

from __future__ import annotations

import dataclasses

from minivllm.console import progress
from minivllm.model.config import LlamaConfig, UnsupportedModelError


def fit_sliding_window(cfg: LlamaConfig, max_model_len: int | None) -> LlamaConfig:
    """`cfg` with its context capped at its sliding window (one line says so), or an UnsupportedModelError
    when `max_model_len` asks for more than the window."""
    window = cfg.sliding_window
    if window is None or window >= cfg.max_position_embeddings or cfg.attention_window is not None:
        return cfg  # the window never binds, or is served exactly
    if max_model_len is not None and max_model_len > window:
        raise UnsupportedModelError(
            f"model '{cfg.name}' uses sliding-window attention over {window} tokens; mini-vllm serves it "
            f"exactly only up to that length (full attention there), so --max-model-len {max_model_len} is "
            f"refused: pass --max-model-len {window} or less"
        )
    if max_model_len is None:
        progress(
            f"{cfg.name}: context capped at its sliding window of {window} tokens (of {cfg.max_position_embeddings}): "
            f"within the window sliding-window attention is full attention, so outputs are the model's"
        )
    return dataclasses.replace(cfg, max_position_embeddings=window)
