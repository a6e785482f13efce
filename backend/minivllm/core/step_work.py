"""What one sequence contributes to a model step: the runner's input, built by the engine's step
inputs and by speculative decoding's proposers. It lives below both so that neither depends on the
other's modules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minivllm.arith import ceil_div


@dataclass
class PromptLogprobsRows:
    """Rows of one chunk (of `SeqWork`) whose log-probs of the next prompt token are wanted."""

    first_row: int  # the chunk's row (position - num_computed) the first target follows
    targets: list[int]  # the token each row from `first_row` on predicts
    top_n: int  # alternatives per row besides the target
    sink: Callable[[list[dict[int, float]], list[int]], None]  # receives (entries, ranks)


@dataclass
class SeqWork:
    """One sequence's share of a step."""

    token_ids: list[int]  # the new tokens to run (1 for a decode)
    num_computed: int  # tokens of the sequence already in the KV cache
    block_table: list[int]
    # logits rows wanted, for the last this many tokens: 1 for a decode or the end of a prompt, 0
    # for a prefill chunk that does not reach it, 1 + k to verify k drafted tokens
    num_logits: int = 1
    # vLLM's prompt_logprobs: rows whose log-probs of the next prompt token are wanted (None: none)
    prompt_logprobs: PromptLogprobsRows | None = None
    # a pooling request's chunk: receives (num_computed, the final hidden states of its rows)
    pooled: Callable[[int, torch.Tensor], None] | None = None

    def blocks_in_use(self, block_size: int) -> list[int]:
        """The block table up to the block of this step's last token."""
        return self.block_table[: ceil_div(self.num_computed + len(self.token_ids), block_size)]
