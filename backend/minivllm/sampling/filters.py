"""Truncating a distribution (top-k, top-p, min-p) and drawing from it, without sorting the vocabulary.

A full sort of 49,152 logits costs ~3.7 ms a row on our CPUs, more than a quarter of a decode step;
``topk`` of a few hundred costs ~0.2 ms. So each truncation is found among a row's highest logits
and applied as a *value threshold* on the whole row: every logit at or above the threshold stays.
Top-p is decided within the candidates when their mass reaches p; a row whose nucleus is wider (a
flat distribution) looks again among more candidates, at worst all of them (the sort).

The draw is inverse-CDF: one uniform per row against the row's cumulative probabilities (float64,
so a token of probability 1e-12 keeps its chance), where an exponential race needs a random number
per vocabulary entry (~1 ms a row)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

_NEG_INF = float("-inf")
# candidates looked at for top-k / top-p before widening; the last step is the whole vocabulary
CANDIDATE_WIDTHS = (256, 4096)
DRAW_BLOCK = 256  # tokens per block of the two-level draw


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None, min_p: torch.Tensor | None
) -> torch.Tensor:
    """top-k, then top-p, then min-p, as one ``-inf`` mask (out of place); each may be None (= off for
    every row). ``k``: ``[R]`` ints (the vocab size = off); ``p``: ``[R]`` floats (1.0 = off); ``min_p``:
    ``[R]`` floats (0 = off).

    Top-p keeps the smallest set of highest-probability tokens whose mass reaches ``p`` (computed after
    top-k), at least one token; min-p drops tokens below ``min_p`` times the top probability. Ties at a
    boundary (the k-th value, the nucleus' last token) are all kept, so the result does not depend on
    how a sort orders equal values."""
    if k is None and p is None and min_p is None:
        return logits
    threshold = truncation_threshold(logits, k, p, min_p)
    return logits.masked_fill(logits < threshold.unsqueeze(1), _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    return apply_top_k_top_p_min_p(logits, k, p, None)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    return apply_top_k_top_p_min_p(logits, None, None, min_p)


def truncation_threshold(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None, min_p: torch.Tensor | None
) -> torch.Tensor:
    """Each row's lowest logit that top-k, top-p and min-p all keep (``-inf``: keep everything)."""
    rows, vocab = logits.shape
    k = (
        torch.full((rows,), vocab, dtype=torch.long, device=logits.device)
        if k is None
        else k.to(device=logits.device, dtype=torch.long).clamp(1, vocab)
    )
    threshold = torch.full((rows,), _NEG_INF, dtype=logits.dtype, device=logits.device)
    limited = k < vocab
    any_limited = bool(limited.any())
    if any_limited or p is not None:
        # one topk serves top-k and top-p's first look (it is most of the cost at a few rows)
        k_max = int(k[limited].max()) if any_limited else 0
        top = logits.topk(min(vocab, max(k_max, CANDIDATE_WIDTHS[0] if p is not None else 0)), dim=-1).values
        kth = top.gather(1, (k.clamp_max(top.shape[1]) - 1).unsqueeze(1)).squeeze(1)
        threshold = torch.where(limited, kth, threshold)
        if p is not None:
            nucleus = _top_p_threshold(logits, top, threshold, p.to(logits.device, torch.float32))
            threshold = torch.maximum(threshold, nucleus)
    if min_p is not None:  # p_i >= min_p * p_max  <=>  logit_i >= max logit + log(min_p), in any truncation
        floor = logits.amax(dim=-1) + torch.log(min_p.to(logits.device, logits.dtype))
        threshold = torch.maximum(threshold, floor)
    return threshold


def _top_p_threshold(
    logits: torch.Tensor, top: torch.Tensor, k_threshold: torch.Tensor, p: torch.Tensor
) -> torch.Tensor:
    """Each row's lowest logit inside its top-p nucleus, over the distribution left by top-k. `top`:
    each row's highest logits, descending; more are looked at while a nucleus does not end in them."""
    vocab = logits.shape[1]
    threshold = torch.full((logits.shape[0],), _NEG_INF, dtype=logits.dtype, device=logits.device)
    pending = (p < 1.0).nonzero().flatten()
    if not len(pending):
        return threshold
    rows, floor, log_total = _rows(logits, pending), k_threshold[pending].unsqueeze(1), None
    values = _rows(top, pending)
    widths = [w for w in (*CANDIDATE_WIDTHS, vocab) if top.shape[1] < w <= vocab]
    while True:
        width = values.shape[1]
        values = values.masked_fill(values < floor, _NEG_INF)
        if log_total is None:
            log_total = _log_mass(rows, values, floor)
        probs = (values - log_total).exp()
        above = probs.cumsum(dim=-1) - probs  # the mass of the tokens ranked above each one
        kept = (above < p[pending].unsqueeze(1)).sum(dim=-1).clamp_min(1)  # the nucleus, if it ends in here
        closed = (kept < width) | (width == vocab)
        threshold[pending[closed]] = values[closed].gather(1, (kept[closed] - 1).unsqueeze(1)).squeeze(1)
        if bool(closed.all()):
            return threshold
        pending, rows, floor, log_total = pending[~closed], rows[~closed], floor[~closed], log_total[~closed]
        values = rows.topk(widths.pop(0), dim=-1).values


def _log_mass(rows: torch.Tensor, top: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """log of each row's total probability mass above its top-k floor, ``[R, 1]``: from its highest
    values alone when the floor cuts inside them (top-k within the candidates), else over the row."""
    if bool((top[:, -1] == _NEG_INF).all()):
        return torch.logsumexp(top, dim=-1, keepdim=True)
    return torch.logsumexp(rows.masked_fill(rows < floor, _NEG_INF), dim=-1, keepdim=True)


def _rows(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The given rows; the tensor itself when that is every row (a copy costs ~0.1 ms a row)."""
    return logits if len(idx) == logits.shape[0] else logits[idx]


def inverse_cdf_draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row: the first whose cumulative probability passes ``u * total``, ``u ~ U[0, 1)``.

    Two levels, since a cumulative sum runs serially (2.7 ms for 32 rows of 49,152): the sums of blocks
    of DRAW_BLOCK tokens pick the block, one block's cumulative sum picks the token. Row ``i`` draws its
    ``u`` from ``generators[i]`` when given (its token then depends only on that generator and the row);
    the other rows share one draw from torch's default generator."""
    rows, vocab = probs.shape
    blocks = -(-vocab // DRAW_BLOCK)
    padded = probs if vocab % DRAW_BLOCK == 0 else F.pad(probs, (0, blocks * DRAW_BLOCK - vocab))
    padded = padded.view(rows, blocks, DRAW_BLOCK)
    block_mass = padded.sum(dim=-1).to(torch.float64)  # summed in float32: exact enough within a block
    target = _uniforms(generators, probs.device) * block_mass.sum(dim=-1)
    block, rest = _search(block_mass, target)
    inside = padded[torch.arange(rows, device=probs.device), block].to(torch.float64)
    # the block's mass was summed in float32: rescale to its float64 sum so the target stays inside it
    chosen_mass = block_mass.gather(1, block.unsqueeze(1)).squeeze(1).clamp_min(torch.finfo(torch.float64).tiny)
    token, _ = _search(inside, rest * inside.sum(dim=-1) / chosen_mass)
    stray = inside.gather(1, token.unsqueeze(1)).squeeze(1) <= 0
    if bool(stray.any()):  # a target rounded onto the block's end: its last token with any probability
        in_block = torch.arange(DRAW_BLOCK, device=probs.device)
        token[stray] = torch.where(inside[stray] > 0, in_block, 0).amax(dim=-1)
    return block * DRAW_BLOCK + token


def _search(weights: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the first index whose cumulative weight passes ``target``, and how far past the
    weights before it the target lies."""
    cumulative = weights.cumsum(dim=-1)
    index = torch.searchsorted(cumulative, target.unsqueeze(1), right=True).squeeze(1)
    index = index.clamp_max(weights.shape[1] - 1)
    before = cumulative.gather(1, index.unsqueeze(1)).squeeze(1) - weights.gather(1, index.unsqueeze(1)).squeeze(1)
    return index, target - before


def _uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> torch.Tensor:
    u = torch.empty(len(generators), dtype=torch.float64, device=device)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        u[torch.tensor(shared, dtype=torch.long, device=device)] = torch.rand(
            len(shared), dtype=torch.float64, device=device
        )
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand((), dtype=torch.float64, generator=g, device=g.device)
    return u
