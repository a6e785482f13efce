"""Log-probs of given next tokens at some rows of a forward pass: vLLM's `prompt_logprobs`.

The runner hands over the final-normed hidden states of the rows a request wants them for; the LM
head runs on a bounded number of rows at a time and each pass is reduced to Python numbers at once,
so a long prompt chunk never holds [chunk, vocab] logits (32 MiB of logits per pass at most).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LOGITS_PER_PASS = 1 << 23  # fp32 values: 32 MiB
REDUCTION_PASSES = 8  # log-sum-exp, the target's gather and rank, top-N: passes over each row's logits


def token_cost(config) -> int:
    """How many plain prompt tokens one prompt token with its log-prob costs (rounded up): the decoder
    layers' multiply-adds per token, plus the LM head's and the reduction's over the vocabulary. 2 for
    SmolLM2-135M (a 49,152 x 576 head beside 106M layer weights); far more for a model whose layers
    are small beside its vocabulary."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    hidden = config.hidden_size
    layers = config.num_hidden_layers * (hidden * (2 * q + 2 * kv) + 3 * hidden * config.intermediate_size)
    head = config.vocab_size * (hidden + REDUCTION_PASSES)
    return -(-(layers + head) // layers)


def target_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: list[int],
    top_n: int,
    vocab_size: int,
) -> tuple[list[dict[int, float]], list[int]]:
    """Per row of `hidden` [len(targets), hidden]: {target: logprob, then the top-N: logprob} under
    log_softmax of the fp32 logits, and the target's rank (1 + how many tokens are likelier; ties
    count against it, as vLLM's)."""
    entries: list[dict[int, float]] = []
    ranks: list[int] = []
    target_ids = torch.tensor(targets, dtype=torch.long, device=hidden.device)
    rows_per_pass = max(1, LOGITS_PER_PASS // vocab_size)
    with torch.inference_mode():
        for start in range(0, len(targets), rows_per_pass):
            logits = compute_logits(hidden[start : start + rows_per_pass]).float()
            end = start + logits.shape[0]
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            chosen = logits.gather(1, target_ids[start:end].unsqueeze(1))
            ranks.extend((logits >= chosen).sum(dim=-1).tolist())
            chosen_lp = (chosen - lse).squeeze(1).tolist()
            if top_n > 0:
                top_vals, top_ids = logits.topk(min(top_n, logits.shape[1]), dim=-1)
                top_lps, top_ids_l = (top_vals - lse).tolist(), top_ids.tolist()
                for i, lp in enumerate(chosen_lp):
                    entries.append(dict([(targets[start + i], lp), *zip(top_ids_l[i], top_lps[i])]))
            else:
                entries.extend({targets[start + i]: lp} for i, lp in enumerate(chosen_lp))
    return entries, ranks
