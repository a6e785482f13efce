"""Continuous-batching scheduler: one token budget per step, chunked prefill, recompute preemption.

There are no phases: every live sequence wants to run the tokens in [num_computed, num_tokens).
Each step, running requests go first (highest priority, oldest first), then waiting ones, until
the token budget or the sequence cap is used up. A request that cannot get the blocks it needs
preempts the lowest-priority, newest running request (which frees all its blocks and goes back
to the waiting queue) until it fits or is itself the lowest. Requests that can never fit are
rejected when they are added, so nothing waits forever at the head of the queue.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from minivllm.arith import ceil_div
from minivllm.core.block_manager import BlockManager
from minivllm.core.kv_window import KVWindow
from minivllm.core.request import Request, RequestStatus, Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 2048
    # A prompt token whose log-prob is asked for (vLLM's `prompt_logprobs`) runs the LM head and a
    # reduction over the vocabulary besides the decoder layers: it counts this many tokens against the
    # step's budget (engine/prompt_logprobs.py `token_cost`), so such a prefill never makes a step
    # slower than a plain one and the other streams' gaps stay as they were
    prompt_logprobs_token_cost: int = 2
    # Ablation switches (`minivllm bench ablation` prices each optimisation by turning it off):
    # chunked_prefill off: a sequence's pending tokens run whole in one step or wait (request
    # validation keeps prompt + max_tokens within the budget, so nothing waits forever);
    # static_batching: a batch forms only while none of its requests has produced a token, and the
    # next one only once it has drained (HF generate's batch, not continuous batching);
    # recompute_kv: no KV cache across steps: once a sequence samples, its progress drops to 0, so
    # the next step runs its whole context again as one prefill over the same blocks.
    chunked_prefill: bool = True
    static_batching: bool = False
    recompute_kv: bool = False
    kv_window: KVWindow | None = None  # StreamingLLM's sinks + sliding window (core/kv_window.py); None: off
    # the model's sliding-window attention (Mistral): blocks wholly before every running sequence's next
    # window are freed after each step (BlockManager.free_window); None: full attention
    attention_window: int | None = None


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: run tokens [start, start + num_tokens). With drafts, the
    chunk is the sequence's last token and then `num_draft` proposed ones (a verify step)."""

    seq: Sequence
    start: int  # num_computed before this step
    num_tokens: int
    num_draft: int = 0

    @property
    def completes(self) -> bool:
        """This chunk reaches the end of the sequence, so its logits are sampled."""
        return self.start + self.num_tokens - self.num_draft == self.seq.num_tokens

    @property
    def samples(self) -> bool:
        """This chunk's last logits are sampled: it completes a sequence of a generating request (a
        pooling request's prompt yields hidden states instead, core/pooling.py)."""
        return self.completes and self.seq.request.pooling is None

    @property
    def num_logits(self) -> int:
        """Logits rows this chunk yields: one per position a token is chosen at."""
        return 1 + self.num_draft if self.samples else 0

    @property
    def drafts(self) -> list[int]:
        return self.seq.draft_token_ids[: self.num_draft]

    @property
    def is_single_token(self) -> bool:
        """The model runner's split: every token of this chunk is a row of the paged decode kernel
        (one token per row). Not the request's phase: a prefill can end in a one-token chunk. A
        verify chunk runs its k + 1 tokens as k + 1 decode rows, each attending to the cache up to
        its own position: the very computation a decode step there does, so verifying changes no
        bit of the logits (greedy output stays identical to decoding without drafts)."""
        return self.num_tokens == 1 or self.num_draft > 0


@dataclass
class SchedulerOutput:
    """The plan of one step. Scheduling already reserved the blocks it needs; progress
    (`num_computed`) moves only in `Scheduler.update_from_output`, once the step ran."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    # a sliding KV window's drops: move these blocks' keys back by d positions (model/kv_window.py)
    shifts: list[tuple[list[int], int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    budget_used: int = 0
    queue_head: Request | None = None
    queue_head_reason: str | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def in_logits_order(self) -> list[ScheduledSeq]:
        """Chunks as the runner lays out its rows: decode rows first, then multi-token chunks."""
        return [s for s in self.scheduled if s.is_single_token] + [s for s in self.scheduled if not s.is_single_token]

    def sampled(self) -> list[tuple[ScheduledSeq, int]]:
        """(chunk, its first logits row) for every chunk that completes its sequence; a verify
        chunk's rows follow on from there."""
        out, row = [], 0
        for s in self.in_logits_order():
            if s.samples:
                out.append((s, row))
                row += s.num_logits
        return out


class Progress(NamedTuple):
    """Where a request's sequences stand, as values: admission plans on these before it commits."""

    computed: tuple[int, ...]  # num_computed per live sequence
    refork_at: int | None = None  # see Request.refork_at

    @classmethod
    def of(cls, request: Request) -> Progress:
        return cls(tuple(s.num_computed for s in request.seqs), request.refork_at)


StatusSetter = Callable[[Request, RequestStatus, str], None]


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, set_status: StatusSetter):
        self.config = config
        self.bm = block_manager
        self.set_status = set_status
        self.waiting: list[Request] = []  # sorted by (priority, arrival): preempted ones re-enter in front
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def remove(self, request: Request) -> None:
        """Drop a request from either queue and free its blocks (finish or abort)."""
        for queue in (self.waiting, self.running):
            if request in queue:
                queue.remove(request)
        for seq in request.all_seqs():
            self.bm.free_seq(seq.seq_id)

    @property
    def num_running_seqs(self) -> int:
        return sum(len(r.seqs) for r in self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def fork(self, request: Request, parent: Sequence, child: Sequence) -> None:
        """The child shares the parent's blocks (copy-on-write) and its progress."""
        self.bm.fork(parent.seq_id, child.seq_id, request.request_id)
        child.num_computed = parent.num_computed

    # ---- after a step ---------------------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, accepted: Mapping[int, int] | None = None) -> None:
        """The one place progress moves: every scheduled chunk is now in the KV cache, and blocks it
        filled enter the prefix cache. A verify chunk keeps only its last token and the drafts
        `accepted[seq_id]` says were accepted: the rejected positions roll back and the blocks that
        held only them are freed. Only verified tokens are ever hashed: the accepted drafts join
        `token_ids` after this, so their blocks are committed by the next update."""
        for s in out.scheduled:
            seq = s.seq
            if seq.draft_token_ids:  # used (or stale): proposed afresh each step
                seq.clear_drafts()
            if seq.request.is_finished:  # failed while sampling: its blocks are gone already
                continue
            rejected = s.num_draft - (accepted or {}).get(seq.seq_id, 0) if s.num_draft else 0
            seq.num_computed = s.start + s.num_tokens - rejected
            if self.config.recompute_kv and s.samples:
                seq.num_computed = 0  # its blocks stay (the recompute rewrites them); nothing is hashed
                continue
            if s.num_draft:
                self.bm.trim(seq.seq_id, seq.num_computed + 1)  # room for the token sampled this step
            if self.bm.enable_prefix_caching:  # else nothing is hashed at all
                self.bm.commit_full_blocks(
                    seq.seq_id,
                    seq.token_ids,
                    min(seq.num_computed, seq.num_tokens),
                    seq.block_hashes(self.bm.block_size),
                )
            if self.config.attention_window is not None:  # hashed first: a freed block stays a cached prefix
                self.bm.free_window(seq.seq_id, seq.num_computed - self.config.attention_window + 1)

    # ---- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.config.kv_window is not None:
            self._slide_windows(self.config.kv_window, out)
        budget = self.config.max_num_batched_tokens
        for request in sorted(self.running, key=lambda r: r.sort_key):
            if budget <= 0:
                break
            if request in self.running:  # not preempted by an earlier request this step
                budget -= self._schedule_running(request, budget, out)
        if out.preempted:  # as vLLM: no admissions in a step that had to preempt
            if self.waiting:
                out.queue_head, out.queue_head_reason = self.waiting[0], "running requests were preempted this step"
        elif self.config.static_batching and self._batch_decoding():
            if self.waiting:
                out.queue_head, out.queue_head_reason = self.waiting[0], "static batching: the running batch decodes"
        else:
            budget = self._admit_waiting(budget, out)
        out.budget_used = self.config.max_num_batched_tokens - budget
        return out

    def _slide_windows(self, window: KVWindow, out: SchedulerOutput) -> None:
        """Drop whole groups of blocks that left each running sequence's window; its later keys move back
        by the dropped tokens, so rotary positions stay the tokens' indices in the compacted cache."""
        for request in self.running:
            for seq in request.seqs:
                num_blocks = window.blocks_to_drop(seq.num_computed - seq.dropped)
                if num_blocks:
                    out.shifts.append((self.bm.drop_window(seq.seq_id, num_blocks), num_blocks * self.bm.block_size))
                    seq.dropped += num_blocks * self.bm.block_size

    def _batch_decoding(self) -> bool:
        """Static batching's rule: the running batch has started producing tokens."""
        return any(s.num_output_tokens for r in self.running for s in r.seqs)

    def _schedule_running(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        if request.refork_at is not None and request.seqs[0].num_computed >= request.refork_at:
            self._fork_followers(request, request.refork_at)
        progress = Progress.of(request)
        chunks = self._chunks(request, budget, progress)
        if not any(chunks):
            return 0
        num_draft = self._num_draft(request, chunks, budget, progress)
        chunks[0] += num_draft
        while self._blocks_needed(request, chunks, progress) > self.bm.num_free_blocks:
            victim = max(self.running, key=lambda r: r.sort_key)
            self._preempt(victim, out, reason=f"out of KV blocks (needed by {request.request_id})")
            if victim is request:
                return 0
        self._commit(request, chunks, out, num_draft)
        return sum(chunks) * self._token_cost(request)

    def _num_draft(self, request: Request, chunks: list[int], budget: int, progress: Progress) -> int:
        """Drafts ride along a sequence's next token under the same budget: only for a request
        with one sequence that has caught up (its chunk is that one token), and only on free
        blocks: a draft never preempts anyone (speculation is optional, a preemption is not)."""
        seq = request.seqs[0]
        if len(request.seqs) > 1 or chunks[0] != 1 or seq.num_remaining != 1:
            return 0
        num_draft = min(len(seq.draft_token_ids), budget - 1)
        if num_draft and self._blocks_needed(request, [1 + num_draft], progress) > self.bm.num_free_blocks:
            return 0
        return num_draft

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> int:
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if self.num_running_seqs + len(request.seqs) > self.config.max_num_seqs:
                out.queue_head, out.queue_head_reason = request, f"max_num_seqs ({self.config.max_num_seqs}) reached"
                return budget
            reason = self._try_admit(request, budget, out)
            if reason is not None:
                out.queue_head, out.queue_head_reason = request, reason
                return budget
            budget -= sum(s.num_tokens for s in out.scheduled if s.seq.request is request) * self._token_cost(request)
        if self.waiting:
            out.queue_head, out.queue_head_reason = self.waiting[0], "token budget used up"
        return budget

    def _try_admit(self, request: Request, budget: int, out: SchedulerOutput) -> str | None:
        """Admit the request if its first chunks fit; returns why not otherwise. Plans on values
        (`Progress`), so a refusal leaves the request exactly as it was.

        A request with several sequences is one resuming after a preemption (n > 1 samples or beams
        fork only once running). Only its first sequence, the leader, is allocated: recomputing
        the prefix all of them share once, then forking, keeps the footprint admission validated;
        recomputing a copy per sequence might never fit the pool again."""
        leader = request.seqs[0]
        # prompt log-probs (or mean pooling's states) still missing need the model run on every prompt
        # token: no cache hit (its blocks still enter the prefix cache as they fill)
        skip_cache = (request.prompt_logprobs is not None and request.prompt_logprobs.pending) or (
            request.pooling is not None and request.pooling.pending
        )
        cached = (
            self.bm.find_cached_prefix(leader.token_ids, leader.block_hashes(self.bm.block_size))
            if self.bm.enable_prefix_caching and not skip_cache
            else []
        )
        progress = self._admission_progress(request, len(cached) * self.bm.block_size)
        chunks = self._chunks(request, budget, progress)
        window_start = self._window_start(min(progress.computed))  # cached blocks before it are freed at once
        needed = (
            self._resume_blocks(request, progress)
            if progress.refork_at is not None
            else self._blocks_needed(request, chunks, progress)
        ) + self._free_cached(cached[window_start:])
        if not any(chunks) or needed > self.bm.num_free_blocks:
            return (
                f"out of KV blocks: needs {needed}, {self.bm.num_free_blocks} free"
                if any(chunks)
                else "token budget used up"
            )
        leader.num_computed = self.bm.allocate_seq(leader.seq_id, request.request_id, leader.token_ids, cached)
        if self.config.attention_window is not None:  # cached blocks before every sequence's window go back
            self.bm.free_window(leader.seq_id, window_start * self.bm.block_size)
        if len(request.seqs) > 1 and progress.refork_at is None:
            self._fork_followers(request, progress.computed[1])
        request.refork_at = progress.refork_at
        self.waiting.remove(request)
        self.running.append(request)
        out.admitted.append(request)
        self._admitted_status(request)
        self._commit(request, chunks, out)
        return None

    @staticmethod
    def _admission_progress(request: Request, cached_tokens: int) -> Progress:
        """Where the request would stand once admitted. Followers fork from the leader where the
        sequences diverge: at once when the leader's cached prefix already covers that point (they
        then start there), else once the leader has recomputed it (`refork_at`)."""
        if len(request.seqs) == 1:
            return Progress((cached_tokens,))
        at = request.common_prefix_len()
        if cached_tokens < at:
            return Progress((cached_tokens,) + (0,) * (len(request.seqs) - 1), refork_at=at)
        return Progress((cached_tokens,) + (at,) * (len(request.seqs) - 1))

    def _resume_blocks(self, request: Request, progress: Progress) -> int:
        """New blocks a resuming request needs before all its sequences run again: the leader's
        whole recompute plus each follower's tail, its copy of a shared partial block included.
        Admitting on less would let the followers preempt the request again right after the fork."""
        bs, at, leader = self.bm.block_size, progress.refork_at, request.seqs[0]
        blocks = ceil_div(leader.num_tokens, bs) - progress.computed[0] // bs
        return blocks + sum(ceil_div(s.num_tokens, bs) - at // bs for s in request.seqs[1:])

    def _fork_followers(self, request: Request, at: int) -> None:
        leader = request.seqs[0]
        for seq in request.seqs[1:]:
            self.bm.fork(leader.seq_id, seq.seq_id, request.request_id, num_tokens=at)
            seq.num_computed = at
        request.refork_at = None

    def _admitted_status(self, request: Request) -> None:
        cached = request.seqs[0].num_computed
        if request.status == RequestStatus.PREEMPTED:
            self.set_status(request, RequestStatus.WAITING, "resuming after preemption: blocks available")
        else:
            request.num_cached_prompt_tokens = cached
        from_disk = f" ({request.restored_tokens} read back from disk)" if request.restored_tokens else ""
        request.restored_tokens = 0
        self.set_status(
            request,
            RequestStatus.PREFILL,
            f"admitted: {request.num_remaining_tokens} tokens to compute, {cached} from prefix cache{from_disk}",
        )

    # ---- helpers ------------------------------------------------------------------------------

    def _chunks(self, request: Request, budget: int, progress: Progress) -> list[int]:
        """Tokens to run per live sequence. Sequences of a multi-sequence request (forks, beams) are
        sampled together, so unless all of them can finish this step none may reach its end."""
        budget = max(1, budget // self._token_cost(request))
        if progress.refork_at is not None:  # only the leader runs until the followers fork
            lead = min(progress.refork_at - progress.computed[0], budget)
            return [lead] + [0] * (len(request.seqs) - 1)
        remaining = [s.num_tokens - done for s, done in zip(request.seqs, progress.computed)]
        if sum(remaining) <= budget:
            return remaining
        if not self.config.chunked_prefill:
            return [0] * len(remaining)
        chunks = []
        for r in remaining:
            take = min(r if len(remaining) == 1 else r - 1, budget)
            chunks.append(max(take, 0))
            budget -= chunks[-1]
        return chunks

    def _token_cost(self, request: Request) -> int:
        """What each of the request's tokens counts against this step's budget."""
        pending = request.prompt_logprobs is not None and request.prompt_logprobs.pending
        return self.config.prompt_logprobs_token_cost if pending else 1

    def _new_blocks(self, seq: Sequence, computed: int, chunk: int) -> int:
        if not self.bm.has_seq(seq.seq_id):
            have = computed // self.bm.block_size
            return max(0, ceil_div(computed + chunk, self.bm.block_size) - have)
        needed = self.bm.blocks_needed(seq.seq_id, computed + chunk)
        return needed + int(chunk > 0 and self.bm.needs_copy_on_write(seq.seq_id, computed))

    def _window_start(self, computed: int) -> int:
        """The first block a sequence with `computed` tokens still attends to (0 without a window)."""
        window = self.config.attention_window
        return 0 if window is None else max(0, computed - window + 1) // self.bm.block_size

    def _free_cached(self, block_ids: list[int]) -> int:
        """Cached blocks that are free count against the free pool when reattached."""
        return sum(1 for b in block_ids if self.bm.blocks[b].ref_count == 0)

    def _blocks_needed(self, request: Request, chunks: list[int], progress: Progress) -> int:
        return sum(self._new_blocks(s, done, c) for s, done, c in zip(request.seqs, progress.computed, chunks))

    def _commit(self, request: Request, chunks: list[int], out: SchedulerOutput, num_draft: int = 0) -> None:
        for seq, chunk in zip(request.seqs, chunks):
            if chunk == 0:
                continue
            copy = self.bm.prepare_write(seq.seq_id, seq.num_computed)
            if copy is not None:
                out.copies.append(copy)
            assert self.bm.ensure_capacity(seq.seq_id, seq.num_computed + chunk), "checked before commit"
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed, chunk, num_draft))

    def _preempt(self, request: Request, out: SchedulerOutput, reason: str) -> None:
        self.running.remove(request)
        for seq in request.seqs:
            self.bm.free_seq(seq.seq_id)
            seq.num_computed = seq.dropped = 0
            seq.clear_drafts()
        request.refork_at = None
        request.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(request)
        # with a disk tier its full blocks stay cached and go to disk when evicted: swapped out, not lost
        swap = "; its full blocks go to the disk tier when evicted" if self.bm.track_evictions else ""
        self.set_status(request, RequestStatus.PREEMPTED, f"preempted: {reason}{swap}")
        self.add(request)
