"""Drawing a draft token from a draft's logits, as the request would sample: greedy requests take
the argmax (the draft is then deterministic: q is one-hot), sampled ones draw from the request's
temperature / top-k / top-p / min-p distribution q, which verification needs."""

from __future__ import annotations

import torch

from minivllm.core.request import Sequence
from minivllm.sampling.sampler import Sampler, SamplingRow


def draw_drafts(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[torch.Tensor | None]]:
    """One draft token per row of `logits` [len(seqs), vocab]; the distribution it came from per
    row (None for greedy rows)."""
    greedy = [s.request.params.is_greedy for s in seqs]
    tokens = logits.argmax(dim=-1).tolist() if any(greedy) else [0] * len(seqs)
    probs: list[torch.Tensor | None] = [None] * len(seqs)
    sampled = [i for i, g in enumerate(greedy) if not g]
    if sampled:
        rows = [SamplingRow(seqs[i].request.params, (), (), seqs[i].generator) for i in sampled]
        q = Sampler.probabilities(logits[sampled].float(), rows)
        for row, i in enumerate(sampled):
            probs[i] = q[row]
            tokens[i] = int(torch.multinomial(q[row], 1, generator=seqs[i].generator))
    return tokens, probs
