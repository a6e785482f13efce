"""Running several engine streams as one response (a /v1/completions request with a list of
prompts): all or nothing, and interleaved as their outputs come."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")


async def all_or_none(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Await them concurrently; the first failure cancels the others and is raised (a cancelled
    engine stream aborts its request)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merged(streams: dict[int, AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(key, item) from all streams as each produces it, until all are exhausted. An error in one is
    raised at once; the reads still pending on the others are cancelled (closing the streams
    themselves is the caller's: a stream may be closed only once no read of it is in flight)."""
    if len(streams) == 1:  # the usual case: no task per item
        ((key, stream),) = streams.items()
        async for item in stream:
            yield key, item
        return
    reads = {asyncio.ensure_future(anext(stream)): key for key, stream in streams.items()}
    try:
        while reads:
            done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: reads[t]):
                key = reads.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                reads[asyncio.ensure_future(anext(streams[key]))] = key
                yield key, item
    finally:
        for task in reads:
            task.cancel()
        await asyncio.gather(*reads, return_exceptions=True)
