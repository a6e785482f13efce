"""Pooling requests (embeddings): a prompt's final hidden states folded into one vector, chunk by chunk.

A pooling request runs its prompt through the model like any prefill (chunked, under the step's
token budget) and samples nothing: each chunk hands its rows' final-normed hidden states here, and
the request finishes in the step its last chunk ran. States are folded by position, so a recompute
after a preemption adds no position twice. Mean pooling needs every position to run through the
model, so such a request takes no prefix-cache hit while positions are missing (as prompt
log-probs); last-token pooling only needs the last position, which a cache hit never covers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

POOLING_TYPES = ("last", "mean")  # vLLM's LAST and MEAN poolers for decoder models


@dataclass(frozen=True)
class PoolingParams:
    """How a prompt becomes one vector (vLLM's `PoolingParams`, with the pooler's type): the last
    token's final hidden state or the mean over all tokens, L2-normalised unless `normalize` is False."""

    pooling_type: str = "last"
    normalize: bool = True

    def validate(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")

    def describe(self) -> str:
        return f"{self.pooling_type}{', normalized' if self.normalize else ''}"


@dataclass
class PromptPooling:
    """A pooling request's state: what its prompt's hidden states add up to so far."""

    params: PoolingParams
    num_tokens: int
    folded: int = 0  # positions [0, folded) are accounted for
    total: torch.Tensor | None = None  # mean: the fp32 sum of their states; last: the last position's state

    @property
    def pending(self) -> bool:
        """Mean pooling still misses positions that must run through the model (no cache hit then)."""
        return self.params.pooling_type == "mean" and self.folded < self.num_tokens

    @property
    def done(self) -> bool:
        return self.folded >= self.num_tokens

    def add(self, start: int, hidden: torch.Tensor) -> None:
        """The final hidden states [n, hidden] of positions [start, start + n). Called inside the
        step's forward pass: whatever is kept is copied out of the runner's buffers."""
        end = start + hidden.shape[0]
        if end <= self.folded:  # recomputed after a preemption: counted already
            return
        if self.params.pooling_type == "last":
            if end == self.num_tokens:
                self.total = hidden[-1].float().clone()
        else:
            if start > self.folded:
                raise ValueError(f"hidden states from position {start} on, but only {self.folded} are folded")
            part = hidden[self.folded - start :].float().sum(dim=0)
            self.total = part if self.total is None else self.total + part
        self.folded = end

    def vector(self) -> list[float]:
        """The pooled vector, once every position is folded."""
        if not self.done or self.total is None:
            raise ValueError(f"the prompt is pooled up to position {self.folded} of {self.num_tokens}")
        pooled = self.total / self.num_tokens if self.params.pooling_type == "mean" else self.total
        if self.params.normalize:
            pooled = F.normalize(pooled, dim=0)
        return pooled.tolist()
