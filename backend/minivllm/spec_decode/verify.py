"""Verifying one sequence's drafts against the target's k + 1 logits rows, through the same
sampling stages as a plain step: min_tokens and the penalties see, at each position, the output
so far plus the drafts before that position, exactly what decoding token by token would see."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.core.request import Sequence
from minivllm.sampling.sampler import Sampler, SamplingRow, raw_logprobs
from minivllm.spec_decode.rejection import accept_greedy, rejection_sample


@dataclass
class Verified:
    proposed: list[int]
    tokens: list[int]  # accepted drafts, then the target's own token: len(tokens) = accepted + 1
    logprobs: list[float]  # of each emitted token under the target's raw distribution
    top: list[list[tuple[int, float]]] | None

    @property
    def num_accepted(self) -> int:
        return len(self.tokens) - 1


def verify_drafts(
    sampler: Sampler, seq: Sequence, drafts: list[int], logits: torch.Tensor, eos_id: int | None
) -> Verified:
    """`logits`: the target's raw rows [len(drafts) + 1, vocab] for this sequence."""
    rows = _position_rows(seq, drafts, eos_id)
    processed = sampler.processed(logits, rows)
    if seq.request.params.is_greedy:
        tokens = accept_greedy(processed.argmax(dim=-1).tolist(), drafts)
    else:
        probs = Sampler.probabilities(processed, rows)
        tokens = rejection_sample(probs, drafts, seq.draft_probs, seq.generator)
    emitted = len(tokens)
    chosen = torch.tensor(tokens, dtype=torch.long, device=logits.device)
    logprobs, top = raw_logprobs(logits[:emitted], chosen, rows[:emitted])
    return Verified(list(drafts), tokens, logprobs, top)


def _position_rows(seq: Sequence, drafts: list[int], eos_id: int | None) -> list[SamplingRow]:
    params = seq.request.params
    reads = params.reads_output_tokens
    outputs = seq.output_token_ids if reads else []
    return [
        SamplingRow(params, seq.request.prompt_token_ids, outputs + drafts[:i] if reads else [], seq.generator, eos_id)
        for i in range(len(drafts) + 1)
    ]
