"""N engine replicas on Ray, behind the part of `AsyncEngine`'s surface the server uses.

Each request is tokenized here (the tokenizer came from a replica once), routed by its prompt's
chained block hashes (`core/prefix_router.py`) and streamed from the chosen replica's actor. A
replica that dies fails only its own requests, with an `EngineDeadError` that names it (the
server's 503); a request it never started is routed again to a live one. Ray is imported only
when replicas are launched, so it stays an optional extra.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from minivllm.core.pooling import PoolingParams
from minivllm.core.prefix_router import PrefixRouter, RoutingDecision, prompt_block_hashes
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.outputs import PoolingRequestOutput, RequestOutput
from minivllm.engine.ray_replica import EngineReplica, ReplicaInfo
from minivllm.engine.telemetry import EngineStats
from minivllm.errors import ConfigError, EngineBusyError, EngineDeadError
from minivllm.events import types as ev
from minivllm.sampling.params import SamplingParams

log = logging.getLogger("minivllm.replicas")
T = TypeVar("T")
_ids = itertools.count()
RAY_MISSING = (
    "--data-parallel-size > 1 runs engine replicas on Ray, which is not installed: pip install 'minivllm[ray]'"
)


def import_ray():
    """Ray, or a ConfigError that says how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(RAY_MISSING, "data_parallel_size") from None
    return ray


def connect_ray(address: str | None = None, size: int = 1):
    """Join the Ray cluster at `address`, or start a local instance with a CPU per replica at least;
    no-op when connected. The server calls this on its main thread before uvicorn starts, so that
    uvicorn's SIGTERM handler (graceful: replicas stopped) replaces the one Ray installs."""
    ray = import_ray()
    if not ray.is_initialized():
        local = {"num_cpus": max(os.cpu_count() or 1, size)} if address is None else {}
        ray.init(address=address, include_dashboard=False, log_to_driver=False, **local)
    return ray


class _ReplicaDied(Exception):
    """The replica's actor is gone; `started`: whether the request had produced output there."""

    def __init__(self, reason: str, started: bool):
        super().__init__(reason)
        self.started = started


@dataclass
class Replica:
    index: int
    handle: Any  # the Ray actor handle
    node: str
    in_flight: int = 0  # requests this server has running or waiting there: the router's load
    dead_reason: str | None = None

    @property
    def alive(self) -> bool:
        return self.dead_reason is None


@dataclass(frozen=True)
class ReplicaStatus:
    index: int
    node: str
    alive: bool
    running: int
    waiting: int
    in_flight: int
    routed: int
    prefix_hit_rate: float  # of the prompt blocks routed here, the share the router matched
    dead_reason: str | None


class ReplicaSet:
    def __init__(self, handles: list[Any], infos: list[ReplicaInfo], policy: str = "prefix"):
        self._ray = import_ray()
        first = infos[0]
        self.replicas = [Replica(i, h, info.node) for i, (h, info) in enumerate(zip(handles, infos))]
        # a replica's pool holds at most num_blocks blocks: the router remembers no more per replica
        self.router = PrefixRouter(len(handles), max_blocks=first.num_blocks, policy=policy)
        self.block_size, self.model_name, self.max_model_len = first.block_size, first.model_name, first.max_model_len
        self.hidden_size, self.config, self.tokenizer = first.hidden_size, first.config, first.tokenizer
        self._streams: set[str] = set()
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-tokenize")
        self._listeners: list[Callable[[RoutingDecision], None]] = []
        self._events = [ReplicaEvents(self, r) for r in self.replicas]

    @classmethod
    def launch(
        cls, size: int, build: Callable[[], LLMEngine], address: str | None = None, policy: str = "prefix"
    ) -> ReplicaSet:
        """Start `size` replica actors (a local Ray instance, or the cluster at `address`), each
        building its engine with `build`, and wait until all are ready."""
        ray = connect_ray(address, size)
        actor = ray.remote(EngineReplica).options(num_cpus=1, scheduling_strategy="SPREAD")
        handles = [actor.remote(build) for _ in range(size)]
        infos = ray.get([h.describe.remote() for h in handles])
        return cls(handles, infos, policy)

    # ---- the AsyncEngine surface the server uses ------------------------------------------------

    def start(self) -> ReplicaSet:
        return self

    def shutdown(self) -> None:
        for replica in self.replicas:
            if replica.alive:
                self._ray.kill(replica.handle)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def is_alive(self) -> bool:
        return any(r.alive for r in self.replicas)

    @property
    def dead_reason(self) -> str | None:
        return None if self.is_alive else "; ".join(r.dead_reason or "" for r in self.replicas)

    def has_stream(self, request_id: str) -> bool:
        return request_id in self._streams

    async def tokenize(self, fn: Callable[[Any], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, self.tokenizer)

    async def compile_grammar(self, structured) -> None:
        """Compiled on every live replica, so a bad constraint is a 400 before routing and the
        chosen replica finds it cached."""
        await asyncio.gather(*(self._call(r, r.handle.compile_grammar, structured) for r in self._live()))

    async def reconfigure(self, **changes) -> ev.EngineInfo:
        raise EngineBusyError("engine settings cannot change while replicas run: restart the server with new flags")

    async def info(self) -> ev.EngineInfo:
        return await self._call(self._live()[0], self._live()[0].handle.info)

    async def snapshot(self) -> ev.Snapshot:
        return await self._call(self._live()[0], self._live()[0].handle.snapshot)

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
        """As `AsyncEngine.generate`, on the replica the router picks."""
        request_id = request_id or f"req-{next(_ids)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._streams.add(request_id)
        try:
            if prompt_token_ids is None:
                prompt_token_ids = await self.tokenize(lambda tok: tok.encode(prompt or ""))
            args = (prompt, params, request_id, prompt_token_ids, priority, cache_salt, preview)
            hashes = prompt_block_hashes(prompt_token_ids, self.block_size, cache_salt)
            while True:
                replica = self.replicas[self.route(request_id, hashes).replica]
                try:
                    async for out in self._stream(replica, args):
                        yield out
                    return
                except _ReplicaDied as exc:
                    if exc.started or not self.is_alive:
                        raise EngineDeadError(str(exc)) from None
                    # it never ran there: route again, to a live replica
        finally:
            self._streams.discard(request_id)

    async def embed(
        self, prompts: list[list[int]], pooling: PoolingParams, request_id: str | None = None, priority: int = 0
    ) -> list[PoolingRequestOutput]:
        request_id = request_id or f"embd-{next(_ids)}"
        replica = self.replicas[self.route(request_id, []).replica]
        replica.in_flight += 1
        try:
            return await self._call(replica, replica.handle.embed, prompts, pooling, request_id, priority)
        finally:
            replica.in_flight -= 1

    # ---- routing and the replicas' state ----------------------------------------------------------

    def route(self, request_id: str, hashes: list[int]) -> RoutingDecision:
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "no replica is alive")
        decision = self.router.route(request_id, hashes, [r.in_flight for r in self.replicas])
        for listener in list(self._listeners):
            listener(decision)
        return decision

    def on_route(self, listener: Callable[[RoutingDecision], None], on: bool = True) -> None:
        """Call `listener` with each routing decision (on the event loop) from now on, or stop."""
        if on:
            self._listeners.append(listener)
        elif listener in self._listeners:
            self._listeners.remove(listener)

    async def replica_stats(self) -> list[tuple[int, EngineStats]]:
        """Each live replica's stats (a replica found dead here is marked so)."""
        live = self._live()
        results = await asyncio.gather(*(self._call(r, r.handle.stats) for r in live), return_exceptions=True)
        return [(r.index, s) for r, s in zip(live, results) if isinstance(s, EngineStats)]

    async def status(self) -> list[ReplicaStatus]:
        stats = dict(await self.replica_stats())
        rows = []
        for r, routes in zip(self.replicas, self.router.replicas):
            s = stats.get(r.index)
            running, waiting = (s.num_running, s.num_waiting) if s is not None else (0, 0)
            hit = routes.hit_rate
            rows.append(
                ReplicaStatus(
                    r.index, r.node, r.alive, running, waiting, r.in_flight, routes.routed, hit, r.dead_reason
                )
            )
        return rows

    def _live(self) -> list[Replica]:
        live = [r for r in self.replicas if r.alive]
        if not live:
            raise EngineDeadError(self.dead_reason or "no replica is alive")
        return live

    def _mark_dead(self, replica: Replica, exc: BaseException) -> str:
        if replica.alive:
            replica.dead_reason = f"replica {replica.index} ({replica.node}) died: {type(exc).__name__}"
            self.router.mark_dead(replica.index)
            log.error("%s; new requests go to the live replicas", replica.dead_reason)
        return replica.dead_reason or ""

    async def _call(self, replica: Replica, method, *args):
        """One actor call, with Ray's wrappers taken off: the replica's own error, or a dead replica."""
        ray = self._ray
        try:
            return await method.remote(*args)
        except ray.exceptions.RayTaskError as exc:
            raise exc.cause if isinstance(exc.cause, Exception) else exc from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            raise EngineDeadError(self._mark_dead(replica, exc)) from None

    async def _stream(self, replica: Replica, args: tuple) -> AsyncIterator[RequestOutput]:
        ray = self._ray
        gen = replica.handle.generate.options(num_returns="streaming").remote(*args)
        replica.in_flight += 1
        started = finished = False
        try:
            async for ref in gen:
                out: RequestOutput = await ref
                started, finished = True, out.finished
                yield out
        except ray.exceptions.RayTaskError as exc:
            finished = True
            raise exc.cause if isinstance(exc.cause, Exception) else exc from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            finished = True
            reason = self._mark_dead(replica, exc)
            raise _ReplicaDied(
                f"{reason} while running request {args[2]}; retry it: new requests go to the live replicas", started
            ) from None
        finally:
            replica.in_flight -= 1
            if not finished:  # the client went away: abort it on the replica
                ray.cancel(gen)

    # ---- one replica's event stream, for the dashboard ---------------------------------------------

    def events_of(self, index: int) -> ReplicaEvents:
        if not 0 <= index < len(self.replicas):
            raise ValueError(f"replica must be in 0..{len(self.replicas) - 1}, got {index}")
        return self._events[index]

    # recordings and a dashboard that names no replica follow replica 0
    async def subscribe(self, feed, since: int | None = None, on_snapshot=None):
        return await self._events[0].subscribe(feed, since, on_snapshot)

    async def unsubscribe(self, feed) -> ev.Snapshot:
        return await self._events[0].unsubscribe(feed)

    async def resync(self, reset: Callable[[], None]) -> ev.Snapshot:
        return await self._events[0].resync(reset)

    def detach(self, feed) -> None:
        for events in self._events:
            events.detach(feed)

    def watch_step_profile(self, watcher, on: bool) -> None:
        """Step profiles stay on the replicas: their steps carry none."""


class ReplicaEvents:
    """The subscription half of `AsyncEngine`'s surface for one replica: its events pumped from the
    actor's `events` stream into the dashboard's feed on the event loop."""

    def __init__(self, owner: ReplicaSet, replica: Replica):
        self.owner, self.replica = owner, replica
        self._pumps: dict[Any, tuple[Any, asyncio.Task]] = {}

    async def subscribe(self, feed, since: int | None = None, on_snapshot=None):
        gen = self.replica.handle.events.options(num_returns="streaming").remote(since)
        try:
            first = await (await gen.__anext__())
        except Exception as exc:  # noqa: BLE001 - a dead replica has no events to give
            raise EngineDeadError(self.owner._mark_dead(self.replica, exc)) from None
        if on_snapshot is not None and first[0] is not None:
            on_snapshot(first[0])
        self._pumps[feed] = (gen, asyncio.ensure_future(_pump(gen, feed)))
        return first

    async def resync(self, reset: Callable[[], None]) -> ev.Snapshot:
        reset()
        return await self.owner._call(self.replica, self.replica.handle.snapshot)

    async def unsubscribe(self, feed) -> ev.Snapshot:
        self.detach(feed)
        return await self.owner._call(self.replica, self.replica.handle.snapshot)

    def detach(self, feed) -> None:
        gen, task = self._pumps.pop(feed, (None, None))
        if task is not None:
            task.cancel()
            self.owner._ray.cancel(gen)

    def watch_step_profile(self, watcher, on: bool) -> None:
        """Step profiles stay on the replica: a replica's steps carry none."""


async def _pump(gen, feed) -> None:
    try:
        async for ref in gen:
            for event in await ref:
                feed(event)
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - the replica died: its feed just ends
        log.warning("a replica's event stream ended", exc_info=True)
