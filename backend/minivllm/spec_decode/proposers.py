"""Who drafts the tokens: n-gram lookup (no model), the target's own first layers (early exit), or
a separate draft model with its own paged KV pool. Each sets `seq.draft_token_ids` (and
`seq.draft_probs` for sampled requests) for the sequences it is given, at most `k` per sequence."""

from __future__ import annotations

import time

import torch

from minivllm.core.block_manager import BlockManager
from minivllm.core.request import Sequence
from minivllm.core.step_work import SeqWork
from minivllm.spec_decode.draw import draw_drafts
from minivllm.spec_decode.ngram import propose_ngram
from minivllm.spec_decode.runner import StepRunner


class NgramProposer:
    method = "ngram"
    longest_catch_up = 0
    round_seconds: list[float] = []

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], ks: list[int]) -> None:
        for seq, k in zip(seqs, ks):
            seq.draft_token_ids = propose_ngram(seq.token_ids, k, self.min_n, self.max_n)
            seq.draft_probs = None

    def release_except(self, live: set[int]) -> None:
        """Nothing is kept per sequence."""


class _ModelDrafter:
    """k autoregressive rounds of a model: the first runs each sequence's uncomputed tokens (its
    last token, or more where the draft's KV is behind), the others one draft token each."""

    runner: StepRunner
    block_manager: BlockManager
    num_layers: int | None = None
    longest_catch_up = 0  # tokens of the longest first work in the last proposal
    round_seconds: list[float] = []  # the last proposal's rounds, timed (the planner's prices)

    def _draft(self, seqs: list[Sequence], ks: list[int], first: list[SeqWork]) -> None:
        self.longest_catch_up, self.round_seconds = max(len(w.token_ids) for w in first), []
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor | None]] = [[] for _ in seqs]
        active, works = list(range(len(seqs))), first
        while active:
            started = time.perf_counter()
            # the runner's row order: single tokens first, then chunks (sorted is stable)
            pairs = sorted(zip(active, works), key=lambda pair: len(pair[1].token_ids) > 1)
            order = [i for i, _ in pairs]
            logits = self.runner.execute(
                [w for _, w in pairs if len(w.token_ids) == 1],
                [w for _, w in pairs if len(w.token_ids) > 1],
                num_layers=self.num_layers,
            )
            tokens, qs = draw_drafts(logits, [seqs[i] for i in order])
            for row, i in enumerate(order):
                drafts[i].append(tokens[row])
                probs[i].append(qs[row])
            self.round_seconds.append(time.perf_counter() - started)
            active = [i for i in order if len(drafts[i]) < ks[i]]
            works = [self._next_work(seqs[i], drafts[i]) for i in active]
        for seq, d, q in zip(seqs, drafts, probs):
            seq.draft_token_ids = d
            seq.draft_probs = None if q[0] is None else torch.stack(q)  # type: ignore[arg-type]

    def _next_work(self, seq: Sequence, drafts: list[int]) -> SeqWork:
        position = seq.num_tokens - 1 + len(drafts)
        return SeqWork([drafts[-1]], position, self.block_manager.block_table(seq.seq_id))


class EarlyExitProposer(_ModelDrafter):
    """The target's first `exit_layer` layers and its final norm and LM head. It writes those
    layers' KV at the draft positions in the target's own pool: exactly what the verify pass
    writes there again (a layer's KV depends only on the layers below it)."""

    method = "early_exit"

    def __init__(self, runner: StepRunner, block_manager: BlockManager, exit_layer: int):
        self.runner, self.block_manager, self.num_layers = runner, block_manager, exit_layer

    def propose(self, seqs: list[Sequence], ks: list[int]) -> None:
        bm, ready, room = self.block_manager, [], []
        for seq, k in zip(seqs, ks):
            # the positions of the last token and the first k - 1 drafts: the verify step's blocks
            if not bm.needs_copy_on_write(seq.seq_id, seq.num_computed) and bm.ensure_capacity(
                seq.seq_id, seq.num_tokens + k - 1
            ):
                ready.append(seq)
                room.append(k)
        first = [SeqWork(s.token_ids[-1:], s.num_computed, bm.block_table(s.seq_id)) for s in ready]
        if ready:
            self._draft(ready, room, first)

    def release_except(self, live: set[int]) -> None:
        """The blocks belong to the target's sequences: the scheduler frees them."""


class DraftModelProposer(_ModelDrafter):
    """A separate (smaller or quantized) model with the same tokenizer. Its KV pool is its own;
    per sequence it remembers which tokens its cache holds, so each step it only runs what the
    target accepted since (the verified prefix of its own drafts is kept)."""

    method = "draft_model"

    def __init__(self, runner: StepRunner, block_manager: BlockManager):
        self.runner, self.block_manager = runner, block_manager
        self._cached: dict[int, list[int]] = {}  # seq id -> tokens whose KV the draft pool holds

    def propose(self, seqs: list[Sequence], ks: list[int]) -> None:
        bm, ready, room, first = self.block_manager, [], [], []
        for seq, k in zip(seqs, ks):
            if not bm.has_seq(seq.seq_id):
                bm.allocate_seq(seq.seq_id, seq.request.request_id, [], prefix=[])
            if not bm.ensure_capacity(seq.seq_id, seq.num_tokens + k - 1):
                self._forget(seq.seq_id)  # the pool is full: this sequence goes without drafts
                continue
            valid = _common_prefix(self._cached.get(seq.seq_id, []), seq.token_ids, seq.num_tokens - 1)
            ready.append(seq)
            room.append(k)
            first.append(SeqWork(seq.token_ids[valid:], valid, bm.block_table(seq.seq_id)))
        if ready:
            self._draft(ready, room, first)
        for seq in ready:
            self._cached[seq.seq_id] = seq.token_ids + seq.draft_token_ids[:-1]

    def release_except(self, live: set[int]) -> None:
        for seq_id in [s for s in self._cached if s not in live]:
            self._forget(seq_id)

    def _forget(self, seq_id: int) -> None:
        self._cached.pop(seq_id, None)
        self.block_manager.free_seq(seq_id)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    return next((i for i in range(n) if a[i] != b[i]), n)
