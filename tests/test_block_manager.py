"""Tests for the paged-KV block manager (prefix caching, LRU eviction, copy-on-write)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minivllm.core import block_manager as bm_mod
from minivllm.core.block_manager import BlockEvent, BlockManager, NoFreeBlocksError

BS = 4


class EventLog(list):
    """The manager's queued events (`take_events`), drained into this list whenever a test reads it."""

    def __init__(self, bm: BlockManager):
        super().__init__()
        self.bm = bm

    def _drain(self) -> None:
        super().extend(self.bm.take_events())

    def __iter__(self):
        self._drain()
        return super().__iter__()

    def __getitem__(self, i):
        self._drain()
        return super().__getitem__(i)

    def __len__(self) -> int:
        self._drain()
        return super().__len__()

    def clear(self) -> None:
        self.bm.take_events()
        super().clear()


def make(num_blocks: int = 8, block_size: int = BS, **kw) -> tuple[BlockManager, list[BlockEvent]]:
    bm = BlockManager(num_blocks, block_size, **kw)
    return bm, EventLog(bm)


def run_prompt(bm: BlockManager, seq_id: int, tokens: list[int], owner: str = "r") -> int:
    """Allocate, 'compute' the whole prompt and commit it, like one prefill step. Returns cached tokens."""
    cached = bm.allocate_seq(seq_id, owner, tokens)
    assert bm.ensure_capacity(seq_id, len(tokens))
    bm.commit_full_blocks(seq_id, tokens, len(tokens))
    bm.check_invariants()
    return cached


def refs(bm: BlockManager, ids: list[int]) -> list[int]:
    return [bm.blocks[b].ref_count for b in ids]


def test_allocate_grow_free_returns_everything():
    bm, _ = make()
    assert bm.allocate_seq(1, "a", list(range(10))) == 0
    assert bm.blocks_needed(1, 10) == 3
    assert bm.ensure_capacity(1, 10)
    assert len(bm.block_table(1)) == 3 and bm.num_free_blocks == 5
    assert bm.blocks_needed(1, 12) == 0 and bm.blocks_needed(1, 13) == 1
    assert bm.ensure_capacity(1, 13)
    assert len(bm.block_table(1)) == 4
    assert bm.usage() == pytest.approx(0.5)
    bm.check_invariants()
    bm.free_seq(1)
    bm.check_invariants()
    assert not bm.has_seq(1) and bm.block_table(1) == []
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert bm.num_free_blocks == 8 and bm.usage() == 0.0
    bm.free_seq(1)  # unknown: no-op


def test_duplicate_seq_id_rejected():
    bm, _ = make()
    bm.allocate_seq(1, "a", [1, 2])
    with pytest.raises(ValueError):
        bm.allocate_seq(1, "a", [1, 2])


def test_prefix_hit_shares_blocks():
    bm, _ = make()
    prefix = list(range(3 * BS))
    assert run_prompt(bm, 1, prefix + [100, 101]) == 0
    t1 = bm.block_table(1)
    assert bm.find_cached_prefix(prefix + [7]) == t1[:3]
    assert run_prompt(bm, 2, prefix + [200]) == 3 * BS
    t2 = bm.block_table(2)
    assert t2[:3] == t1[:3] and t2[3] != t1[3]
    assert refs(bm, t1[:3]) == [2, 2, 2]
    # A different first block breaks the chain even if later blocks match.
    assert bm.find_cached_prefix([999] + prefix[1:] + [5]) == []


def test_last_token_never_covered():
    bm, _ = make()
    tokens = list(range(2 * BS))
    run_prompt(bm, 1, tokens)
    assert len(bm.find_cached_prefix(tokens)) == 1  # 2 full blocks cached, only 1 reusable
    assert len(bm.find_cached_prefix(tokens + [0])) == 2
    assert bm.allocate_seq(2, "b", tokens) == BS
    assert bm.find_cached_prefix(tokens[:1]) == [] and bm.find_cached_prefix([]) == []


def test_hash_collision_is_not_reused(monkeypatch):
    monkeypatch.setattr(bm_mod, "hash_block_tokens", lambda parent, tokens: 42)  # everything collides
    bm, _ = make()
    run_prompt(bm, 1, [1, 2, 3, 4, 5])
    assert bm.find_cached_prefix([1, 2, 3, 4, 5]) == bm.block_table(1)[:1]  # genuine hit still works
    assert bm.find_cached_prefix([9, 9, 9, 9, 5]) == []
    assert bm.allocate_seq(2, "b", [9, 9, 9, 9, 5]) == 0
    assert bm.ensure_capacity(2, 5)
    assert set(bm.block_table(2)).isdisjoint(bm.block_table(1))
    bm.commit_full_blocks(2, [9, 9, 9, 9, 5], 5)  # colliding hash: first mapping is kept
    bm.check_invariants()
    assert bm.find_cached_prefix([1, 2, 3, 4, 5]) == bm.block_table(1)[:1]


def test_prefix_caching_disabled():
    bm, events = make(enable_prefix_caching=False)
    run_prompt(bm, 1, list(range(9)))
    assert bm.find_cached_prefix(list(range(9))) == []
    assert all(b.block_hash is None for b in bm.blocks)
    assert not [e for e in events if e.kind == "cached"]
    bm.free_seq(1)
    assert bm.num_cached_free_blocks == 0


def test_freed_cached_blocks_reused_then_evicted_lru_first():
    bm, events = make(num_blocks=4)
    a, b = [1] * BS + [2], [3] * BS + [4]
    run_prompt(bm, 1, a)
    bm.free_seq(1)
    run_prompt(bm, 2, b)
    bm.free_seq(2)
    bm.check_invariants()
    assert bm.num_free_blocks == 4 and bm.num_cached_free_blocks == 2
    block_a, block_b = bm.find_cached_prefix(a)[0], bm.find_cached_prefix(b)[0]

    # Reuse: a later identical prompt revives the freed cached block.
    assert run_prompt(bm, 3, a) == BS
    assert bm.block_table(3)[0] == block_a and bm.blocks[block_a].ref_count == 1
    bm.free_seq(3)  # block_a is now the most recently freed cached block
    bm.check_invariants()

    # Exhaust the pool: uncached blocks go first, then the LRU cached one (block_b).
    events.clear()
    bm.allocate_seq(4, "d", [])
    assert bm.ensure_capacity(4, 3 * BS)
    evicted = [e.block_ids for e in events if e.kind == "evicted"]
    assert evicted == [[block_b]]
    assert all(e.owner is None and e.seq_id is None for e in events if e.kind == "evicted")
    assert bm.find_cached_prefix(b) == [] and bm.find_cached_prefix(a) == [block_a]
    assert block_a not in bm.block_table(4)
    assert bm.ensure_capacity(4, 4 * BS)
    assert bm.find_cached_prefix(a) == [] and bm.num_cached_free_blocks == 0
    bm.check_invariants()


def test_ensure_capacity_all_or_nothing():
    bm, events = make(num_blocks=4)
    bm.allocate_seq(1, "a", [])
    assert bm.ensure_capacity(1, 2 * BS)
    bm.allocate_seq(2, "b", [])
    before = (bm.block_table(2), bm.num_free_blocks, len(events))
    assert not bm.ensure_capacity(2, 3 * BS)  # needs 3, only 2 free
    assert (bm.block_table(2), bm.num_free_blocks, len(events)) == before
    assert bm.ensure_capacity(2, 2 * BS) and bm.num_free_blocks == 0
    assert bm.ensure_capacity(2, 2 * BS)  # already enough: no-op success
    bm.check_invariants()


def test_fork_and_copy_on_write():
    bm, events = make()
    tokens = list(range(BS + 2))  # one full block + a partial one
    run_prompt(bm, 1, tokens, owner="p")
    bm.fork(1, 2, owner="c")
    full, partial = bm.block_table(1)
    assert bm.block_table(2) == [full, partial] and refs(bm, [full, partial]) == [2, 2]

    events.clear()
    src, dst = bm.prepare_write(2, len(tokens))  # child appends into the shared partial block
    assert src == partial and dst not in (full, partial)
    assert bm.block_table(2) == [full, dst] and bm.block_table(1) == [full, partial]
    assert refs(bm, [full, partial, dst]) == [2, 1, 1]
    assert [e.kind for e in events] == ["copied", "released"]
    assert events[0].src_block_ids == [partial] and events[0].block_ids == [dst] and events[0].owner == "c"
    assert events[1].block_ids == [partial] and events[1].ref_counts == [1]

    assert bm.prepare_write(2, len(tokens) + 1) is None  # already private
    assert bm.prepare_write(1, len(tokens)) is None  # parent keeps the source, now exclusive
    bm.check_invariants()


def test_fork_of_a_prefix_shares_only_its_blocks():
    bm, _ = make()
    tokens = list(range(2 * BS + 2))  # two full blocks + a partial one
    run_prompt(bm, 1, tokens)
    full0, full1, partial = bm.block_table(1)
    bm.fork(1, 2, num_tokens=BS + 1)  # diverges inside the second block
    assert bm.block_table(2) == [full0, full1] and refs(bm, [full0, full1, partial]) == [2, 2, 1]
    src, dst = bm.prepare_write(2, BS + 1)  # the child's first own token copies the shared block
    assert src == full1 and bm.block_table(2) == [full0, dst]
    bm.fork(1, 3, num_tokens=BS)  # at a block boundary: nothing to copy
    assert bm.block_table(3) == [full0] and bm.prepare_write(3, BS) is None
    bm.fork(1, 4, num_tokens=0)
    assert bm.block_table(4) == []
    bm.check_invariants()


def test_prefix_fork_never_overwrites_a_cached_block_in_place():
    """The parent is gone before the child writes inside the last block they shared: the block is
    the child's alone but still holds the parent's cached tokens, so it is copied, not overwritten."""
    bm, _ = make()
    tokens = list(range(2 * BS + 1))
    run_prompt(bm, 1, tokens)
    full0, full1, _ = bm.block_table(1)
    bm.fork(1, 2, num_tokens=BS + 1)
    bm.free_seq(1)
    assert refs(bm, [full0, full1]) == [1, 1]
    src, dst = bm.prepare_write(2, BS + 1)
    assert src == full1 and bm.block_table(2) == [full0, dst]
    assert bm.find_cached_prefix(tokens) == [full0, full1]  # the parent's blocks are still valid hits
    bm.check_invariants()


def test_full_shared_blocks_never_copied():
    bm, _ = make()
    tokens = list(range(2 * BS))  # exactly two full blocks
    run_prompt(bm, 1, tokens)
    bm.fork(1, 2)
    assert bm.ensure_capacity(2, 2 * BS + 1)  # the next token needs a fresh block, not a copy
    assert bm.prepare_write(2, 2 * BS) is None
    table1, table2 = bm.block_table(1), bm.block_table(2)
    assert table2[:2] == table1 and refs(bm, table1) == [2, 2]
    bm.check_invariants()


def test_copy_on_write_without_free_block_raises():
    bm, _ = make(num_blocks=1)
    bm.allocate_seq(1, "a", [1])
    assert bm.ensure_capacity(1, 1)
    bm.fork(1, 2)
    with pytest.raises(NoFreeBlocksError):
        bm.prepare_write(2, 1)
    bm.check_invariants()


def test_events_for_representative_scenario():
    bm, events = make()
    prompt = list(range(BS)) + [50, 51]
    run_prompt(bm, 1, prompt, owner="req-a")
    assert [(e.kind, e.owner, e.seq_id, e.ref_counts) for e in events] == [
        ("allocated", "req-a", 1, [1, 1]),
        ("cached", "req-a", 1, [1]),
    ]
    first = bm.block_table(1)[0]
    assert events[1].block_ids == [first] and events[1].block_hashes == [bm.blocks[first].block_hash]

    events.clear()
    assert run_prompt(bm, 2, prompt[:BS] + [60], owner="req-b") == BS
    shared, allocated = events
    assert (shared.kind, shared.owner, shared.block_ids, shared.ref_counts, shared.prefix_hit) == (
        "shared",
        "req-b",
        [first],
        [2],
        True,
    )
    assert (allocated.kind, allocated.owner, allocated.ref_counts) == ("allocated", "req-b", [1])

    events.clear()
    bm.fork(1, 3, owner="req-a")
    assert (events[0].kind, events[0].prefix_hit, events[0].ref_counts) == ("shared", False, [3, 2])

    events.clear()
    bm.free_seq(1)
    assert [(e.kind, e.owner, e.ref_counts) for e in events] == [("released", "req-a", [1, 2])]
    assert events[0].block_ids == list(reversed(bm.block_table(3)))

    events.clear()
    bm.free_seq(3)
    bm.free_seq(2)
    kinds = [(e.kind, e.owner, e.ref_counts) for e in events]
    assert kinds == [("freed", "req-a", [0]), ("released", "req-a", [1]), ("freed", "req-b", [0, 0])]
    bm.check_invariants()


def test_reset_prefix_cache():
    bm, events = make()
    run_prompt(bm, 1, list(range(2 * BS + 1)))
    bm.free_seq(1)
    run_prompt(bm, 2, [7] * (BS + 1))
    assert bm.num_cached_free_blocks == 2
    events.clear()
    bm.enable_prefix_caching = False
    bm.reset_prefix_cache()
    bm.check_invariants()
    assert bm.num_cached_free_blocks == 0 and bm.num_free_blocks == 6
    assert [e.kind for e in events] == ["evicted"] and len(events[0].block_ids) == 2
    bm.enable_prefix_caching = True
    assert bm.find_cached_prefix(list(range(2 * BS + 1))) == []
    bm.free_seq(2)  # its hashed block is no longer reachable, so it is freed uncached
    assert bm.num_cached_free_blocks == 0
    bm.check_invariants()


def test_snapshot_shape():
    bm, _ = make()
    run_prompt(bm, 1, list(range(BS + 1)))
    snap = bm.snapshot()
    assert snap["tables"] == {1: bm.block_table(1)}
    b0 = snap["blocks"][bm.block_table(1)[0]]
    assert b0["ref_count"] == 1 and b0["num_tokens"] == BS and b0["block_hash"] is not None
    assert snap["blocks"][bm.block_table(1)[1]]["num_tokens"] == 0


def test_check_invariants_detects_corruption():
    bm, _ = make()
    run_prompt(bm, 1, list(range(5)))
    bm.blocks[bm.block_table(1)[0]].ref_count += 1
    with pytest.raises(AssertionError, match="ref_count"):
        bm.check_invariants()


# --------------------------------------------------------------------------- property-based test


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives the manager like an engine would, against a model of the KV *content*.

    ``kv[block][slot]`` is what a kernel would have written; it is never cleared on reuse, so a
    wrongly shared/reused block shows up as a content mismatch. Ref counts reported by events
    are replayed into ``event_refs`` and must match the real ones after every operation.
    """

    @initialize(block_size=st.integers(2, 4), num_blocks=st.integers(4, 8))
    def setup(self, block_size, num_blocks):
        self.event_refs = [0] * num_blocks
        self.bm = BlockManager(num_blocks, block_size)
        self.kv = [[None] * block_size for _ in range(num_blocks)]
        self.seqs: dict[int, tuple[list[int], int]] = {}  # seq_id -> (tokens, num_computed)
        self.next_id = 0

    def on_event(self, e: BlockEvent) -> None:
        assert len(e.block_ids) == len(e.ref_counts)
        for b, r in zip(e.block_ids, e.ref_counts):
            self.event_refs[b] = r

    # Prompts often start with a common stem so that prefix hits (and collisions of chains) happen.
    @rule(stem=st.sampled_from([(), (0,) * 6, (0, 1) * 3]), tail=st.lists(st.integers(0, 1), max_size=6))
    def allocate(self, stem, tail):
        tokens = list(stem) + tail
        sid, self.next_id = self.next_id, self.next_id + 1
        computed = self.bm.allocate_seq(sid, f"r{sid}", tokens)
        bs = self.bm.block_size
        assert computed % bs == 0 and computed <= max(0, len(tokens) - 1)
        self.seqs[sid] = (list(tokens), computed)

    def advance(self, sid: int, chunk: int, new_token: int) -> None:
        """One engine step for ``sid``: compute up to ``chunk`` tokens, writing their KV."""
        tokens, computed = self.seqs[sid]
        if computed == len(tokens):
            tokens.append(new_token)  # decode: the token sampled last step becomes input
        target = min(len(tokens), computed + chunk)
        if not self.bm.ensure_capacity(sid, target):
            return  # the engine would preempt or wait; nothing changed
        bs = self.bm.block_size
        for pos in range(computed, target):
            try:
                cow = self.bm.prepare_write(sid, pos)
            except NoFreeBlocksError:
                target = pos
                break
            if cow:
                self.kv[cow[1]] = list(self.kv[cow[0]])
            table = self.bm.block_table(sid)
            self.kv[table[pos // bs]][pos % bs] = tuple(tokens[: pos + 1])  # KV depends on the whole prefix
        self.seqs[sid] = (tokens, target)
        self.bm.commit_full_blocks(sid, tokens, target)
        if self.bm.enable_prefix_caching:  # liveness: every completed block got its hash
            table = self.bm.block_table(sid)
            assert all(self.bm.blocks[b].block_hash is not None for b in table[: target // bs])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), chunk=st.integers(1, 6), new_token=st.integers(0, 1))
    def step(self, data, chunk, new_token):
        self.advance(data.draw(st.sampled_from(sorted(self.seqs))), chunk, new_token)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), diverge=st.booleans(), prefix_only=st.booleans())
    def fork(self, data, diverge, prefix_only):
        """A plain fork (n > 1, beams), or a fork of the first ``at`` computed tokens only (the
        followers of a request resuming after preemption)."""
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        sid, self.next_id = self.next_id, self.next_id + 1
        tokens, computed = self.seqs[parent]
        at = data.draw(st.integers(0, computed)) if prefix_only else None
        self.bm.fork(parent, sid, num_tokens=at)
        self.seqs[sid] = (list(tokens if at is None else tokens[:at]), computed if at is None else at)
        if diverge:  # parallel sampling: both continue with different tokens -> copy-on-write
            self.advance(sid, 1, 0)
            self.advance(parent, 1, 1)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.free_seq(sid)
        del self.seqs[sid]

    @rule()
    def toggle_caching(self):
        self.bm.enable_prefix_caching = not self.bm.enable_prefix_caching
        if not self.bm.enable_prefix_caching:
            self.bm.reset_prefix_cache()

    @invariant()
    def consistent(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants()
        for event in self.bm.take_events():
            self.on_event(event)
        assert self.event_refs == [b.ref_count for b in self.bm.blocks], "events missed a ref change"
        bs = self.bm.block_size
        for sid, (tokens, computed) in self.seqs.items():
            table = self.bm.block_table(sid)
            assert len(table) * bs >= computed
            for p in range(computed):
                got = self.kv[table[p // bs]][p % bs]
                assert got == tuple(tokens[: p + 1]), (
                    f"seq {sid} pos {p}: KV of {got}, expected {tuple(tokens[: p + 1])}"
                )

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for sid in list(self.seqs):
            self.bm.free_seq(sid)
        self.bm.check_invariants()
        assert all(b.ref_count == 0 for b in self.bm.blocks)
        assert self.bm.num_free_blocks == self.bm.num_blocks and self.bm.usage() == 0.0


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_block_manager_state_machine = BlockManagerMachine.TestCase
