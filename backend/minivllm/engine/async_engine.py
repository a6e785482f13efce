"""The engine loop in its own thread, with an asyncio-facing API.

Everything that touches engine state runs on the engine thread: requests, aborts and arbitrary
calls (snapshots, reconfiguration) arrive as commands through a queue and are drained between
steps. Outputs go back to each request's asyncio queue with `call_soon_threadsafe`. A consumer
that stops iterating (cancelled task, client disconnect) aborts its request; the abort is
handled before the next step, so the request's blocks are freed within one step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from minivllm.core.pooling import PoolingParams
from minivllm.engine.llm_engine import LLMEngine, Subscription
from minivllm.engine.outputs import PoolingRequestOutput, RequestOutput
from minivllm.engine.telemetry import EngineStats
from minivllm.errors import EngineDeadError, RequestFailedError
from minivllm.events import types as ev
from minivllm.sampling.params import SamplingParams

log = logging.getLogger("minivllm.engine")
T = TypeVar("T")
_ids = itertools.count()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_poll_s: float = 0.25):
        self.engine = engine
        self.idle_poll_s = idle_poll_s
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Future | None]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wakeup = threading.Event()
        self._stopping = False
        self.dead_reason: str | None = None
        self._thread = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)
        # Tokenizing and chat templates take seconds on a multi-MB prompt: never on the engine thread,
        # where they would freeze every running stream. One worker: encodes run one at a time.
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-tokenize")
        # Grammars compile on a worker of their own: a large constraint (seconds) never queues the
        # tokenization of other requests. llguidance releases the GIL while it compiles.
        self._grammar_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-grammar")

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.dead_reason is None

    # ---- API ------------------------------------------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        return await asyncio.wrap_future(self.submit(fn))

    def submit(self, fn: Callable[[LLMEngine], T]) -> Future:
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        future: Future = Future()
        self._commands.put((fn, future))
        self._wakeup.set()
        return future

    # ---- the engine's state, read on its thread -----------------------------------------------

    @property
    def model_name(self) -> str:
        return self.engine.loaded.name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def hidden_size(self) -> int:
        """The width of the model's hidden states: the size of a pooled vector."""
        return self.engine.loaded.config.hidden_size

    @property
    def config(self):
        """The engine's configuration (an immutable EngineConfig: safe to read from any thread)."""
        return self.engine.config

    async def snapshot(self) -> ev.Snapshot:
        return await self.call(lambda e: e.snapshot())

    async def info(self) -> ev.EngineInfo:
        return await self.call(lambda e: e.info())

    async def stats(self) -> EngineStats:
        return await self.call(lambda e: e.stats())

    async def reconfigure(self, **changes) -> ev.EngineInfo:
        def apply(engine: LLMEngine) -> ev.EngineInfo:
            engine.reconfigure(**changes)
            return engine.info()

        return await self.call(apply)

    async def subscribe(
        self,
        feed: Callable[[ev.AnyEvent], None],
        since: int | None = None,
        on_snapshot: Callable[[ev.Snapshot], None] | None = None,
    ) -> Subscription:
        """Feed events to `feed` from now on (see LLMEngine.subscribe); `on_snapshot` runs on the
        engine thread with the starting snapshot before the first event can arrive."""
        return await self.call(lambda e: e.subscribe(feed, since, on_snapshot))

    async def unsubscribe(self, feed: Callable[[ev.AnyEvent], None]) -> ev.Snapshot:
        """Stop feeding `feed`; returns the state after the last event it got."""
        return await self.call(lambda e: e.unsubscribe(feed))

    def detach(self, feed: Callable[[ev.AnyEvent], None]) -> None:
        """Stop feeding `feed` at once, from any thread (the bus is locked); works on a dead engine."""
        self.engine.bus.unsubscribe(feed)
        self.watch_step_profile(feed, False)

    def watch_step_profile(self, watcher: Hashable, on: bool) -> None:
        """A dashboard client opened (on) or closed its step-profile panel: steps carry their profile
        while any client watches (engine/step_profile.py). Any thread."""
        profiler = self.engine.telemetry.profiler
        if profiler is not None:
            profiler.watch(watcher, on)

    async def resync(self, reset: Callable[[], None]) -> ev.Snapshot:
        """`reset()` and a fresh snapshot, with no event in between."""

        def run(engine: LLMEngine) -> ev.Snapshot:
            reset()
            return engine.snapshot()

        return await self.call(run)

    # ---- requests -----------------------------------------------------------------------------

    def has_stream(self, request_id: str) -> bool:
        """Whether a request with this id is being served."""
        return request_id in self._streams

    async def tokenize(self, fn: Callable[[Any], T]) -> T:
        """Run `fn(tokenizer)` off the engine thread (the tokenizer is read-only once loaded)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, fn, self.engine.tokenizer)

    async def compile_grammar(self, structured) -> None:
        """Compile (and cache) a structured-output grammar on the grammar worker; a bad one raises
        RequestRejectedError naming the field, before the request reaches the engine."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._grammar_pool, self.engine.grammars.compile, structured)

    def abort(self, request_id: str) -> None:
        if self.is_alive:
            self._commands.put((lambda e: e.abort_request(request_id), None))
            self._wakeup.set()

    async def generate(
        self,
        prompt: str | None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        preview: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams RequestOutputs until the request finishes, each with what is new (text, tokens,
        logprobs; `OutputAccumulator` folds them). Validation errors are raised before the first."""
        request_id = request_id or f"req-{next(_ids)}"
        if request_id in self._streams:  # must not take over (or abort) the stream of the request using it
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = (asyncio.get_running_loop(), asyncio.Queue())
        outputs = stream[1]
        self._streams[request_id] = stream
        finished = rejected = False
        try:
            try:
                if prompt_token_ids is None:
                    prompt_token_ids = await self.tokenize(lambda _: self.engine.encode(prompt or ""))
                await self.call(
                    lambda e: e.add_request(request_id, prompt, params, prompt_token_ids, priority, cache_salt, preview)
                )
            except Exception:
                rejected = True  # never added: there is nothing of ours to abort under this id
                raise
            while not finished:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not finished and not rejected:
                self.abort(request_id)

    async def embed(
        self, prompts: list[list[int]], pooling: PoolingParams, request_id: str | None = None, priority: int = 0
    ) -> list[PoolingRequestOutput]:
        """Each prompt (token ids) pooled into one vector, one engine request each (`<id>-<i>` for
        several), all queued in one engine call so they share steps. All or none: a rejected prompt
        queues none; a failure or a cancellation aborts the ones still running."""
        request_id = request_id or f"embd-{next(_ids)}"
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        taken = next((rid for rid in ids if rid in self._streams), None)
        if taken is not None:
            raise ValueError(f"request id {taken!r} is already in use")
        loop = asyncio.get_running_loop()
        streams = {rid: (loop, asyncio.Queue()) for rid in ids}
        self._streams.update(streams)
        results: list[PoolingRequestOutput] = []
        added = False
        try:
            await self.call(lambda e: e.add_pooling_requests(ids, prompts, pooling, priority))
            added = True
            for rid in ids:
                out = await streams[rid][1].get()
                if isinstance(out, BaseException):
                    raise out
                if not isinstance(out, PoolingRequestOutput):  # aborted by someone else (the dashboard)
                    raise RequestFailedError(f"request {rid} was aborted before its prompt was pooled")
                results.append(out)
            return results
        finally:
            for rid, stream in streams.items():
                if self._streams.get(rid) is stream:
                    del self._streams[rid]
            if added:
                for rid in ids[len(results) :]:
                    self.abort(rid)  # one that finished already is left alone by the engine

    # ---- the loop -------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_commands()
                if self.engine.has_work():
                    self._step()
                else:
                    self._idle()
            self.engine.close()
        except BaseException as exc:  # noqa: BLE001 - record why the engine died for /health
            log.exception("engine thread died")
            self.dead_reason = f"engine thread died: {exc!r}"
            self._fail_all(EngineDeadError(self.dead_reason))

    def _idle(self) -> None:
        try:
            self.engine.emit_metrics_if_due()
        except Exception:  # noqa: BLE001 - a metrics sample is not worth the engine thread
            log.exception("idle metrics sample failed; the engine goes on")
        self._wakeup.wait(self.idle_poll_s)
        self._wakeup.clear()

    def _drain_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and not future.set_running_or_notify_cancel():
                continue  # the caller gave up (cancelled) before it ran
            try:
                result = fn(self.engine)
            except Exception as exc:  # a bad request fails alone
                if future is not None:
                    future.set_exception(exc)
            else:
                if future is not None:
                    future.set_result(result)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - one failed step must not stop the server
            log.exception("engine step failed; aborting the requests it was running")
            self._abort_running(exc)
            return
        self._deliver_all(
            [(o.request_id, o if o.error is None else RequestFailedError(o.error, o.error_param)) for o in outputs]
        )

    def _abort_running(self, exc: Exception) -> None:
        for request_id in self.engine.abort_running():
            self._deliver(request_id, RequestFailedError(f"internal error while running the request: {exc}"))

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, outputs = stream
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:  # the consumer's loop is closed
                self._streams.pop(request_id, None)

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """A step's outputs: one wake-up of each consumer loop per step, not one per output (at 32
        streams, one cross-thread hand-off instead of 32)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[str, asyncio.Queue, Any]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((request_id, stream[1], item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the consumers' loop is closed
                for request_id, _, _ in batch:
                    self._streams.pop(request_id, None)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self._streams):
            self._deliver(request_id, exc)
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(exc)


def _put_all(batch: list[tuple[str, asyncio.Queue, Any]]) -> None:
    for _, outputs, item in batch:
        outputs.put_nowait(item)
