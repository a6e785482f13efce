"""One engine replica as a Ray actor: an `AsyncEngine` (the engine steps on its own thread inside
the actor's process) behind async methods the server's `ReplicaSet` calls.

Outputs stream back through Ray's streaming generators; cancelling one (the client went away)
closes `AsyncEngine.generate`, which aborts the request on the replica. Ray itself is imported
only by `engine/replica_set.py`, which wraps this class with `ray.remote` when Ray is installed.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from minivllm.core.pooling import PoolingParams
from minivllm.engine.async_engine import AsyncEngine
from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.outputs import PoolingRequestOutput, RequestOutput
from minivllm.engine.telemetry import EngineStats
from minivllm.events import types as ev
from minivllm.sampling.params import SamplingParams


@dataclass(frozen=True)
class ReplicaInfo:
    """What the server needs of a replica once, at start: the model's identity and the tokenizer."""

    model_name: str
    max_model_len: int
    hidden_size: int
    block_size: int
    num_blocks: int
    config: EngineConfig
    tokenizer: Any
    node: str  # host:pid, so a cluster's layout shows in /v1/replicas


class EngineReplica:
    def __init__(self, build: Callable[[], LLMEngine]):
        self.ae = AsyncEngine(build()).start()

    async def describe(self) -> ReplicaInfo:
        ae = self.ae
        info = await ae.info()
        node = f"{os.uname().nodename}:{os.getpid()}"
        return ReplicaInfo(
            ae.model_name,
            ae.max_model_len,
            ae.hidden_size,
            info.block_size,
            info.num_blocks,
            ae.config,
            ae.tokenizer,
            node,
        )

    async def generate(
        self,
        prompt: str | None,
        params: SamplingParams | None,
        request_id: str,
        prompt_token_ids: list[int],
        priority: int,
        cache_salt: str | None,
        preview: str | None,
    ) -> AsyncIterator[RequestOutput]:
        async for out in self.ae.generate(prompt, params, request_id, prompt_token_ids, priority, cache_salt, preview):
            yield out

    async def embed(
        self, prompts: list[list[int]], pooling: PoolingParams, request_id: str, priority: int
    ) -> list[PoolingRequestOutput]:
        return await self.ae.embed(prompts, pooling, request_id, priority)

    async def compile_grammar(self, structured) -> None:
        await self.ae.compile_grammar(structured)

    async def stats(self) -> EngineStats:
        return await self.ae.stats()

    async def snapshot(self) -> ev.Snapshot:
        return await self.ae.snapshot()

    async def info(self) -> ev.EngineInfo:
        return await self.ae.info()

    async def events(self, since: int | None) -> AsyncIterator[Any]:
        """The dashboard's feed of this replica: first (snapshot, replay, resync), then each batch of
        events as the engine emits them, until the caller cancels."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[ev.AnyEvent] = asyncio.Queue()

        def feed(event: ev.AnyEvent) -> None:  # on the engine thread
            loop.call_soon_threadsafe(queue.put_nowait, event)

        try:
            yield await self.ae.subscribe(feed, since)
            while True:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                yield batch
        finally:
            self.ae.detach(feed)

    def shutdown(self) -> None:
        self.ae.shutdown()
