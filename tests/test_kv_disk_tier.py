"""The prefix cache's disk tier: the store alone (round trip, restart, corruption, a full disk, LRU bound),
the block manager's part (stable hashes, installing a restored block, evictions handed over), and the
engine: evicted prefixes and a restarted engine's prompts come back from disk with identical tokens."""

from __future__ import annotations

import errno
import subprocess
import sys

import pytest
import torch

from engine_utils import chat_ids, compare, make_engine, run
from minivllm.core.block_manager import BlockManager, hash_block_tokens, hash_salt
from minivllm.engine import kv_disk_store
from minivllm.engine.kv_disk_store import DiskKVStore
from minivllm.events import types as ev
from minivllm.events.fold import fold
from minivllm.sampling.params import SamplingParams

TOKENS = tuple(range(100, 116))


def _block(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"k": torch.randn(2, 16, 2, 8, generator=g).half(), "v": torch.randn(2, 16, 2, 8, generator=g).half()}


def _store(tmp_path, max_bytes: int = 1 << 30) -> DiskKVStore:
    return DiskKVStore(tmp_path, "ns", max_bytes)


def _equal(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor]) -> bool:
    return a is not None and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


# ---- the store ---------------------------------------------------------------------------------------


def test_store_round_trip_and_restart(tmp_path):
    block = _block(0)
    store = _store(tmp_path)
    store.put(7, TOKENS, block)
    assert _equal(store.get(7, TOKENS), block)  # served while (or after) the writer runs
    store.flush()
    assert store.stats.writes == 1 and store.stats.files == 1
    reopened = _store(tmp_path)  # a restart: the index comes from the directory
    assert 7 in reopened and _equal(reopened.get(7, TOKENS), block)
    assert reopened.get(7, TOKENS[:-1] + (0,)) is None  # the same hash naming other tokens: a miss


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_a_damaged_file_is_a_miss_and_is_removed(tmp_path, damage):
    store = _store(tmp_path)
    store.put(9, TOKENS, _block(1))
    store.flush()
    path = store._path(9)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-5] ^= 0x40  # inside the tensor bytes: only the checksum can tell
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray(b"not a safetensors file at all")
    path.write_bytes(bytes(data))
    reopened = _store(tmp_path)
    assert reopened.get(9, TOKENS) is None
    assert reopened.stats.corrupt == 1 and not path.exists() and 9 not in reopened


def test_a_full_disk_loses_the_write_not_the_store(tmp_path, monkeypatch, caplog):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    store = _store(tmp_path)
    monkeypatch.setattr(kv_disk_store, "save_tensors", no_space)
    store.put(1, TOKENS, _block(2))
    store.flush()
    assert store.stats.write_errors == 1 and 1 not in store
    assert "No space left" in caplog.text
    assert not list(store.dir.glob("*.tmp"))
    monkeypatch.undo()
    store.put(2, TOKENS, _block(3))  # space again: writes resume
    store.flush()
    assert 2 in store and store.stats.writes == 1


def test_size_bound_drops_least_recently_used(tmp_path):
    store = _store(tmp_path)
    store.put(1, TOKENS, _block(1))
    store.flush()
    size = store.stats.bytes_on_disk
    store = _store(tmp_path, max_bytes=2 * size)
    store.put(2, TOKENS, _block(2))
    store.flush()
    assert store.get(1, TOKENS) is not None  # 1 is now the most recently used
    store.put(3, TOKENS, _block(3))
    store.flush()
    assert 1 in store and 3 in store and 2 not in store
    assert store.stats.evicted_files == 1 and store.stats.bytes_on_disk <= 2 * size


# ---- the block manager's part ----------------------------------------------------------------------


def test_block_hashes_are_the_same_in_every_process():
    """The disk tier names files by these hashes: a restarted process must compute the same ones."""
    code = (
        "from minivllm.core.block_manager import hash_block_tokens as h, hash_salt as s;"
        "print(h(None, tuple(range(16))), h(s('tenant'), (1, 2, 3)))"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert other == [
        str(hash_block_tokens(None, tuple(range(16)))),
        str(hash_block_tokens(hash_salt("tenant"), (1, 2, 3))),
    ]


def test_install_cached_block_is_a_prefix_hit_and_evictions_are_handed_over():
    bm = BlockManager(num_blocks=2, block_size=4, track_evictions=True)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    h0 = hash_block_tokens(None, (1, 2, 3, 4))
    bid = bm.install_cached(h0, (1, 2, 3, 4))
    bm.check_invariants()
    assert bm.find_cached_prefix(tokens) == [bid] and bm.num_cached_free_blocks == 1
    with pytest.raises(ValueError, match="already cached"):
        bm.install_cached(h0, (1, 2, 3, 4))
    other = bm.install_cached(hash_block_tokens(None, (9, 9, 9, 9)), (9, 9, 9, 9))
    assert bm.take_evicted() == []  # a free uncached block was there: nothing lost
    bm.allocate_seq(1, "r", [5, 5, 5, 5])
    assert bm.ensure_capacity(1, 4)  # one block: the LRU cached one, the first installed
    (evicted,) = bm.take_evicted()
    assert (evicted.block_id, evicted.block_hash, evicted.token_ids) == (bid, h0, (1, 2, 3, 4))
    assert bm.find_cached_prefix(tokens) == [] and bm.is_cached(other)
    bm.check_invariants()


# ---- the engine ----------------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompt(seed: int, length: int = 96) -> list[int]:
    return torch.randint(5, 2000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(engine, prompt: list[int], request_id: str) -> list[int]:
    engine.add_request(request_id, prompt_token_ids=prompt, params=GREEDY)
    return list(run(engine)[request_id].outputs[0].token_ids)


def test_engine_reads_evicted_prefixes_back_from_disk(tiny_model, tmp_path):
    engine = make_engine(tiny_model, num_blocks=8, block_size=16, kv_offload_dir=str(tmp_path))
    start = engine.snapshot()
    first = _generate(engine, _prompt(0), "a")
    for other in (1, 2):  # other prompts take over the whole pool: every block of "a" is evicted
        _generate(engine, _prompt(other), f"other-{other}")
    engine.disk_tier.store.flush()
    assert engine.disk_tier.store.stats.files >= 5
    hits_before = engine.stats().prefix_cache_hits
    assert _generate(engine, _prompt(0), "a-again") == first
    assert engine.disk_tier.store.stats.hits == 5  # (96 - 1) // 16 full blocks, never the last token's
    tier = engine.stats().disk_tier
    assert tier.blocks_read == 5 and tier.blocks_written >= 5 and tier.files == tier.blocks_written
    assert engine.stats().prefix_cache_hits - hits_before == 5 * 16
    engine.block_manager.check_invariants()
    engine.telemetry.flush_block_events()
    events = [e for e in engine.bus.history if e.seq > start.seq]
    evicted = [e for e in events if isinstance(e, ev.BlocksEvicted)]
    restored = [e for e in events if isinstance(e, ev.BlocksCached) and e.from_disk]
    assert evicted and all(e.to_disk for e in evicted)
    assert sum(len(e.block_ids) for e in restored) == 5 and all(e.seq_id == -1 for e in restored)
    compare(fold(start, events), engine.snapshot())  # the dashboard's fold follows restored blocks too


def test_a_restarted_engine_reuses_prompts_and_survives_damage(tiny_model, tmp_path):
    prompt = _prompt(2, 80)
    cold = make_engine(tiny_model, kv_offload_dir=str(tmp_path))
    first = _generate(cold, prompt, "a")
    cold.close()  # what RAM held is on disk now
    warm = make_engine(tiny_model, kv_offload_dir=str(tmp_path))
    assert _generate(warm, prompt, "a") == first
    assert warm.disk_tier.store.stats.hits == (80 - 1) // 16 and warm.stats().prefix_cache_hits == 64
    damaged = sorted(warm.disk_tier.store.dir.glob("*.kvblock"))
    for path in damaged:
        path.write_bytes(path.read_bytes()[:-3] + b"xyz")
    again = make_engine(tiny_model, kv_offload_dir=str(tmp_path))
    assert _generate(again, prompt, "a") == first  # every file fails its checksum: recomputed, same tokens
    assert again.disk_tier.store.stats.hits == 0 and again.disk_tier.store.stats.corrupt >= 1


def test_a_full_disk_never_reaches_the_requests(tiny_model, tmp_path, monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kv_disk_store, "save_tensors", no_space)
    engine = make_engine(tiny_model, num_blocks=8, kv_offload_dir=str(tmp_path))
    reference = make_engine(tiny_model, num_blocks=8)
    for i in range(3):
        assert _generate(engine, _prompt(i), f"r{i}") == _generate(reference, _prompt(i), f"r{i}")
    engine.close()
    assert engine.disk_tier.store.stats.write_errors > 0 and engine.disk_tier.store.stats.files == 0


def _preempting_run(model, **config) -> tuple:
    """Four long generations on a pool that holds two: preemptions, then resumes."""
    engine = make_engine(model, num_blocks=14, block_size=16, **config)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", prompt_token_ids=_prompt(10 + i, 60), params=params)
    outputs = {rid: list(out.outputs[0].token_ids) for rid, out in run(engine).items()}
    return engine, outputs


def test_preempted_requests_swap_back_in_from_disk_with_identical_tokens(tiny_model, tmp_path):
    recomputed, reference = _preempting_run(tiny_model)
    swapped, outputs = _preempting_run(tiny_model, kv_offload_dir=str(tmp_path))
    assert recomputed.scheduler.num_preemptions > 0 and swapped.scheduler.num_preemptions > 0
    assert outputs == reference
    assert swapped.disk_tier.cost.restored > 0  # resumed requests read their blocks back
    # the timeline's segments say so: swapped out at preemption, read back at admission
    states = [e for e in swapped.bus.history if isinstance(e, ev.RequestStateChanged)]
    assert any(e.state == "PREEMPTED" and "disk tier" in e.reason for e in states)
    assert any(e.state == "PREFILL" and "read back from disk" in e.reason for e in states)
    assert not any("disk" in e.reason for e in recomputed.bus.history if isinstance(e, ev.RequestStateChanged))


def test_recomputation_wins_where_it_is_measured_cheaper(tiny_model, tmp_path):
    engine = make_engine(tiny_model, num_blocks=14, block_size=16, kv_offload_dir=str(tmp_path))
    engine.disk_tier.cost.read_s_per_block = 1.0  # as if the disk took a second a block
    engine.disk_tier.cost.compute_s_per_token = 1e-5
    first = _generate(engine, _prompt(20), "a")
    for other in (21, 22):
        _generate(engine, _prompt(other), f"other-{other}")
    engine.disk_tier.store.flush()
    assert _generate(engine, _prompt(20), "again") == first
    assert engine.disk_tier.cost.restored == 0 and engine.disk_tier.cost.recomputed > 0
    assert engine.disk_tier.store.stats.hits == 0


def test_salted_requests_never_read_each_others_blocks(tiny_model, tmp_path):
    engine = make_engine(tiny_model, kv_offload_dir=str(tmp_path))
    engine.add_request("a", prompt_token_ids=_prompt(3), params=GREEDY, cache_salt="tenant-a")
    run(engine)
    engine.close()
    restarted = make_engine(tiny_model, kv_offload_dir=str(tmp_path))
    restarted.add_request("b", prompt_token_ids=_prompt(3), params=GREEDY, cache_salt="tenant-b")
    run(restarted)
    assert restarted.disk_tier.store.stats.hits == 0 and restarted.stats().prefix_cache_hits == 0


def test_offload_needs_prefix_caching(tiny_model, tmp_path):
    from minivllm.errors import ConfigError

    with pytest.raises(ConfigError, match="prefix caching"):
        make_engine(tiny_model, kv_offload_dir=str(tmp_path), enable_prefix_caching=False)


def test_embedded_model_restart_serves_a_long_chat_prompt_from_disk(embedded_model_q4, embedded_tokenizer, tmp_path):
    """The default precision (4-bit weights, fp16 pool, the native decode step): a restarted engine's
    greedy tokens equal the cold engine's, with every full prompt block read from disk."""
    question = "Summarise the plot of a long novel about a lighthouse keeper. " * 12
    prompt = chat_ids(embedded_tokenizer, question, system="You are a careful, concise assistant.")
    cold = make_engine(embedded_model_q4, kv_offload_dir=str(tmp_path))
    first = _generate(cold, prompt, "cold")
    cold.close()
    warm = make_engine(embedded_model_q4, kv_offload_dir=str(tmp_path))
    assert _generate(warm, prompt, "warm") == first
    assert warm.disk_tier.store.stats.hits == (len(prompt) - 1) // 16


def test_bench_kv_prints_each_tier_with_identical_tokens(tiny_model, tmp_path, capsys):
    import argparse

    from minivllm.bench.kv_tiers import bench_kv

    engine = make_engine(tiny_model, num_blocks=None, kv_cache_memory="64MiB")
    args = argparse.Namespace(output_dir=str(tmp_path), quick=True, prompt_tokens=80, rounds=1, kv_offload_dir=None)
    assert bench_kv(engine, args) == 0
    out = capsys.readouterr().out
    for tier in ("cold", "RAM prefix hit", "disk hit", "after restart"):
        assert any(line.strip().startswith(tier) and "identical to cold" in line for line in out.splitlines()), tier
    swap = [line for line in out.splitlines() if line.strip().startswith(("recompute", "disk tier (swap)"))]
    assert len(swap) == 2 and all(line.endswith("identical") for line in swap)
    assert int(swap[0].split()[2]) > 0  # the tight pool did preempt
    assert "tokens per GiB" in out and (tmp_path / "kv_tiers.png").stat().st_size > 0
