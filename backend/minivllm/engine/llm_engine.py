"""The engine: `step()` is schedule -> run the model -> sample -> post-process, emitting events.

Single-threaded by design: the async front end (`async_engine.py`) owns the thread that calls
`step()` and hands requests in through a queue, so no engine state needs a lock.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from minivllm import events as ev
from minivllm.core.block_manager import BlockManager
from minivllm.core.request import Request, RequestStatus, Sequence
from minivllm.core.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput
from minivllm.detokenizer import IncrementalDetokenizer
from minivllm.engine import wire
from minivllm.engine.config import EngineConfig
from minivllm.engine.malloc_tuning import keep_freed_memory_for_reuse
from minivllm.engine.memory_budget import check_pool_fits, process_rss_bytes
from minivllm.engine.model_runner import ModelRunner, SeqWork
from minivllm.engine.outputs import RequestOutput
from minivllm.engine.postprocess import append_token, request_output
from minivllm.engine.request_validation import validate_request
from minivllm.event_bus import EventBus
from minivllm.loader import LoadedModel
from minivllm.model.attention import KVCache
from minivllm.sampling.beam_search import BeamSearchState
from minivllm.sampling.params import SamplingParams
from minivllm.sampling.sampler import Sampler, SamplingRow
from minivllm.stop_strings import StopStringMatcher

FINISHED_HISTORY = 256  # finished requests kept for snapshots (the timeline of late joiners)
log = logging.getLogger("minivllm.engine")


class EngineBusyError(RuntimeError):
    """The configuration cannot change while requests run."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (its sampling or post-processing); the others went on."""


@dataclass
class Counters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    steps: int = 0


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, bus: EventBus | None = None):
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.bus = bus or EventBus()
        self.sampler = Sampler()
        self.eos_ids = frozenset(loaded.config.eos_token_ids)
        self.eos_id = next(iter(self.eos_ids), None)  # the one that min_tokens masks and beams end on
        self.requests: dict[str, Request] = {}
        self.finished: deque[Request] = deque(maxlen=FINISHED_HISTORY)
        self.counters = Counters()
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        self._last_metrics = (0.0, 0, 0)
        if torch.device(loaded.device).type == "cpu":
            keep_freed_memory_for_reuse()  # process-wide, so once per engine, not per rebuild
        self._build(config or EngineConfig())

    # ---- configuration ------------------------------------------------------------------------

    def _build(self, config: EngineConfig) -> None:
        config.validate()
        cfg, dtype = self.loaded.config, self.loaded.dtype
        self.config = config
        self.max_model_len = config.resolved_max_model_len(cfg)
        num_blocks = config.resolved_num_blocks(cfg, dtype)
        self.kv_cache = KVCache(cfg.num_hidden_layers, num_blocks, config.block_size,
                                cfg.num_key_value_heads, cfg.head_dim, dtype, self.loaded.device)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          on_event=self._on_block_event)
        sched_cfg = SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len)
        self.scheduler = Scheduler(sched_cfg, self.block_manager, self._set_status)
        self.runner = ModelRunner(self.loaded.model, self.kv_cache)

    def reconfigure(self, **changes) -> None:
        """Rebuild the KV pool / scheduler with new settings; only while idle. Transactional: a size
        that cannot fit is refused before anything changes, and a rebuild that still fails puts the
        old configuration back."""
        old, new = self.config, self.config.with_changes(**changes)
        new.validate()  # a setting that can never apply is a 400 even while requests run
        num_blocks = new.resolved_num_blocks(self.loaded.config, self.loaded.dtype)
        new.resolved_max_model_len(self.loaded.config)
        new_bytes = num_blocks * new.bytes_per_block(self.loaded.config, self.loaded.dtype)
        check_pool_fits(new_bytes, self.kv_cache.num_bytes, torch.device(self.loaded.device), num_blocks,
                        new.max_kv_cache_memory)
        if self.has_unfinished_requests():
            raise EngineBusyError("the engine configuration can only change while no request runs")
        del self.kv_cache  # free the old pool before allocating the new one
        try:
            self._build(new)
        except Exception:
            self._build(old)
            raise
        self.finished.clear()
        self.bus.emit(ev.ConfigChanged(config=self.info()))

    def info(self) -> ev.EngineInfo:
        return ev.EngineInfo(
            model=self.loaded.name, max_model_len=self.max_model_len,
            num_blocks=self.block_manager.num_blocks, block_size=self.config.block_size,
            max_num_batched_tokens=self.config.max_num_batched_tokens, max_num_seqs=self.config.max_num_seqs,
            enable_prefix_caching=self.config.enable_prefix_caching,
            dtype=str(self.loaded.dtype).removeprefix("torch."), device=str(self.loaded.device),
            quantization=self.loaded.quant.mode, weight_bytes=self.loaded.quant.weight_bytes,
            weight_fp32_bytes=self.loaded.quant.fp32_bytes, kernels=self.loaded.quant.kernel_lines())

    # ---- requests -----------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"model {self.loaded.name} has no tokenizer: pass prompt token ids")
        return self.tokenizer.encode(prompt)

    def add_request(self, request_id: str, prompt: str | None = None, params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, priority: int = 0) -> Request:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = list(prompt_token_ids) if prompt_token_ids is not None else self.encode(prompt or "")
        max_tokens = validate_request(ids, params, self)
        request = Request(request_id, prompt, ids, params, self.bus.now(), max_tokens=max_tokens,
                          priority=priority, preview=(prompt or "")[:120])
        request.seqs.append(self._new_seq(request, list(ids), 0))
        self.requests[request_id] = request
        arrived = self.bus.emit(ev.RequestArrived(
            request_id=request_id, prompt_tokens=len(ids), max_tokens=max_tokens, n=params.n, priority=priority,
            sampling=wire.sampling_summary(request), prompt_preview=request.preview))
        request.arrival_time = arrived.ts  # one clock for the engine and the event log
        self._emit_seq_added(request, request.seqs[0])
        self._set_status(request, RequestStatus.WAITING, "arrived")
        self.scheduler.add(request)
        return request

    def abort_request(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        for seq in request.seqs:
            seq.finish_reason = seq.finish_reason or "abort"
        self._finish_request(request, "abort", "aborted by the client")
        self._pending.append(request_output(request))
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Requests to run or outputs (of aborts) still to hand out."""
        return bool(self.requests or self._pending)

    # ---- one step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        self._count_admissions(sched)
        self._emit_step_scheduled(sched)
        if sched.is_empty:
            self.emit_metrics_if_due()
            return outputs
        t1 = time.perf_counter()
        decodes = [s for s in sched.scheduled if s.num_tokens == 1]
        prefills = [s for s in sched.scheduled if s.num_tokens > 1]
        logits = self.runner.execute([self._work(s) for s in decodes], [self._work(s) for s in prefills],
                                     sched.copies)
        t2 = time.perf_counter()
        ready = self._advance(decodes + prefills)
        touched = self._sample(ready, logits)
        t3 = time.perf_counter()
        outputs += [request_output(r) for r in touched if r.error is None]
        outputs, self._pending = outputs + self._pending, []  # + the requests that failed in this step
        self._emit_step_finished(sched, len(ready), t0, t1, t2, t3)
        return outputs

    def _work(self, s: ScheduledSeq) -> SeqWork:
        tokens = s.seq.token_ids[s.start:s.start + s.num_tokens]
        return SeqWork(tokens, s.start, self.block_manager.block_table(s.seq.seq_id), needs_logits=s.completes)

    def _advance(self, ordered: list[ScheduledSeq]) -> list[tuple[Sequence, int]]:
        """Account the computed tokens; returns (sequence, logits row) for those that caught up."""
        ready, row, now = [], 0, self.bus.now()
        for s in ordered:
            seq = s.seq
            seq.num_computed += s.num_tokens
            seq.request.first_scheduled_time = seq.request.first_scheduled_time or now
            self.block_manager.commit_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed)
            if seq.num_computed <= seq.num_prompt_tokens:
                self.counters.prompt_tokens += s.num_tokens
            if s.completes:
                ready.append((seq, row))
                row += 1
        return ready

    # ---- sampling -----------------------------------------------------------------------------

    def _sample(self, ready: list[tuple[Sequence, int]], logits: torch.Tensor) -> list[Request]:
        """Samples every ready sequence. A fault in one request's sampling or post-processing fails
        that request alone (see `_fail_request`); the step goes on for the others."""
        by_request: dict[str, list[tuple[Sequence, int]]] = {}
        for seq, row in ready:
            by_request.setdefault(seq.request.request_id, []).append((seq, row))
        plain: list[tuple[Request, list[tuple[Sequence, int]]]] = []
        touched = []
        for rid, items in by_request.items():
            request = self.requests[rid]
            touched.append(request)
            if request.params.use_beam_search:
                # rows in beam order: after a preemption, some beams may finish recomputing as decodes
                # and others as prefill chunks, which the runner lays out decodes first
                items.sort(key=lambda item: request.seqs.index(item[0]))
                self._contained(request, "sampling", self._beam_step, request, logits[[row for _, row in items]])
            else:
                expanded = self._contained(request, "forking", self._expand_samples, request, items)
                if expanded is not None:
                    plain.append((request, expanded))
        self._sample_plain(plain, logits)
        for request in touched:
            if request.error is None:
                self._contained(request, "finishing", self._after_sampling, request)
        return touched

    def _expand_samples(self, request: Request, items: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """n > 1: fork the remaining samples off the prompt the first time it is computed."""
        if request.forked or request.params.n == 1:
            return items
        request.forked = True
        parent, row = items[0]
        children = [self._fork(request, parent, list(parent.token_ids), index) for index in range(1, request.params.n)]
        return items + [(child, row) for child in children]

    def _sample_plain(self, groups: list[tuple[Request, list[tuple[Sequence, int]]]], logits: torch.Tensor) -> None:
        """One sampler call for all requests' rows. If it raises, each request is sampled alone (its
        seeded generators rewound first), so only the request that caused it fails."""
        items = [item for _, group in groups for item in group]
        if not items:
            return
        generators = [(s.generator, s.generator.get_state()) for s, _ in items if s.generator is not None]
        rows = [SamplingRow(s.request.params, s.request.prompt_token_ids, self._outputs_for_sampler(s),
                            s.generator, self.eos_id)
                for s, _ in items]
        try:
            result = self.sampler(_select_rows(logits, [row for _, row in items]), rows)
        except Exception as exc:  # noqa: BLE001 - contained below, per request
            if len(groups) == 1:
                self._fail_request(groups[0][0], "sampling", exc)
                return
            for generator, state in generators:
                generator.set_state(state)
            for group in groups:
                self._sample_plain([group], logits)
            return
        first = 0
        for request, group in groups:
            self._contained(request, "post-processing", self._append_sampled, group, result, first)
            first += len(group)

    def _append_sampled(self, group: list[tuple[Sequence, int]], result, first: int) -> None:
        for i, (seq, _) in enumerate(group, start=first):
            top = result.top_logprobs[i] if result.top_logprobs else None
            self._append(seq, result.token_ids[i], result.logprobs[i], top)

    def _contained(self, request: Request, phase: str, fn, *args):
        """fn(*args); an exception fails `request` alone and returns None."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - a fault in one request must not reach the others
            self._fail_request(request, phase, exc)
            return None

    def _fail_request(self, request: Request, phase: str, exc: Exception) -> None:
        """Finish a request whose own processing raised: its blocks are freed, its client gets the
        error (RequestOutput.error), and nothing shared (the pool, the batch) is affected."""
        log.error("request %s failed while %s", request.request_id, phase, exc_info=exc)
        request.error = f"internal error while {phase} the request: {type(exc).__name__}: {exc}"
        if not request.is_finished:
            for seq in request.seqs:
                seq.finish_reason = seq.finish_reason or "abort"
            self._finish_request(request, "abort", f"failed while {phase}: {type(exc).__name__}")
        self._pending.append(request_output(request))

    @staticmethod
    def _outputs_for_sampler(seq: Sequence) -> list[int]:
        """Only penalties and min_tokens read the output so far: skip the per-step copy otherwise."""
        p = seq.request.params
        return seq.output_token_ids if p.needs_penalties or p.min_tokens else []

    def _beam_step(self, request: Request, logits: torch.Tensor) -> None:
        if request.beam is None:
            p = request.params
            request.beam = BeamSearchState(p.beam_width, p.length_penalty, self.eos_id,
                                           request.max_tokens, request.num_prompt_tokens, p.n)
        choices = request.beam.step(torch.log_softmax(logits.float(), dim=-1))
        old = list(request.seqs)
        for parent_row, token in choices:
            parent = old[parent_row]
            child = self._fork(request, parent, list(parent.token_ids), len(request.seqs) - len(old))
            child.token_ids.append(token)  # stop conditions belong to the beam search itself
            self._emit_token(child, token, "", None)
        for seq in old:
            self._drop_seq(request, seq, "beam pruned" if choices else "beam search finished")
        if not choices:
            self._finish_beams(request)

    def _finish_beams(self, request: Request) -> None:
        for index, (tokens, score) in enumerate(request.beam.results()):
            seq = self._new_seq(request, request.prompt_token_ids + tokens, index)
            seq.cumulative_logprob, seq.finish_reason = score, _beam_finish_reason(tokens, self.eos_ids)
            seq.text = self._decode(tokens, request.params.skip_special_tokens)
            request.finished_seqs.append(seq)

    def _append(self, seq: Sequence, token: int, logprob: float | None, top) -> None:
        text = append_token(seq, token, logprob, top, self.eos_ids, self.max_model_len)
        self._emit_token(seq, token, text, logprob)

    def _emit_token(self, seq: Sequence, token: int, text: str, logprob: float | None) -> None:
        request = seq.request
        request.num_generated_events += 1
        self.counters.generation_tokens += 1
        event = self.bus.emit(ev.TokenGenerated(request_id=request.request_id, seq_id=seq.seq_id,
                                                token_id=token, text=text, logprob=logprob))
        if request.first_token_time is None:
            request.first_token_time = event.ts

    def _after_sampling(self, request: Request) -> None:
        if request.status == RequestStatus.PREFILL:
            self._set_status(request, RequestStatus.DECODE, "prompt computed, first token sampled")
        for seq in [s for s in request.seqs if s.finished]:
            self._drop_seq(request, seq, f"finished: {seq.finish_reason}", keep=True)
        if not request.seqs:
            reasons = [s.finish_reason for s in request.finished_seqs]
            reason = "length" if "length" in reasons else (reasons[0] if reasons else "stop")
            self._finish_request(request, reason, _finish_words(reason))

    # ---- sequences ----------------------------------------------------------------------------

    def _new_seq(self, request: Request, token_ids: list[int], index: int, parent: Sequence | None = None) -> Sequence:
        p = request.params
        seq = Sequence(request, token_ids, request.num_prompt_tokens, sample_index=index,
                       parent_seq_id=parent.seq_id if parent else None)
        if p.seed is not None:
            seq.generator = torch.Generator(device=self.loaded.device).manual_seed(p.seed + index)
        if self.tokenizer is not None and not p.use_beam_search:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, p.skip_special_tokens)
        if p.stop and not p.use_beam_search:
            seq.stop_matcher = StopStringMatcher(p.stop, p.include_stop_str_in_output)
        return seq

    def _fork(self, request: Request, parent: Sequence, token_ids: list[int], index: int) -> Sequence:
        child = self._new_seq(request, token_ids, index, parent)
        child.num_computed = parent.num_computed
        child.cumulative_logprob = parent.cumulative_logprob
        request.seqs.append(child)
        self._emit_seq_added(request, child)
        self.block_manager.fork(parent.seq_id, child.seq_id, request.request_id)
        return child

    def _drop_seq(self, request: Request, seq: Sequence, reason: str, keep: bool = False) -> None:
        request.seqs.remove(seq)
        if keep:
            request.finished_seqs.append(seq)
        self.block_manager.free_seq(seq.seq_id)
        self.bus.emit(ev.SeqRemoved(request_id=request.request_id, seq_id=seq.seq_id, reason=reason))

    def _finish_request(self, request: Request, finish_reason: str, words: str) -> None:
        self.scheduler.remove(request)
        for seq in list(request.seqs):
            self._drop_seq(request, seq, words, keep=True)
        request.finish_reason = finish_reason
        request.finish_time = self._set_status(request, RequestStatus.FINISHED, words, finish_reason).ts
        del self.requests[request.request_id]
        self.finished.append(request)

    def _decode(self, tokens: list[int], skip_special: bool) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special) if self.tokenizer else ""

    # ---- events -------------------------------------------------------------------------------

    def _set_status(self, request: Request, status: RequestStatus, reason: str,
                    finish_reason: str | None = None) -> ev.RequestStateChanged:
        previous = request.status
        request.status = status
        return self.bus.emit(ev.RequestStateChanged(request_id=request.request_id, state=status.value,
                                             previous=None if previous == status else previous.value,
                                             reason=reason, finish_reason=finish_reason))

    def _emit_seq_added(self, request: Request, seq: Sequence) -> None:
        self.bus.emit(ev.SeqAdded(request_id=request.request_id, seq_id=seq.seq_id,
                                  parent_seq_id=seq.parent_seq_id, num_tokens=seq.num_tokens,
                                  num_prompt_tokens=seq.num_prompt_tokens))

    def _on_block_event(self, event) -> None:
        wire_event = wire.block_event(event, self.block_manager)
        if wire_event is not None:
            self.bus.emit(wire_event)

    def _count_admissions(self, sched: SchedulerOutput) -> None:
        for request in sched.admitted:
            if request.num_preemptions == 0:  # a resumed request was counted when it first came in
                self.counters.prefix_queries += request.num_prompt_tokens
                self.counters.prefix_hits += request.num_cached_prompt_tokens

    def _emit_step_scheduled(self, sched: SchedulerOutput) -> None:
        if sched.is_empty and not sched.preempted:
            return
        self.counters.steps += 1

        def chunk(s: ScheduledSeq) -> ev.ScheduledChunk:
            return ev.ScheduledChunk(request_id=s.seq.request.request_id, seq_id=s.seq.seq_id,
                                     start=s.start, num_tokens=s.num_tokens)

        self.bus.emit(ev.StepScheduled(
            step=self.counters.steps,
            prefill=[chunk(s) for s in sched.scheduled if s.seq.request.status == RequestStatus.PREFILL],
            decode=[chunk(s) for s in sched.scheduled if s.seq.request.status != RequestStatus.PREFILL],
            budget_used=sched.budget_used, budget=self.config.max_num_batched_tokens,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            preempted=[r.request_id for r in sched.preempted],
            queue_head=sched.queue_head.request_id if sched.queue_head else None,
            queue_head_reason=sched.queue_head_reason))

    def _emit_step_finished(self, sched: SchedulerOutput, sampled: int, t0: float, t1: float,
                            t2: float, t3: float) -> None:
        t4 = time.perf_counter()
        self.bus.emit(ev.StepFinished(
            step=self.counters.steps, duration_ms=(t4 - t0) * 1e3,
            num_tokens=sum(s.num_tokens for s in sched.scheduled), num_generated=sampled,
            schedule_ms=(t1 - t0) * 1e3, forward_ms=(t2 - t1) * 1e3, sample_ms=(t3 - t2) * 1e3,
            postprocess_ms=(t4 - t3) * 1e3))
        self.emit_metrics_if_due()

    def emit_metrics_if_due(self, force: bool = False) -> None:
        now = self.bus.now()
        last_t, last_gen, last_prompt = self._last_metrics
        if not force and now - last_t < self.config.metrics_interval_s:
            return
        dt = max(now - last_t, 1e-9)
        c, bm = self.counters, self.block_manager
        self._last_metrics = (now, c.generation_tokens, c.prompt_tokens)
        self.bus.emit(ev.MetricsSample(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_usage=bm.usage(), num_cached_free_blocks=bm.num_cached_free_blocks,
            prefix_cache_queries=c.prefix_queries, prefix_cache_hits=c.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions, prompt_tokens=c.prompt_tokens,
            generation_tokens=c.generation_tokens,
            generation_throughput=(c.generation_tokens - last_gen) / dt,
            prompt_throughput=(c.prompt_tokens - last_prompt) / dt, rss_bytes=process_rss_bytes()))

    def snapshot(self) -> ev.Snapshot:
        bm = self.block_manager
        live = sorted(self.requests.values(), key=lambda r: r.arrival_time)
        requests = [wire.request_state(r, bm) for r in list(self.finished) + live]
        return ev.Snapshot(seq=self.bus.last_seq, ts=self.bus.now(), step=self.counters.steps,
                           config=self.info(), requests=requests, blocks=wire.block_states(bm))


def _select_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The logits rows in the given order; the tensor itself when that is all of it in order (the
    usual case), since a copy of [32, 49152] fp32 logits costs ~1-2 ms a step."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits[rows]


def _beam_finish_reason(tokens: list[int], eos_ids: frozenset[int]) -> str:
    return "stop" if tokens and tokens[-1] in eos_ids else "length"


def _finish_words(reason: str) -> str:
    return {"stop": "finished: stop condition met", "length": "finished: length limit reached",
            "abort": "aborted by the client"}.get(reason, f"finished: {reason}")
