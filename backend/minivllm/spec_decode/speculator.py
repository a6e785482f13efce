"""Which sequences get drafts at the end of a step, and how many: requests with one sequence
(n > 1 samples and beam search run without speculation: their sequences are sampled together;
structured outputs too: a draft would need the grammar's mask at every drafted position),
caught up with their tokens, with room left under max_tokens and the context length, while the
batch is smaller than `disable_by_batch_size`."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

from minivllm.core.request import Request, Sequence
from minivllm.core.scheduler import SchedulerOutput
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.planner import Acceptance, StepCosts, plan_drafts

log = logging.getLogger("minivllm.spec_decode")


class Proposer(Protocol):
    method: str
    longest_catch_up: int  # a model's tokens to run before its first draft, at most, last proposal
    round_seconds: list[float]  # a model's seconds per round of the last proposal (n-gram: none)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> None: ...

    def release_except(self, live: set[int]) -> None: ...


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int):
        self.config, self.proposer, self.max_model_len = config, proposer, max_model_len
        self.costs, self.acceptance = StepCosts(), Acceptance()

    @property
    def method(self) -> str:
        return self.proposer.method

    def observe(self, sched: SchedulerOutput, accepted: Mapping[int, int], forward_s: float) -> None:
        """Learn from the step that ran: its cost by decode rows, each verified sequence's acceptance."""
        if all(s.is_single_token for s in sched.scheduled):  # decode rows only: a clean cost sample
            self.costs.observe(sum(s.num_tokens for s in sched.scheduled), forward_s)
        for s in sched.scheduled:
            if s.num_draft and s.seq.seq_id in accepted:
                self.acceptance.observe(s.seq.seq_id, s.num_draft, accepted[s.seq.seq_id])

    def propose(self, running: list[Request]) -> None:
        limit = self.config.disable_by_batch_size
        seqs, ks = [], []
        if limit is None or len(running) < limit:
            for request in running:
                k = self._room(request)
                if k > 0:
                    seqs.append(request.seqs[0])
                    ks.append(k)
        if seqs and self.config.adaptive:
            ks = self._plan(seqs, ks, sum(len(r.seqs) for r in running))
            seqs, ks = [s for s, k in zip(seqs, ks) if k], [k for k in ks if k]
        if seqs:
            self._propose(seqs, ks)
        live = {s.seq_id for r in running for s in r.seqs}
        self.proposer.release_except(live)
        self.acceptance.forget_except(live)

    def _plan(self, seqs: list[Sequence], limits: list[int], base_rows: int) -> list[int]:
        rates = [self.acceptance.rate(s.seq_id) for s in seqs]
        ks = plan_drafts(rates, limits, base_rows, self.costs, per_round=self.method != "ngram")
        for seq, k in zip(seqs, ks):
            if not k:
                self.acceptance.relax(seq.seq_id)
        return ks

    def _propose(self, seqs: list[Sequence], ks: list[int]) -> None:
        """Drafts are optional: a proposer that fails costs this step's drafts, never a request."""
        try:
            self.proposer.propose(seqs, ks)
        except Exception:  # noqa: BLE001 - contained: the sequences decode without drafts
            log.exception("%s proposer failed; these sequences decode one token this step", self.method)
            for seq in seqs:
                seq.clear_drafts()
            return
        # a draft model's first run over a whole prompt is paid once per request, not per step
        # (priced as a round, it made drafting look too dear for good)
        if self.proposer.longest_catch_up <= self.config.num_speculative_tokens + 1:  # n-gram: no rounds
            self.costs.observe_rounds(self.proposer.round_seconds)

    def _room(self, request: Request) -> int:
        """Drafts this request may take now (0: none)."""
        params = request.params
        if (
            params.use_beam_search
            or params.n > 1
            or len(request.seqs) != 1
            or request.is_finished
            or request.grammar is not None
        ):
            return 0
        seq = request.seqs[0]
        if seq.num_remaining != 1:
            return 0
        # k drafts emit up to k + 1 tokens; the KV of the last one's position must fit the context
        return min(
            self.config.num_speculative_tokens,
            request.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens,
        )
