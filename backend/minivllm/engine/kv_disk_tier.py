"""The disk tier bound to one engine: evicted prefix-cache blocks go to disk, prompt prefixes come back.

The engine schedules through the tier (`schedule`), which does two things around the scheduler's pass:
  before it, `restore_prefixes(waiting)` walks the first waiting requests' full prompt blocks past
  what RAM holds; each block the store keeps is read back into a free block and registered in the prefix
  cache, so admission finds it exactly as it finds a RAM hit (one mechanism, no new scheduler path);
  after it, `save_evicted()` copies out the cached blocks this step's allocations took over,
  before the model writes into them, and hands them to the store's writer thread.
At shutdown `flush()` also writes every block still cached in RAM, so a restart finds them all.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from minivllm.arith import ceil_div
from minivllm.core.block_manager import BlockManager, EvictedBlock
from minivllm.core.request import Request
from minivllm.core.scheduler import Scheduler, SchedulerOutput
from minivllm.engine.config import EngineConfig
from minivllm.engine.kv_disk_store import DiskKVStore
from minivllm.events import types as ev
from minivllm.model.attention import KVCache

REQUESTS_CHECKED = 4  # waiting requests looked up on disk per step: the ones admission reaches first
PREFILL_STEP_TOKENS = 64  # steps with at least this many tokens time recomputation (decode steps time weight reads)
SMOOTHING = 0.3  # weight of the newest measurement in the running averages


@dataclass
class RestoreCost:
    """Reading a block back against recomputing its tokens, both as measured on this engine. A resumed
    (preempted) or repeated request takes its blocks from disk only while the read is the cheaper."""

    read_s_per_block: float | None = None
    compute_s_per_token: float | None = None
    restored: int = 0  # blocks read back
    recomputed: int = 0  # blocks on disk left to recomputation because that was measured cheaper

    def pays(self, block_size: int) -> bool:
        if self.read_s_per_block is None or self.compute_s_per_token is None:
            return True  # unmeasured: try a read, which measures it
        return self.read_s_per_block < block_size * self.compute_s_per_token

    def observe_read(self, seconds: float) -> None:
        self.read_s_per_block = _smoothed(self.read_s_per_block, seconds)

    def observe_step(self, seconds: float, tokens: int) -> None:
        if tokens >= PREFILL_STEP_TOKENS:
            self.compute_s_per_token = _smoothed(self.compute_s_per_token, seconds / tokens)


def _smoothed(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


class DiskTier:
    def __init__(self, store: DiskKVStore, bm: BlockManager, kv_cache: KVCache):
        self.store, self.bm, self.kv_cache = store, bm, kv_cache
        self.cost = RestoreCost()
        self._last_step: tuple[float, int] | None = None  # (when the last plan was made, its tokens)
        bm.track_evictions = True

    def schedule(self, scheduler: Scheduler) -> SchedulerOutput:
        self._time_last_step()
        self.restore_prefixes(scheduler.waiting)
        plan = scheduler.schedule()
        self.save_evicted()  # blocks the plan took over still hold their old data until the step runs
        self._last_step = (time.perf_counter(), sum(s.num_tokens for s in plan.scheduled))
        return plan

    def _time_last_step(self) -> None:
        """Plan to plan is one step's time (the engine schedules first thing in a step)."""
        if self._last_step is not None:
            started, tokens = self._last_step
            self.cost.observe_step(time.perf_counter() - started, tokens)

    def stats(self) -> ev.DiskTierStats:
        store = self.store.stats
        return ev.DiskTierStats(
            blocks_written=store.writes,
            blocks_read=self.cost.restored,
            blocks_recomputed=self.cost.recomputed,
            write_errors=store.write_errors,
            corrupt_files=store.corrupt,
            files=store.files,
            bytes_on_disk=store.bytes_on_disk,
            max_bytes=self.store.max_bytes,
        )

    def save_evicted(self) -> None:
        self._keep(self.bm.take_evicted())

    def restore_prefixes(self, waiting: Iterable[Request]) -> int:
        """Bring the waiting requests' prompt blocks kept on disk into the prefix cache; returns how many."""
        restored = 0
        for request, _ in zip(waiting, range(REQUESTS_CHECKED), strict=False):
            if request.is_finished or (request.prompt_logprobs is not None and request.prompt_logprobs.pending):
                continue
            blocks = self._restore(request.seqs[0])
            request.restored_tokens += blocks * self.bm.block_size
            restored += blocks
        return restored

    def flush(self) -> None:
        """Write every block the prefix cache holds (the store skips those it keeps); wait for the writer."""
        self.save_evicted()
        self._keep(self.bm.cached_blocks())
        self.store.flush()

    def _keep(self, blocks: Iterable[EvictedBlock]) -> None:
        """Hand the blocks the store does not keep yet to its writer (copied out of the pool now)."""
        for block in blocks:
            if block.block_hash not in self.store:
                self.store.put(block.block_hash, block.token_ids, self._copy_out(block.block_id))

    def _restore(self, seq) -> int:
        bs = self.bm.block_size
        hashes = seq.block_hashes(bs)
        in_ram = len(self.bm.find_cached_prefix(seq.token_ids, hashes))
        on_disk = self._kept_run(hashes, in_ram, (seq.num_tokens - 1) // bs)  # as a RAM hit: never the last token
        # Only for a request the pool can then hold whole: else it waits, and what was read back is evicted
        # again before admission reaches it.
        if not on_disk or self.bm.num_free_blocks < ceil_div(seq.num_tokens + 1, bs):
            return 0
        if not self.cost.pays(bs):
            self.cost.recomputed += on_disk
            return 0
        for i in range(in_ram, in_ram + on_disk):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            started = time.perf_counter()
            tensors = self.store.get(hashes[i], tokens)
            if tensors is None:
                return i - in_ram
            block_id = self.bm.install_cached(hashes[i], tokens)
            self.save_evicted()  # the block taken may have held another cached prefix: keep it first
            self._copy_in(block_id, tensors)
            self.cost.observe_read(time.perf_counter() - started)
            self.cost.restored += 1
        return on_disk

    def _kept_run(self, hashes: list[int], start: int, end: int) -> int:
        """How many blocks from `start` on the store keeps, without a gap."""
        count = 0
        while start + count < end and hashes[start + count] in self.store:
            count += 1
        return count

    def _copy_out(self, block_id: int) -> dict[str, torch.Tensor]:
        return {
            "k": torch.stack([pool[block_id] for pool in self.kv_cache.k]).to("cpu", copy=True),
            "v": torch.stack([pool[block_id] for pool in self.kv_cache.v]).to("cpu", copy=True),
        }

    def _copy_in(self, block_id: int, tensors: dict[str, torch.Tensor]) -> None:
        for name, pools in (("k", self.kv_cache.k), ("v", self.kv_cache.v)):
            for layer, pool in enumerate(pools):
                pool[block_id].copy_(tensors[name][layer])


def kv_namespace(model_identity: str, kv_cache: KVCache, block_size: int) -> str:
    """A digest of what makes a block's numbers: the model (name, config, weights' sample, quantization)
    and the pool's layout (element type, block size, heads, head size, layers)."""
    pool = kv_cache.k[0]
    layout = f"{pool.dtype}|{block_size}|{tuple(pool.shape[2:])}|{len(kv_cache.k)}"
    return hashlib.blake2b(f"{model_identity}|{layout}".encode(), digest_size=12).hexdigest()


def model_identity(loaded) -> str:
    """The loaded model's identity for the disk tier: a different file, quantization or weight changes it."""
    vocab = loaded.config.vocab_size
    ids = torch.arange(0, vocab, max(1, vocab // 64), device=loaded.device)
    with torch.no_grad():  # rows of the embedding, whatever format holds it
        sample = loaded.model.embed_tokens(ids).to("cpu", torch.float32)
    digest = hashlib.blake2b(sample.numpy().tobytes(), digest_size=16).hexdigest()
    return f"{loaded.name}|{loaded.source}|{loaded.config!r}|{loaded.dtype}|{loaded.quant.mode}|{digest}"


class NoDiskTier:
    """RAM only (no --kv-offload-dir): the engine calls the same three methods, which do nothing."""

    store = None

    def stats(self) -> None:
        return None

    def schedule(self, scheduler: Scheduler) -> SchedulerOutput:
        return scheduler.schedule()

    def save_evicted(self) -> None:
        pass

    def restore_prefixes(self, waiting: Iterable[Request]) -> int:
        return 0

    def flush(self) -> None:
        pass


def disk_tier_for(loaded, config: EngineConfig, bm: BlockManager, kv_cache: KVCache) -> DiskTier | NoDiskTier:
    if not config.kv_offload_dir:
        return NoDiskTier()
    namespace = kv_namespace(model_identity(loaded), kv_cache, bm.block_size)
    store = DiskKVStore(Path(config.kv_offload_dir), namespace, config.kv_offload_bytes)
    return DiskTier(store, bm, kv_cache)
