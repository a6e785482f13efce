"""The engine: `step()` is schedule -> execute -> sample -> update, each one call.

Who owns what:
- the scheduler (core/scheduler.py) plans each step; only its `update_from_output` moves progress;
- the model runner (model_runner.py) turns the plan into tensors and logits;
- the step sampler (step_sampling.py) draws the next tokens without touching a sequence;
- the output processor (output_processor.py) appends them, forks, finishes, reports outputs;
- the request tracker (request_tracker.py) owns the live requests and their sequences;
- telemetry (telemetry.py) emits every event, keeps the counters, samples metrics, snapshots.

Single-threaded: the async front end (async_engine.py) owns the thread that calls `step()` and
hands requests in through a queue, so no engine state needs a lock (grammars compile thread-safely).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from minivllm.core.block_manager import BlockManager
from minivllm.core.request import Request
from minivllm.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from minivllm.engine.config import EngineConfig, kv_dtype_name
from minivllm.engine.kv_disk_tier import disk_tier_for
from minivllm.engine.memory_budget import check_pool_fits
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.output_processor import OutputProcessor
from minivllm.engine.outputs import PoolingRequestOutput, RequestOutput
from minivllm.engine.pooling import PoolingParams, finish_pooled, pooling_requests
from minivllm.engine.prompt_logprob_pass import token_cost as prompt_logprobs_token_cost
from minivllm.engine.request_tracker import RequestTracker
from minivllm.engine.request_validation import RequestLimits, tokenize_bad_words, validate_request
from minivllm.engine.step_inputs import runner_inputs
from minivllm.engine.step_sampling import StepSampler
from minivllm.engine.telemetry import EngineStats, StepTimer, Telemetry
from minivllm.errors import EngineBusyError
from minivllm.events import types as ev
from minivllm.events.bus import EventBus
from minivllm.loader import LoadedModel
from minivllm.malloc_tuning import keep_freed_memory_for_reuse, release_free_heap
from minivllm.model.attention import KVCache
from minivllm.sampling.params import SamplingParams
from minivllm.sampling.sampler import Sampler
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.factory import build_speculator
from minivllm.structured.grammar import GrammarCompiler

Subscription = tuple[ev.Snapshot | None, list[ev.AnyEvent] | None, str | None]


class LLMEngine:
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        bus: EventBus | None = None,
        speculative: SpeculativeConfig | None = None,
        draft: LoadedModel | None = None,
    ):
        """`speculative`: speculative decoding's setup (None: off); `draft`: its draft model."""
        config = config or EngineConfig()
        self.loaded, self.speculative, self.draft, self.tokenizer = loaded, speculative, draft, loaded.tokenizer
        self.bus = bus or EventBus()
        self.telemetry = Telemetry(self.bus, config.metrics_interval_s, loaded)
        self.tracker = RequestTracker(self.telemetry, loaded.tokenizer, loaded.device)
        eos_ids = frozenset(loaded.config.eos_token_ids)
        eos_id = next(iter(eos_ids), None)  # the one that min_tokens masks and beams end on
        self.step_sampler = StepSampler(Sampler(), self.tracker, eos_id)
        self.output_processor = OutputProcessor(self.tracker, self.telemetry, eos_ids, loaded.tokenizer)
        self.grammars = GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size)
        if torch.device(loaded.device).type == "cpu":
            keep_freed_memory_for_reuse()  # process-wide, so once per engine, not per rebuild
        self._build(config)

    # ---- configuration ------------------------------------------------------------------------

    def _build(self, config: EngineConfig) -> None:
        config.validate(self.speculative)
        cfg, self.config = self.loaded.config, config
        self.max_model_len = config.resolved_max_model_len(cfg)
        num_blocks, kv_dtype, _ = config.kv_pool(cfg, self.loaded.kv_auto_dtype)
        self.kv_cache = KVCache(
            cfg.num_hidden_layers,
            num_blocks,
            config.block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            kv_dtype,
            self.loaded.device,
            scratch_block=self.loaded.model.may_capture,
        )
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            config.caches_prefixes,
            sink_blocks=config.window and config.window.sink_blocks,
        )
        self.disk_tier = disk_tier_for(self.loaded, config, self.block_manager, self.kv_cache)
        sched_cfg = SchedulerConfig(
            config.max_num_batched_tokens,
            config.max_num_seqs,
            self.max_model_len,
            prompt_logprobs_token_cost=prompt_logprobs_token_cost(cfg),
            chunked_prefill=config.enable_chunked_prefill,
            static_batching=config.static_batching,
            recompute_kv=config.recompute_kv,
            kv_window=config.window,
            attention_window=cfg.attention_window,
        )
        self.scheduler = Scheduler(sched_cfg, self.block_manager, self.telemetry.set_status)
        self.runner = ModelRunner.for_model(self.loaded.model, self.kv_cache).warmed_up(
            config.max_num_seqs, self.max_model_len, graph_rows=config.max_single_token_rows(self.speculative)
        )
        self.speculator = (
            build_speculator(
                self.speculative, self.runner, self.block_manager, self.draft, self.max_model_len, ModelRunner
            )
            if self.speculative
            else None
        )
        self.telemetry.spec_method = self.speculator.method if self.speculator else None
        self.telemetry.bind(
            self.block_manager, self.scheduler, config.metrics_interval_s, self.kv_cache, self.disk_tier
        )
        self.tracker.scheduler = self.scheduler
        self.output_processor.max_model_len = config.length_limit(self.max_model_len)
        self.limits = RequestLimits(
            self.max_model_len,
            cfg.vocab_size,
            num_blocks,
            config.block_size,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_stop_strings,
            config.max_stop_chars,
            chunked_prefill=config.enable_chunked_prefill,
            kv_window=config.window.max_cache_tokens(config.max_num_batched_tokens) if config.window else 0,
            attention_window=cfg.attention_window or 0,
        )
        release_free_heap()  # loading's and warm-up's temporaries: ~300 MiB of RSS otherwise

    def reconfigure(self, **changes) -> None:
        """Rebuild the KV pool / scheduler with new settings; only while idle. Transactional: a size
        that cannot fit is refused before anything changes, and a rebuild that still fails puts the
        old configuration back."""
        old, new = self.config, self.config.with_changes(**changes)
        new.validate(self.speculative)  # a setting that can never apply is a 400 even while requests run
        num_blocks, _, new_bytes = new.kv_pool(self.loaded.config, self.loaded.kv_auto_dtype)
        new.resolved_max_model_len(self.loaded.config)
        check_pool_fits(
            new_bytes, self.kv_cache.num_bytes, torch.device(self.loaded.device), num_blocks, new.max_kv_cache_memory
        )
        if self.has_unfinished_requests():
            raise EngineBusyError("the engine configuration can only change while no request runs")
        self.disk_tier.flush()  # the disk tier keeps what the old pool cached
        self.kv_cache = self.runner = self.speculator = None  # all hold the old pool (and graphs): free it first
        try:
            self._build(new)
        except Exception:
            self._build(old)
            raise
        self.tracker.finished.clear()
        self.telemetry.emit(ev.ConfigChanged(config=self.info()))

    def info(self) -> ev.EngineInfo:
        quant = self.loaded.quant
        return ev.EngineInfo(
            model=self.loaded.name,
            max_model_len=self.max_model_len,
            num_blocks=self.block_manager.num_blocks,
            block_size=self.config.block_size,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs,
            enable_prefix_caching=self.config.enable_prefix_caching,
            dtype=str(self.loaded.dtype).removeprefix("torch."),
            device=str(self.loaded.device),
            kv_cache_dtype=kv_dtype_name(self.kv_cache.k[0].dtype),
            kv_offload_bytes=self.config.kv_offload_bytes,
            kv_window=self.config.kv_window or 0,
            kv_sinks=self.config.kv_sinks if self.config.kv_window else 0,
            attention_window=self.loaded.config.attention_window or 0,
            quantization=quant.mode,
            weight_bytes=quant.weight_bytes,
            weight_fp32_bytes=quant.fp32_bytes,
            kernels=quant.kernel_lines(),
            compilation=self.loaded.model.compilation(),
            speculative=self.speculative.describe() if self.speculative else None,
        )

    # ---- requests -----------------------------------------------------------------------------

    @property
    def requests(self) -> dict[str, Request]:
        return self.tracker.requests

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"model {self.loaded.name} has no tokenizer: pass prompt token ids")
        return self.tokenizer.encode(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        preview: str | None = None,
    ) -> Request:
        """`cache_salt` (vLLM's): the request shares prefix-cache blocks only with those of the same salt.
        `preview`: what the dashboard labels the request with (default: the prompt's start), e.g. a chat's
        last user message where the prompt is token ids."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = list(prompt_token_ids) if prompt_token_ids is not None else self.encode(prompt or "")
        max_tokens = validate_request(ids, params, self.limits)
        tokenize_bad_words(params, self.tokenizer)
        return self.tracker.add(
            Request(
                request_id,
                prompt,
                ids,
                params,
                self.bus.now(),
                max_tokens=max_tokens,
                priority=priority,
                preview=(prompt or "" if preview is None else preview)[:120],
                grammar=self.grammars.for_params(params),
                cache_salt=cache_salt,
            )
        )

    def add_pooling_requests(
        self, request_ids: list[str], prompts: list[list[int]], pooling: PoolingParams, priority: int = 0
    ) -> None:
        """Embeddings: each prompt (token ids) pooled into one vector (engine/pooling.py); all or none."""
        for request in pooling_requests(request_ids, prompts, pooling, priority, self.requests, self.limits):
            self.tracker.add(request)

    def abort_request(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        self.tracker.abort(request, "aborted by the client")
        return True

    def abort_running(self) -> list[str]:
        """Abort the requests of the running batch (after a step failed as a whole); returns their ids.
        Waiting ones hold no blocks and never saw the failed step."""
        ids = [r.request_id for r in self.scheduler.running]
        for request_id in ids:
            self.abort_request(request_id)
        return ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Requests to run or outputs (of aborts) still to hand out."""
        return bool(self.requests or self.tracker.failed)

    # ---- one step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        outputs = self.tracker.take_failed()
        timer = StepTimer(start=time.perf_counter())
        sched = self.disk_tier.schedule(self.scheduler)
        self.telemetry.step_scheduled(sched, self.config.max_num_batched_tokens)
        if sched.is_empty:
            self.telemetry.flush_block_events()
            self.telemetry.metrics_if_due()
            return outputs
        timer.mark("scheduled")
        logits = self.execute(sched)
        timer.mark("executed")
        samples = self.step_sampler.sample(sched, logits)
        timer.mark("sampled")
        accepted = {s.tokens[0].seq.seq_id: s.verified.num_accepted for s in samples if s.verified}
        self.scheduler.update_from_output(sched, accepted)
        outputs += self.output_processor.apply(samples) + finish_pooled(sched, self.tracker)
        outputs += self.tracker.take_failed()
        if self.speculator is not None:  # learn what drafts cost and earn; draft the next step's tokens
            self.speculator.observe(sched, accepted, timer.executed - timer.scheduled)
            self.speculator.propose(self.scheduler.running)
        self.telemetry.step_finished(sched, timer, sum(s.num_tokens for s in samples))
        return outputs

    def close(self) -> None:
        # what the prefix cache holds goes to the disk tier, if there is one: a restart reuses it
        self.disk_tier.flush()
        self.runner.close()  # tensor-parallel workers exit

    def execute(self, sched: SchedulerOutput) -> torch.Tensor:
        """Run the plan's tokens through the model: logits rows in `sched.sampled()` order."""
        logits = self.runner.execute(*runner_inputs(sched, self.block_manager), sched.copies, shifts=sched.shifts)
        self.telemetry.step_ran(sched, getattr(self.loaded.model, "experts_touched", None))
        return logits

    # ---- the narrow surface the server reads ----------------------------------------------------

    def stats(self) -> EngineStats:
        return self.telemetry.stats()

    def emit_metrics_if_due(self, force: bool = False) -> None:
        self.telemetry.metrics_if_due(force)

    def snapshot(self) -> ev.Snapshot:
        live = sorted(self.requests.values(), key=lambda r: r.arrival_time)
        return self.telemetry.snapshot(self.info(), list(self.tracker.finished) + live)

    def subscribe(
        self,
        feed: Callable[[ev.AnyEvent], None],
        since: int | None = None,
        on_snapshot: Callable[[ev.Snapshot], None] | None = None,
    ) -> Subscription:
        """Start feeding events to `feed`. Returns (snapshot, replay, resync): from scratch (`since`
        None) a snapshot; resuming after `since`, the events to replay, or, when that is no longer
        possible, a snapshot and the reason. Atomic on the engine thread: no gap, no overlap."""
        self.telemetry.flush_block_events()
        replay, resync = self.bus.replay_after(since)
        snapshot = self.snapshot() if replay is None else None  # a resume that can replay needs none
        if on_snapshot is not None and snapshot is not None:
            on_snapshot(snapshot)
        self.bus.subscribe(feed)
        return snapshot, replay, resync

    def unsubscribe(self, feed: Callable[[ev.AnyEvent], None]) -> ev.Snapshot:
        """Stop feeding `feed`; returns the state it saw last."""
        snapshot = self.snapshot()
        self.bus.unsubscribe(feed)
        return snapshot
