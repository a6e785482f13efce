"""What the engine tells the outside: events on the bus, counters, metric samples and snapshots.

The block manager queues its changes; every emission here drains that queue first, so the event
log keeps the order in which things happened (a block freed before the request finished shows up
before it). The engine and its helpers emit only through `Telemetry`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from minivllm.core.block_manager import BlockManager
from minivllm.core.request import Request, RequestStatus, Sequence
from minivllm.core.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from minivllm.engine import wire
from minivllm.engine.memory_budget import process_rss_bytes
from minivllm.engine.memory_view import MemoryView
from minivllm.engine.step_profile import StepProfiler
from minivllm.events import types as ev
from minivllm.events.bus import EventBus
from minivllm.loader import LoadedModel
from minivllm.model.attention import KVCache
from minivllm.spec_decode.verify import Verified


@dataclass
class Counters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    steps: int = 0
    spec_drafts: int = 0  # verifications of at least one drafted token
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i


@dataclass(frozen=True)
class EngineStats:
    """The engine's gauges and counters at one moment: the MetricsSample event and Prometheus
    both read this, so the dashboard and /metrics can never disagree."""

    num_running: int
    num_waiting: int
    kv_usage: float
    num_cached_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    memory: ev.MemorySplit | None = None  # where the RSS goes, re-measured every few seconds
    disk_tier: ev.DiskTierStats | None = None  # the prefix cache's disk tier, if there is one


@dataclass
class StepTimer:
    """perf_counter marks of one step's phases."""

    start: float
    scheduled: float = 0.0
    executed: float = 0.0
    sampled: float = 0.0

    def mark(self, phase: str) -> None:
        setattr(self, phase, time.perf_counter())


class Telemetry:
    def __init__(self, bus: EventBus, metrics_interval_s: float, loaded: LoadedModel | None = None):
        """`loaded`: the model whose steps get a profile while a dashboard client watches (None: never)."""
        self.bus = bus
        self.profiler = StepProfiler(loaded) if loaded is not None else None
        self._loaded = loaded
        self._memory: MemoryView | None = None
        self.counters = Counters()
        self.metrics_interval_s = metrics_interval_s
        self._last_metrics = (0.0, 0, 0)
        self._bm: BlockManager | None = None
        self._scheduler: Scheduler | None = None
        self.spec_method: str | None = None  # set by the engine when it speculates
        self._experts_touched: int | None = None  # the step's forward's (a MoE model's), for StepFinished

    def bind(
        self,
        block_manager: BlockManager,
        scheduler: Scheduler,
        metrics_interval_s: float,
        kv_cache: KVCache | None = None,
        disk_tier=None,
    ) -> None:
        """Follow a freshly built pool and scheduler (start-up and every reconfiguration); `disk_tier`:
        the engine's (engine/kv_disk_tier.py), whose `stats()` the samples carry."""
        self._bm, self._scheduler, self.metrics_interval_s = block_manager, scheduler, metrics_interval_s
        self._disk_tier = disk_tier
        self._memory = MemoryView(self._loaded.model, kv_cache) if self._loaded is not None else None
        if self.profiler is not None:
            self.profiler.bind(kv_cache)

    # ---- emitting -----------------------------------------------------------------------------

    def emit(self, event: ev.AnyEvent) -> ev.AnyEvent:
        self.flush_block_events()
        return self.bus.emit(event)

    def flush_block_events(self) -> None:
        if self._bm is None:
            return
        for change in self._bm.take_events():
            wire_event = wire.block_event(change)
            if wire_event is not None:
                self.bus.emit(wire_event)

    def set_status(
        self, request: Request, status: RequestStatus, reason: str, finish_reason: str | None = None
    ) -> ev.RequestStateChanged:
        previous = request.status
        request.status = status
        return self.emit(
            ev.RequestStateChanged(
                request_id=request.request_id,
                state=status.value,
                previous=None if previous == status else previous.value,
                reason=reason,
                finish_reason=finish_reason,
            )
        )

    def seq_added(self, request: Request, seq: Sequence) -> None:
        self.emit(
            ev.SeqAdded(
                request_id=request.request_id,
                seq_id=seq.seq_id,
                parent_seq_id=seq.parent_seq_id,
                num_tokens=seq.num_tokens,
                num_prompt_tokens=seq.num_prompt_tokens,
            )
        )

    def seq_removed(self, request: Request, seq: Sequence, reason: str) -> None:
        self.emit(ev.SeqRemoved(request_id=request.request_id, seq_id=seq.seq_id, reason=reason))

    def token(
        self,
        seq: Sequence,
        token: int,
        text: str,
        logprob: float | None,
        drafted: bool = False,
        allowed_fraction: float | None = None,
    ) -> None:
        request = seq.request
        request.num_generated_events += 1
        self.counters.generation_tokens += 1
        event = self.emit(
            ev.TokenGenerated(
                request_id=request.request_id,
                seq_id=seq.seq_id,
                token_id=token,
                text=text,
                logprob=logprob,
                drafted=drafted,
                allowed_fraction=allowed_fraction,
            )
        )
        if request.first_token_time is None:
            request.first_token_time = event.ts

    def spec_verified(self, seq: Sequence, verified: Verified) -> None:
        c, accepted = self.counters, verified.num_accepted
        c.spec_drafts += 1
        c.spec_draft_tokens += len(verified.proposed)
        c.spec_accepted_tokens += accepted
        per_position = c.spec_accepted_per_position
        per_position.extend([0] * (len(verified.proposed) - len(per_position)))
        for i in range(accepted):
            per_position[i] += 1
        self.emit(
            ev.SpecVerified(
                request_id=seq.request.request_id,
                seq_id=seq.seq_id,
                step=c.steps,
                method=self.spec_method or "",
                proposed=verified.proposed,
                accepted=accepted,
                token_id=verified.tokens[-1],
            )
        )

    # ---- steps --------------------------------------------------------------------------------

    def step_scheduled(self, sched: SchedulerOutput, budget: int) -> None:
        if self.profiler is not None:
            self.profiler.begin_step()
        self._count_admissions(sched.admitted)
        now = self.bus.now()  # before the forward pass: a request's prefill is not time spent queued
        for s in sched.scheduled:
            s.seq.request.first_scheduled_time = s.seq.request.first_scheduled_time or now
        if sched.is_empty and not sched.preempted:
            return
        self.counters.steps += 1

        def chunk(s: ScheduledSeq) -> ev.ScheduledChunk:
            return ev.ScheduledChunk(
                request_id=s.seq.request.request_id,
                seq_id=s.seq.seq_id,
                start=s.start,
                num_tokens=s.num_tokens,
                num_draft=s.num_draft,
            )

        # prefill / decode here is the request's phase (the dashboard's lanes), not the runner's
        # single-token split: a recompute after preemption is prefill even for one token
        in_prefill = [s for s in sched.scheduled if s.seq.request.status == RequestStatus.PREFILL]
        decoding = [s for s in sched.scheduled if s.seq.request.status != RequestStatus.PREFILL]
        scheduler = self._scheduler
        self.emit(
            ev.StepScheduled(
                step=self.counters.steps,
                prefill=[chunk(s) for s in in_prefill],
                decode=[chunk(s) for s in decoding],
                budget_used=sched.budget_used,
                budget=budget,
                num_running=len(scheduler.running),
                num_waiting=len(scheduler.waiting),
                preempted=[r.request_id for r in sched.preempted],
                queue_head=sched.queue_head.request_id if sched.queue_head else None,
                queue_head_reason=sched.queue_head_reason,
            )
        )

    def step_ran(self, sched: SchedulerOutput, experts_touched: int | None = None) -> None:
        """The forward pass ran: count the prompt tokens it computed; keep a MoE model's expert count."""
        self._experts_touched = experts_touched
        for s in sched.scheduled:
            if s.start + s.num_tokens <= s.seq.num_prompt_tokens:
                self.counters.prompt_tokens += s.num_tokens

    def step_finished(self, sched: SchedulerOutput, timer: StepTimer, num_generated: int) -> None:
        end = time.perf_counter()
        phases = {
            "schedule": (timer.scheduled - timer.start) * 1e3,
            "forward": (timer.executed - timer.scheduled) * 1e3,
            "sample": (timer.sampled - timer.executed) * 1e3,
            "postprocess": (end - timer.sampled) * 1e3,
        }
        profile = self.profiler.profile(sched, phases) if self.profiler is not None else None
        self.emit(
            ev.StepFinished(
                step=self.counters.steps,
                duration_ms=(end - timer.start) * 1e3,
                num_tokens=sum(s.num_tokens for s in sched.scheduled),
                num_generated=num_generated,
                schedule_ms=phases["schedule"],
                forward_ms=phases["forward"],
                sample_ms=phases["sample"],
                postprocess_ms=phases["postprocess"],
                experts_touched=self._experts_touched,
                **(profile.wire_fields() if profile is not None else {}),
            )
        )
        self.metrics_if_due()

    def _count_admissions(self, admitted: Iterable[Request]) -> None:
        for request in admitted:
            if request.num_preemptions == 0:  # a resumed request was counted when it first came in
                self.counters.prefix_queries += request.num_prompt_tokens
                self.counters.prefix_hits += request.num_cached_prompt_tokens

    # ---- metrics and snapshots ----------------------------------------------------------------

    def stats(self) -> EngineStats:
        c, bm, scheduler = self.counters, self._bm, self._scheduler
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_usage=bm.usage(),
            num_cached_free_blocks=bm.num_cached_free_blocks,
            prefix_cache_queries=c.prefix_queries,
            prefix_cache_hits=c.prefix_hits,
            num_preemptions=scheduler.num_preemptions,
            prompt_tokens=c.prompt_tokens,
            generation_tokens=c.generation_tokens,
            spec_num_drafts=c.spec_drafts,
            spec_num_draft_tokens=c.spec_draft_tokens,
            spec_num_accepted_tokens=c.spec_accepted_tokens,
            spec_accepted_per_position=tuple(c.spec_accepted_per_position),
            memory=self._memory.latest(self.bus.now()) if self._memory is not None else None,
            disk_tier=self._disk_tier.stats() if self._disk_tier is not None else None,
        )

    def metrics_if_due(self, force: bool = False) -> None:
        now = self.bus.now()
        last_t, last_gen, last_prompt = self._last_metrics
        if not force and now - last_t < self.metrics_interval_s:
            return
        dt = max(now - last_t, 1e-9)
        stats = self.stats()
        self._last_metrics = (now, stats.generation_tokens, stats.prompt_tokens)
        self.emit(
            ev.MetricsSample(
                **asdict(stats),
                generation_throughput=(stats.generation_tokens - last_gen) / dt,
                prompt_throughput=(stats.prompt_tokens - last_prompt) / dt,
                rss_bytes=process_rss_bytes(),
            )
        )

    def snapshot(self, info: ev.EngineInfo, requests: Iterable[Request]) -> ev.Snapshot:
        self.flush_block_events()
        bm = self._bm
        return ev.Snapshot(
            seq=self.bus.last_seq,
            ts=self.bus.now(),
            step=self.counters.steps,
            config=info,
            requests=[wire.request_state(r, bm) for r in requests],
            blocks=wire.block_states(bm),
        )
