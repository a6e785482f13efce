"""Exact verification of drafted tokens (Leviathan et al., 2023; Chen et al., 2023).

The target model scores the last committed token and the k drafts in one pass: k + 1 rows of
logits. Greedy: the drafts are kept while they equal the target's argmax; the first mismatch is
replaced by the target's token (so the output is exactly what decoding without drafts gives).
Sampling: draft i is accepted with probability min(1, p(d)/q(d)); at the first rejection the
token is drawn from the normalised residual max(0, p - q), and when all k pass a bonus token is
drawn from the last row. The emitted tokens then follow the target distribution p exactly, for
any draft distribution q. A deterministic proposer (n-gram lookup, a greedy draft) has q one-hot
at its draft: accept with p(d), resample from p with d removed.
"""

from __future__ import annotations

import torch


def accept_greedy(targets: list[int], drafts: list[int]) -> list[int]:
    """`targets`: the argmax at each of the k + 1 positions. Returns the tokens to emit: the
    target's tokens up to and including the first one that disagrees with its draft."""
    emitted = []
    for target, draft in zip(targets, drafts):
        emitted.append(target)
        if target != draft:
            return emitted
    emitted.append(targets[len(drafts)])
    return emitted


def rejection_sample(
    probs: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None, generator: torch.Generator | None
) -> list[int]:
    """`probs`: the target's sampling distribution at each of the k + 1 positions [k + 1, V];
    `draft_probs`: the draft's [k, V], or None for one-hot drafts. Draws come from `generator`
    (a seeded request's own) or torch's default one."""
    emitted = []
    for i, draft in enumerate(drafts):
        p = probs[i]
        q_draft = 1.0 if draft_probs is None else float(draft_probs[i, draft])
        if float(_uniform(generator, p.device)) * q_draft < float(p[draft]):
            emitted.append(draft)
            continue
        emitted.append(_draw(_residual(p, draft, None if draft_probs is None else draft_probs[i]), generator))
        return emitted
    emitted.append(_draw(probs[len(drafts)], generator))
    return emitted


def _residual(p: torch.Tensor, draft: int, q: torch.Tensor | None) -> torch.Tensor:
    """max(0, p - q): with q one-hot at the draft, p without the draft."""
    if q is None:
        residual = p.clone()
        residual[draft] = 0.0
    else:
        residual = (p - q).clamp_min_(0.0)
    # p == q exactly leaves nothing (a rejection then has probability 0 anyway): draw from p
    return residual if float(residual.sum()) > 0.0 else p


def _uniform(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    return torch.rand((), generator=generator, device=generator.device if generator is not None else device)


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(weights, 1, generator=generator))
