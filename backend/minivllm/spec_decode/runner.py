"""What speculative decoding needs of a model runner, as a protocol: the engine's `ModelRunner`
satisfies it, and this package never imports the engine (the engine imports this package)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from minivllm.core.step_work import SeqWork
from minivllm.model.attention import KVCache


class StepRunner(Protocol):
    model: Any  # the decoder (its `config` names the layer count an early exit is checked against)

    def execute(
        self,
        single: list[SeqWork],
        chunks: list[SeqWork],
        copies: list[tuple[int, int]] | None = None,
        hidden_states_out: list[torch.Tensor] | None = None,
        num_layers: int | None = None,
    ) -> torch.Tensor: ...

    def warmed_up(self, max_rows: int, max_model_len: int, graph_rows: int | None = None) -> StepRunner: ...


# builds a runner over a model and its own KV pool (the draft model's)
RunnerFactory = Callable[[Any, KVCache], StepRunner]
