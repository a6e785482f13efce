"""Choosing the next tokens of one step from its logits: one batched sampler call for every plain
request, a beam-search step per beam request. Nothing here changes a sequence; the choices are
applied (tokens appended, forks registered) by `output_processor.py` once progress has moved.

A fault in one request's sampling fails that request alone: if the batched call raises, each
request is sampled again by itself, its seeded generators rewound first."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minivllm.core.request import Request, Sequence
from minivllm.core.scheduler import ScheduledSeq, SchedulerOutput
from minivllm.engine.request_tracker import RequestTracker
from minivllm.sampling.beam_search import BeamSearchState
from minivllm.sampling.sampler import Sampler, SamplingRow
from minivllm.spec_decode.verify import Verified, verify_drafts

Rows = list[tuple[Sequence, int]]  # (sequence, logits row)


@dataclass
class SampledToken:
    seq: Sequence
    token: int
    logprob: float | None
    top: list[tuple[int, float]] | None
    drafted: bool = False  # an accepted draft token (speculative decoding)
    allowed_fraction: float | None = None  # structured outputs: the share of the vocabulary the grammar allowed


@dataclass
class RequestSamples:
    """What one request drew this step."""

    request: Request
    tokens: list[SampledToken] = field(default_factory=list)
    new_children: list[tuple[Sequence, Sequence]] = field(default_factory=list)  # (parent, child): n > 1 forks
    beam_choices: list[tuple[int, int]] | None = None  # beam search: (parent row, token) pairs to continue
    verified: Verified | None = None  # speculative decoding: what was proposed and what was kept

    @property
    def num_tokens(self) -> int:
        """Tokens this request drew this step (a beam step: one per continued beam)."""
        return len(self.beam_choices) if self.beam_choices is not None else len(self.tokens)


class StepSampler:
    def __init__(self, sampler: Sampler, tracker: RequestTracker, eos_id: int | None):
        self.sampler = sampler
        self.tracker = tracker
        self.eos_id = eos_id

    def sample(self, sched: SchedulerOutput, logits: torch.Tensor) -> list[RequestSamples]:
        by_request: dict[str, tuple[Request, Rows]] = {}
        samples, plain = [], []
        for chunk, row in sched.sampled():
            if chunk.num_draft:
                samples.append(self._verify(chunk, logits[row : row + chunk.num_logits]))
                continue
            request = chunk.seq.request
            by_request.setdefault(request.request_id, (request, []))[1].append((chunk.seq, row))
        for request, rows in by_request.values():
            drawn = RequestSamples(request)
            if request.params.use_beam_search:
                # rows in beam order: after a preemption, some beams may finish recomputing as single
                # tokens and others as chunks, which the runner lays out single tokens first
                rows.sort(key=lambda item: request.seqs.index(item[0]))
                drawn.beam_choices = self.tracker.contained(
                    request, "sampling", self.beam_step, request, logits[[row for _, row in rows]]
                )
                if drawn.beam_choices is None:
                    continue
            else:
                plain.append((drawn, rows + self._new_samples(drawn, rows)))
            samples.append(drawn)
        self._sample_plain(plain, logits)
        return [s for s in samples if s.request.error is None]

    def _verify(self, chunk: ScheduledSeq, logits: torch.Tensor) -> RequestSamples:
        """A verify chunk (one sequence, its request has no other): keep the drafts the target
        agrees with, then the target's own token."""
        seq, drawn = chunk.seq, RequestSamples(chunk.seq.request)
        verified = self.tracker.contained(
            seq.request, "sampling", verify_drafts, self.sampler, seq, chunk.drafts, logits, self.eos_id
        )
        if verified is None:
            return drawn
        drawn.verified = verified
        for i, token in enumerate(verified.tokens):
            top = verified.top[i] if verified.top else None
            drawn.tokens.append(SampledToken(seq, token, verified.logprobs[i], top, drafted=i < verified.num_accepted))
        return drawn

    def beam_step(self, request: Request, logits: torch.Tensor) -> list[tuple[int, int]]:
        if request.beam is None:
            p = request.params
            request.beam = BeamSearchState(
                p.beam_width, p.length_penalty, self.eos_id, request.max_tokens, request.num_prompt_tokens, p.n
            )
        return request.beam.step(torch.log_softmax(logits.float(), dim=-1))

    def _new_samples(self, drawn: RequestSamples, rows: Rows) -> Rows:
        """n > 1: the other samples start from the prompt's logits the first time it is computed;
        they join the request (`add_fork`) when the step's tokens are applied."""
        request = drawn.request
        if request.forked or request.params.n == 1:
            return []
        request.forked = True
        parent, row = rows[0]
        children = [
            self.tracker.new_seq(request, list(parent.token_ids), index, parent) for index in range(1, request.params.n)
        ]
        drawn.new_children = [(parent, child) for child in children]
        return [(child, row) for child in children]

    def _sample_plain(self, groups: list[tuple[RequestSamples, Rows]], logits: torch.Tensor) -> None:
        """One sampler call for all requests' rows; on a fault, each request alone."""
        items = [item for _, rows in groups for item in rows]
        if not items:
            return
        generators = [(s.generator, s.generator.get_state()) for s, _ in items if s.generator is not None]
        rows = [
            SamplingRow(
                s.request.params,
                s.request.prompt_token_ids,
                _outputs_for_sampler(s),
                s.generator,
                self.eos_id,
                s.grammar,
            )
            for s, _ in items
        ]
        try:
            result = self.sampler(_select_rows(logits, [row for _, row in items]), rows)
        except Exception as exc:  # noqa: BLE001 - contained below, per request
            if len(groups) == 1:
                self.tracker.fail(groups[0][0].request, "sampling", exc)
                return
            for generator, state in generators:
                generator.set_state(state)
            for group in groups:
                self._sample_plain([group], logits)
            return
        i = 0
        for drawn, group in groups:
            for seq, _ in group:
                top = result.top_logprobs[i] if result.top_logprobs else None
                allowed = result.allowed_fractions[i] if result.allowed_fractions else None
                drawn.tokens.append(
                    SampledToken(seq, result.token_ids[i], result.logprobs[i], top, allowed_fraction=allowed)
                )
                i += 1


def _outputs_for_sampler(seq: Sequence) -> list[int]:
    return seq.output_token_ids if seq.request.params.reads_output_tokens else []


def _select_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The logits rows in the given order; the tensor itself when that is all of it in order (the
    usual case), since a copy of [32, 49152] fp32 logits costs ~1-2 ms a step."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits[rows]
