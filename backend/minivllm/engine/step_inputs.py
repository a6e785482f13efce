"""A step's plan as the model runner's inputs: which tokens run, at which positions, in which rows.

A decode token is one decode row; so is each token of a verify chunk (the sequence's last token
and its drafts), each attending to the cache up to its own position; other chunks run as
multi-token chunks. The rows come out in `SchedulerOutput.in_logits_order()`. A pooling request's
chunks want no logits: their rows' final hidden states go to its pooling state instead. A sequence
under a sliding KV window (core/kv_window.py) runs at its cache positions: its `num_computed` here
counts the tokens in its compacted cache, not its absolute progress.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minivllm.core.block_manager import BlockManager
from minivllm.core.scheduler import ScheduledSeq, SchedulerOutput
from minivllm.core.step_work import PromptLogprobsRows, SeqWork


def runner_inputs(sched: SchedulerOutput, blocks: BlockManager) -> tuple[list[SeqWork], list[SeqWork]]:
    """A step's plan as the runner's (decode rows, chunks), in `sched.in_logits_order()`."""
    chunks = sched.in_logits_order()
    return (
        [w for s in chunks if s.is_single_token for w in _decode_rows(s, blocks)],
        [
            SeqWork(
                s.seq.token_ids[s.start : s.start + s.num_tokens],
                s.start - s.seq.dropped,
                blocks.block_table(s.seq.seq_id),
                num_logits=int(s.samples),
                prompt_logprobs=_prompt_logprobs(s),
                pooled=_pooled(s),
            )
            for s in chunks
            if not s.is_single_token
        ],
    )


def _decode_rows(s: ScheduledSeq, blocks: BlockManager) -> list[SeqWork]:
    """A decode token, or a verify chunk's last token and drafts, one decode row each."""
    table = blocks.block_table(s.seq.seq_id)
    tokens = s.seq.token_ids[s.start : s.start + s.num_tokens - s.num_draft] + s.drafts
    if not s.num_draft:  # a decode token, or a one-token prefill chunk (which may want a prompt logprob)
        return [
            SeqWork(
                tokens,
                s.start - s.seq.dropped,
                table,
                num_logits=int(s.samples),
                prompt_logprobs=_prompt_logprobs(s),
                pooled=_pooled(s),
            )
        ]
    return [SeqWork([t], s.start - s.seq.dropped + i, table, num_logits=int(s.samples)) for i, t in enumerate(tokens)]


def _pooled(s: ScheduledSeq) -> Callable[[int, torch.Tensor], None] | None:
    """Where a pooling request's chunk hands its final hidden states (core/pooling.py); None otherwise."""
    pooling = s.seq.request.pooling
    return pooling.add if pooling is not None else None


def _prompt_logprobs(s: ScheduledSeq) -> PromptLogprobsRows | None:
    """The rows of a prefill chunk whose request still misses prompt log-probs there (vLLM's
    `prompt_logprobs`); None for every other chunk."""
    state = s.seq.request.prompt_logprobs
    if state is None or not state.pending:
        return None
    wanted = state.targets(s.seq.token_ids, s.start, s.num_tokens)
    if wanted is None:
        return None
    first_row, targets = wanted
    first_token = s.start + first_row + 1
    return PromptLogprobsRows(
        first_row, targets, state.top_n, lambda entries, ranks: state.add(first_token, entries, ranks)
    )
