"""Paged KV-cache block manager with prefix caching and copy-on-write.

The KV cache is split into ``num_blocks`` fixed-size blocks of ``block_size`` token slots.
Each sequence owns a *block table* (list of block ids); logical token ``p`` of a sequence lives
in slot ``p % block_size`` of block ``table[p // block_size]``.

Sharing is tracked with reference counts:

* **Prefix caching** -- once a block is completely filled with computed tokens it gets a chained
  hash of ``(parent_hash, tokens)`` and is registered in ``hash -> block_id``. A new sequence
  whose prompt starts with the same tokens attaches those blocks instead of recomputing them.
  Every hit is verified against the tokens stored in the block, so a hash collision can never
  serve wrong KV data for that block.
* **Lazy invalidation** -- a cached block whose ref count drops to 0 keeps its hash and content.
  It sits in an LRU queue of free blocks and is only dropped from the cache ("evicted") when the
  pool runs out of uncached free blocks and it gets reused.
* **Copy-on-write** -- ``fork`` shares every block of a parent with a child; the first write into
  a shared block gives the writer a private copy (``prepare_write``).
* **Attention windows** -- under a model's sliding-window attention (Mistral) a block whose tokens all
  left the window of the sequence's next query is released (``free_window``): its slot in the table
  becomes ``FREED``, so positions keep their meaning. Released like any other block: a hashed one stays
  a cached prefix block (its KV depends only on the tokens its hash chains), an unhashed one is plain free.

The free list is two O(1) structures: a stack of uncached free blocks (always reused first, they
hold nothing of value) and an ``OrderedDict`` of cached free blocks in LRU order (oldest first).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from minivllm.arith import ceil_div

FREED = -1  # a table slot whose block left the sequence's attention window (`free_window`)

BlockEventKind = Literal["allocated", "freed", "released", "evicted", "shared", "cached", "copied", "restored"]


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and hashed
    token_ids: tuple[int, ...] = ()  # tokens stored in a hashed (full) block, used to verify a hit
    last_used: float = 0.0  # logical clock of the last ref-count change (LRU display)


@dataclass(frozen=True)
class BlockEvent:
    """A change in block state, queued for `take_events` with everything a display needs.

    ``ref_counts[i]`` is the ref count of ``block_ids[i]`` after the change. "released" means the
    sequence dropped its reference but others still hold the block; "freed" means it reached 0.
    ``table`` is the sequence's block table after the change (empty once the sequence is gone).
    """

    kind: BlockEventKind
    block_ids: list[int]
    owner: str | None
    seq_id: int | None
    ref_counts: list[int]
    table: list[int]
    seq_released: bool = False  # the sequence holds no blocks any more (its whole table went)
    prefix_hit: bool = False
    src_block_ids: list[int] | None = None
    block_hashes: list[int | None] | None = None
    to_disk: bool = False  # evicted with a disk tier on: its data goes to disk ("restored": comes back)
    # "freed" by a window: the blocks left a sliding KV window (`drop_window`) or the attention's (`free_window`)
    dropped: bool = False


class NoFreeBlocksError(RuntimeError):
    """Raised when a block is required but the pool is exhausted."""


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained block hash: a block's identity depends on everything before it. A keyed digest, not
    Python's `hash`: the same tokens hash alike in every process, so the disk tier's files (named by
    these hashes) serve a restarted server."""
    parent = (parent_hash or 0).to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=8).digest(), "little")


def hash_salt(salt: str) -> int:
    """The root of a salted request's hash chain (vLLM's `cache_salt`)."""
    return hash_block_tokens(None, tuple(salt.encode()))


@dataclass(frozen=True)
class EvictedBlock:
    """A cached block reused for new data: what the disk tier needs to keep it (`track_evictions`)."""

    block_id: int
    block_hash: int
    token_ids: tuple[int, ...]


class BlockManager:
    """Allocates KV blocks to sequences.

    Invariants (see ``check_invariants``):
      * a block's ref_count equals its number of occurrences across all block tables (>= 0);
      * the free structures hold exactly the blocks with ref_count 0, each once;
      * a free block keeps a hash iff the prefix cache maps that hash to it (cached free blocks);
      * every cache entry ``h -> b`` has ``blocks[b].block_hash == h`` and a full ``token_ids``;
      * hashed blocks of a table form a prefix of it (blocks fill and get hashed in order).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        record_events: bool = True,
        track_evictions: bool = False,
        sink_blocks: int | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.record_events = record_events
        self.track_evictions = track_evictions  # a disk tier copies evicted blocks out before they are rewritten
        self._events: list[BlockEvent] = []
        self._evicted: list[EvictedBlock] = []
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        self._free_uncached: list[int] = list(reversed(range(num_blocks)))  # stack: pop() -> lowest id first
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self._hash_to_block: dict[int, int] = {}
        self._tables: dict[int, list[int]] = {}
        self._owners: dict[int, str | None] = {}
        self._clock = 0.0
        # A sliding KV window (core/kv_window.py): sequences keep `sink_blocks` first blocks, and only those
        # enter the prefix cache (the window's keys are shifted in place as it slides). `_dropped`: tokens
        # each sequence has dropped; callers speak absolute token counts, its table holds the rest.
        self.sink_blocks = sink_blocks
        self._dropped: dict[int, int] = {}
        self._window_freed: dict[int, int] = {}  # leading FREED slots of each table (`free_window`)

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0, cached ones included (they are reclaimable)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._free_cached)

    def usage(self) -> float:
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's table by position: FREED where a block left its attention window."""
        return list(self._tables.get(seq_id, ()))

    def held_blocks(self, seq_id: int) -> list[int]:
        """The blocks the sequence holds, in table order (what a display shows)."""
        return [b for b in self._tables.get(seq_id, ()) if b != FREED]

    def is_cached(self, block_id: int) -> bool:
        """The block is reachable through the prefix cache (in use or free)."""
        h = self.blocks[block_id].block_hash
        return h is not None and self._hash_to_block.get(h) == block_id

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        have = len(self._tables.get(seq_id, ()))
        return max(0, ceil_div(num_tokens - self._dropped.get(seq_id, 0), self.block_size) - have)

    def find_cached_prefix(self, token_ids: Sequence[int], block_hashes: Sequence[int] | None = None) -> list[int]:
        """Cached blocks covering the longest prefix of ``token_ids``; never the last token.

        The last token is always left out so the model still runs on at least one token and
        produces logits. ``block_hashes``: the chained hashes of the full blocks of ``token_ids``
        when the caller keeps them (a sequence does), so that a lookup does not rehash. Pure
        lookup, no state change.
        """
        if not self.enable_prefix_caching:
            return []
        bs, parent, hits = self.block_size, None, []
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = block_hashes[i] if block_hashes is not None else hash_block_tokens(parent, tokens)
            bid = self._hash_to_block.get(parent)
            if bid is None or self.blocks[bid].token_ids != tokens:  # miss or collision
                break
            hits.append(bid)
        return hits

    def take_evicted(self) -> list[EvictedBlock]:
        """Cached blocks reused since the last call (only with `track_evictions`). Their pool data is
        intact until the next model step writes: the caller copies it out before then."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def cached_blocks(self) -> list[EvictedBlock]:
        """Every block reachable through the prefix cache, in use or free (a disk tier's flush)."""
        return [EvictedBlock(bid, h, self.blocks[bid].token_ids) for h, bid in self._hash_to_block.items()]

    def take_events(self) -> list[BlockEvent]:
        """The changes since the last call, oldest first (vLLM's ``take_events``)."""
        events = self._events
        if events:  # every emission drains: keep the empty case free of allocations
            self._events = []
        return events

    # ---------------------------------------------------------------- mutations

    def allocate_seq(self, seq_id: int, owner: str, token_ids: Sequence[int], prefix: list[int] | None = None) -> int:
        """Register a sequence, attach its cached prefix; return the number of tokens already computed.
        ``prefix``: what `find_cached_prefix` just returned for these tokens (saves a second lookup)."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already allocated")
        prefix = list(prefix) if prefix is not None else self.find_cached_prefix(token_ids)
        for bid in prefix:
            self._free_cached.pop(bid, None)  # reviving a free cached block
            self._incref(bid)
        self._tables[seq_id] = prefix
        self._owners[seq_id] = owner
        if prefix:
            self._emit("shared", prefix, seq_id, prefix_hit=True)
        return len(prefix) * self.block_size

    def install_cached(self, block_hash: int, token_ids: tuple[int, ...]) -> int:
        """Register a free block as the cached block for `block_hash` (data brought back from the disk
        tier): it sits at the LRU tail, ready for a prefix hit. The caller fills its pool data."""
        if block_hash in self._hash_to_block:
            raise ValueError("that hash is already cached")
        if len(token_ids) != self.block_size:
            raise ValueError(f"a cached block holds {self.block_size} tokens, not {len(token_ids)}")
        bid = self._take_free_block()
        block = self.blocks[bid]
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        self._hash_to_block[block_hash] = bid
        self._decref(bid)  # ref count 0 with its hash: a free cached block
        self._emit("restored", [bid], None, block_hashes=[block_hash])
        return bid

    def ensure_capacity(self, seq_id: int, num_tokens: int) -> bool:
        """Grow the table to hold ``num_tokens`` tokens. All-or-nothing: False means nothing changed."""
        table = self._tables[seq_id]
        need = self.blocks_needed(seq_id, num_tokens)
        if need > self.num_free_blocks:
            return False
        if need:
            new = [self._take_free_block() for _ in range(need)]
            table.extend(new)
            self._emit("allocated", new, seq_id)
        return True

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Free the table's blocks past those holding ``num_tokens`` tokens: speculative decoding's
        rollback of rejected drafts. Those blocks were allocated for drafts: never hashed."""
        table = self._tables[seq_id]
        keep = ceil_div(num_tokens - self._dropped.get(seq_id, 0), self.block_size)
        if len(table) <= keep:
            return
        tail = table[keep:]
        del table[keep:]
        self._drop_refs(tail, seq_id)

    def needs_copy_on_write(self, seq_id: int, position: int) -> bool:
        """Writing the KV of token ``position`` must go to a private copy of its block: the block
        is shared, or it is hashed -- it holds computed tokens of another sequence, as after a fork
        of a prefix that ends inside it -- and writing in place would corrupt the prefix cache."""
        table = self._tables.get(seq_id, ())
        idx = (position - self._dropped.get(seq_id, 0)) // self.block_size
        if idx >= len(table):
            return False
        block = self.blocks[table[idx]]
        return block.ref_count > 1 or block.block_hash is not None

    def prepare_write(self, seq_id: int, position: int) -> tuple[int, int] | None:
        """Copy-on-write before writing the KV of token ``position``.

        Returns ``(src, dst)`` when the caller must copy the block's KV data into the fresh
        private block ``dst`` (see `needs_copy_on_write`); None when the block is already the
        sequence's own (or not allocated yet -- a block from ``ensure_capacity`` always is).
        """
        if not self.needs_copy_on_write(seq_id, position):
            return None
        if not self.num_free_blocks:
            raise NoFreeBlocksError(f"no free block for copy-on-write of sequence {seq_id}")
        table = self._tables[seq_id]
        idx = (position - self._dropped.get(seq_id, 0)) // self.block_size
        src, dst = table[idx], self._take_free_block()
        table[idx] = dst
        self._emit("copied", [dst], seq_id, src_block_ids=[src])
        self._decref(src)  # a hashed source held by this sequence alone becomes free (and stays cached)
        self._emit("released" if self.blocks[src].ref_count else "freed", [src], seq_id)
        return src, dst

    def commit_full_blocks(
        self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int, block_hashes: Sequence[int] | None = None
    ) -> None:
        """Hash every newly completed block and register it in the prefix cache.

        Only new blocks are touched: walk back from the last full block to the last hashed one,
        so a decode step costs O(1) unless a block just filled up. When another block already
        holds the same hash the existing mapping wins; this block still records its hash (it is
        the parent of the next block's hash) but is not reachable through the cache.
        ``block_hashes``: the sequence's chained block hashes, when it keeps them.
        """
        if not self.enable_prefix_caching:
            return
        table, bs = self._tables[seq_id], self.block_size
        cacheable = len(table) if self.sink_blocks is None else min(self.sink_blocks, len(table))
        floor = self._window_freed.get(seq_id, 0)  # FREED slots: their blocks were hashed before they left
        start = end = min(num_computed_tokens // bs, cacheable)
        while start > floor and self.blocks[table[start - 1]].block_hash is None:
            start -= 1
        if start == floor > 0 and block_hashes is None:
            return  # the chain's parent left with its block: nothing to hash it from
        parent = self.blocks[table[start - 1]].block_hash if start > floor else None
        registered: list[int] = []
        for i in range(start, end):
            block = self.blocks[table[i]]
            block.token_ids = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = block_hashes[i] if block_hashes is not None else hash_block_tokens(parent, block.token_ids)
            block.block_hash = parent
            if parent not in self._hash_to_block:
                self._hash_to_block[parent] = block.block_id
                registered.append(block.block_id)
        if registered:
            hashes = [self.blocks[b].block_hash for b in registered]
            self._emit("cached", registered, seq_id, block_hashes=hashes)

    def fork(
        self, parent_seq_id: int, child_seq_id: int, owner: str | None = None, num_tokens: int | None = None
    ) -> None:
        """Give the child the parent's blocks (shared, copy-on-write); with ``num_tokens``, only
        the blocks holding the parent's first ``num_tokens`` tokens (the child diverges there)."""
        if child_seq_id in self._tables:
            raise ValueError(f"sequence {child_seq_id} already allocated")
        if self._dropped.get(parent_seq_id):
            raise ValueError("a sequence that slid its KV window cannot fork (its blocks are shifted in place)")
        table = list(self._tables[parent_seq_id])
        if num_tokens is not None:
            table = table[: ceil_div(num_tokens, self.block_size)]
        held = [bid for bid in table if bid != FREED]
        for bid in held:
            self._incref(bid)
        self._tables[child_seq_id] = table
        self._owners[child_seq_id] = owner if owner is not None else self._owners[parent_seq_id]
        freed = self._window_freed.get(parent_seq_id, 0)
        if freed:
            self._window_freed[child_seq_id] = min(freed, len(table))
        if held:
            self._emit("shared", held, child_seq_id)

    def free_seq(self, seq_id: int) -> None:
        """Drop the sequence's references. Blocks reaching 0 become free; cached ones stay hittable.

        Blocks are released last-first so that, for cached blocks, the tail of a prompt is
        evicted before its head (a head is shared by more prompts).
        """
        if seq_id not in self._tables:
            return
        table = self._tables.pop(seq_id)  # gone before the events: listeners see the table released
        self._dropped.pop(seq_id, None)
        self._window_freed.pop(seq_id, None)
        self._drop_refs([bid for bid in table if bid != FREED], seq_id)
        del self._owners[seq_id]

    def free_window(self, seq_id: int, first_visible: int) -> int:
        """A model's sliding-window attention: release the blocks whose tokens all lie before
        `first_visible`, the first position the sequence's next query still attends to. Their slots
        become FREED (positions keep their meaning); returns how many blocks were released."""
        table, start = self._tables[seq_id], self._window_freed.get(seq_id, 0)
        end = min(max(first_visible, 0) // self.block_size, len(table))
        if end <= start:
            return 0
        left = table[start:end]
        table[start:end] = [FREED] * (end - start)
        self._window_freed[seq_id] = end
        self._drop_refs(left, seq_id, dropped=True)
        return end - start

    def drop_window(self, seq_id: int, num_blocks: int) -> list[int]:
        """A sliding KV window: free the sequence's `num_blocks` oldest blocks after its sinks and compact its
        table. Returns the blocks after the sinks that remain: their keys must move back by the dropped
        tokens (model/kv_window.py) before the next step reads them. Those blocks are this sequence's
        alone (never hashed past the sinks, no forks with a window), so shifting them in place is safe."""
        table, first = self._tables[seq_id], self.sink_blocks or 0
        if num_blocks < 1 or first + num_blocks > len(table):
            raise ValueError(f"cannot drop {num_blocks} blocks after {first} sinks from a table of {len(table)}")
        dropped = table[first : first + num_blocks]
        del table[first : first + num_blocks]
        self._dropped[seq_id] = self._dropped.get(seq_id, 0) + num_blocks * self.block_size
        self._drop_refs(dropped, seq_id, dropped=True)
        return table[first:]

    def dropped_tokens(self, seq_id: int) -> int:
        return self._dropped.get(seq_id, 0)

    def _drop_refs(self, block_ids: list[int], seq_id: int, **extra) -> None:
        """Release the sequence's references to these blocks, last first."""
        freed, released = [], []
        for bid in reversed(block_ids):
            self._decref(bid)
            (released if self.blocks[bid].ref_count else freed).append(bid)
        if freed:
            self._emit("freed", freed, seq_id, **extra)
        if released:
            self._emit("released", released, seq_id, **extra)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash. Free cached blocks become plain free blocks ("evicted").

        Blocks still in use keep their own hash (needed to chain the next block) but are no longer
        reachable; they are cleaned when freed.
        """
        evicted = list(self._free_cached)
        hashes = [self.blocks[bid].block_hash for bid in evicted]
        for bid in evicted:
            self._clear_hash(bid)
        self._free_cached.clear()
        self._free_uncached.extend(reversed(evicted))  # the oldest gets reused first
        self._hash_to_block.clear()
        if evicted:
            self._emit("evicted", evicted, None, block_hashes=hashes)

    # ------------------------------------------------------------------ helpers

    def _take_free_block(self) -> int:
        """Pop a free block: uncached first (nothing lost), else evict the LRU cached one."""
        if self._free_uncached:
            bid = self._free_uncached.pop()
        else:
            bid, _ = self._free_cached.popitem(last=False)
            evicted_hash = self.blocks[bid].block_hash
            if self.track_evictions:
                self._evicted.append(EvictedBlock(bid, evicted_hash, self.blocks[bid].token_ids))
            del self._hash_to_block[evicted_hash]
            self._clear_hash(bid)
            self._emit("evicted", [bid], None, block_hashes=[evicted_hash], to_disk=self.track_evictions)
        self._incref(bid)
        return bid

    def _incref(self, bid: int) -> None:
        block = self.blocks[bid]
        block.ref_count += 1
        block.last_used = self._tick()

    def _decref(self, bid: int) -> None:
        block = self.blocks[bid]
        block.ref_count -= 1
        block.last_used = self._tick()
        if block.ref_count:
            return
        if block.block_hash is not None and self._hash_to_block.get(block.block_hash) == bid:
            self._free_cached[bid] = None  # LRU tail: most recently used, evicted last
        else:
            self._clear_hash(bid)  # a duplicate or unhashed block is worthless once free
            self._free_uncached.append(bid)

    def _clear_hash(self, bid: int) -> None:
        block = self.blocks[bid]
        block.block_hash, block.token_ids = None, ()

    def _tick(self) -> float:
        self._clock += 1.0
        return self._clock

    def _emit(self, kind: BlockEventKind, block_ids: list[int], seq_id: int | None, **extra) -> None:
        if not self.record_events:
            return
        ref_counts = [self.blocks[b].ref_count for b in block_ids]
        owner = self._owners.get(seq_id) if seq_id is not None else None
        table = self._tables.get(seq_id) if seq_id is not None else None
        if table is not None and self._window_freed.get(seq_id):
            table = [b for b in table if b != FREED]  # the blocks it holds: a display has no use for FREED slots
        self._events.append(
            BlockEvent(
                kind,
                list(block_ids),
                owner,
                seq_id,
                ref_counts,
                list(table or ()),
                seq_released=seq_id is not None and table is None,
                **extra,
            )
        )

    # ---------------------------------------------------------------- debugging

    def snapshot(self) -> dict:
        """Full state for display/debugging (O(num_blocks); not meant for every step)."""
        blocks = [
            {
                "block_id": b.block_id,
                "ref_count": b.ref_count,
                "block_hash": b.block_hash,
                "num_tokens": len(b.token_ids) if b.block_hash is not None else 0,
                "cached": b.block_hash is not None and self._hash_to_block.get(b.block_hash) == b.block_id,
                "last_used": b.last_used,
            }
            for b in self.blocks
        ]
        tables = {sid: self.held_blocks(sid) for sid in self._tables}
        return {"blocks": blocks, "tables": tables, "free_cached_lru": list(self._free_cached)}

    def check_invariants(self) -> None:
        """Raise AssertionError describing the first broken invariant (O(total state))."""
        counts = [0] * self.num_blocks
        for sid, full in self._tables.items():
            freed = self._window_freed.get(sid, 0)
            assert all(b == FREED for b in full[:freed]), f"seq {sid}: a block before its window start in {full}"
            table = full[freed:]
            assert len(set(table)) == len(table), f"seq {sid}: block listed twice in {table}"
            for bid in table:
                assert 0 <= bid < self.num_blocks, f"seq {sid}: invalid block id {bid}"
                counts[bid] += 1
            hashed = [self.blocks[b].block_hash is not None for b in table]
            assert hashed == sorted(hashed, reverse=True), f"seq {sid}: hashed blocks are not a prefix of {table}"
        for b in self.blocks:
            assert b.ref_count >= 0, f"block {b.block_id}: negative ref_count {b.ref_count}"
            assert b.ref_count == counts[b.block_id], (
                f"block {b.block_id}: ref_count {b.ref_count} but in {counts[b.block_id]} tables"
            )
        free = self._free_uncached + list(self._free_cached)
        assert len(set(free)) == len(free), f"free list has duplicates: {free}"
        zero = {b.block_id for b in self.blocks if b.ref_count == 0}
        assert set(free) == zero, f"free list {sorted(free)} != blocks with ref_count 0 {sorted(zero)}"
        for bid in self._free_uncached:
            assert self.blocks[bid].block_hash is None, f"uncached free block {bid} still has a hash"
        for bid in self._free_cached:
            h = self.blocks[bid].block_hash
            assert h is not None and self._hash_to_block.get(h) == bid, f"cached free block {bid} not in cache"
        for h, bid in self._hash_to_block.items():
            b = self.blocks[bid]
            assert b.block_hash == h, f"cache entry {h} -> block {bid} whose hash is {b.block_hash}"
            assert len(b.token_ids) == self.block_size, f"cached block {bid} holds {len(b.token_ids)} tokens"
        used = sum(1 for b in self.blocks if b.ref_count > 0)
        assert self.num_free_blocks + used == self.num_blocks, "free + used != num_blocks"
        assert self._owners.keys() == self._tables.keys(), "owners and tables disagree"
        assert self._dropped.keys() <= self._tables.keys(), "a dropped offset outlived its sequence"
        assert self._window_freed.keys() <= self._tables.keys(), "a window start outlived its sequence"
