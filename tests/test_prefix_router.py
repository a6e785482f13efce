"""The replica router (core/prefix_router.py): longest matched prefix, least loaded otherwise, the
LRU bound, and hashes that are the scheduler's own."""

import sys

import pytest

from minivllm.core.block_manager import hash_block_tokens
from minivllm.core.prefix_router import PrefixRouter, prompt_block_hashes
from minivllm.core.request import Request, Sequence
from minivllm.sampling.params import SamplingParams

BS = 4


def hashes(*tokens: int) -> list[int]:
    return prompt_block_hashes(list(tokens), BS)


def test_hashes_are_the_scheduler_chain():
    ids = list(range(11))
    assert prompt_block_hashes(ids, BS) == [
        (h0 := hash_block_tokens(None, (0, 1, 2, 3))),
        hash_block_tokens(h0, (4, 5, 6, 7)),
    ]
    for salt in (None, "tenant-a"):
        request = Request("r", None, ids, SamplingParams(), arrival_time=0.0, cache_salt=salt)
        assert prompt_block_hashes(ids, BS, salt) == Sequence(request, list(ids), len(ids)).block_hashes(BS)
    assert prompt_block_hashes(ids, BS, "a") != prompt_block_hashes(ids, BS, "b")
    assert prompt_block_hashes([1, 2, 3], BS) == []  # no full block


def test_routes_to_the_replica_with_the_longest_matched_prefix():
    router = PrefixRouter(3)
    short, long = hashes(*range(8)), hashes(*range(16))
    router.route("a", short[:1], [0, 0, 0])  # replica 0 (least loaded, lowest index)
    router.replicas[1].blocks.update(dict.fromkeys(long))  # as if replica 1 had served it
    decision = router.route("c", long, [0, 5, 0])  # 1 holds 4 blocks of it, 0 one: 1 wins despite its load
    assert (decision.replica, decision.matched_blocks, decision.reason) == (1, 4, "prefix")
    assert router.route("d", short, [0, 0, 0]).replica == 1  # both hold block 0; only 1 holds block 1


def test_a_prefix_match_stops_at_the_first_missing_block():
    router = PrefixRouter(2)
    chain = hashes(*range(12))
    router.replicas[1].blocks.update({chain[1]: None, chain[2]: None})  # later blocks without the first
    decision = router.route("a", chain, [0, 1])
    assert decision.reason == "least_loaded" and decision.replica == 0


def test_falls_back_to_the_least_loaded_replica_then_to_the_one_holding_fewest_blocks():
    router = PrefixRouter(3)
    assert router.route("a", hashes(1, 2, 3, 4), [2, 0, 1]).replica == 1
    decision = router.route("b", hashes(9, 9, 9, 9), [0, 0, 0])
    assert (decision.replica, decision.reason) == (0, "least_loaded")  # 0 and 2 hold none; 0 first
    assert router.route("c", hashes(8, 8, 8, 8, 7, 7, 7, 7), [0, 0, 0]).replica == 2
    assert router.route("d", hashes(6, 6, 6, 6), [0, 0, 0]).replica == 0  # 0 and 1 hold one block, 2 two


def test_the_lru_bound_forgets_the_oldest_blocks():
    router = PrefixRouter(2, max_blocks=4)
    old, new = hashes(*range(8)), hashes(*range(100, 116))  # 2 blocks, then 4 more
    router.route("a", old, [0, 0])
    router.route("b", new, [0, 1])  # replica 0 again: least loaded
    held = router.replicas[0].blocks
    assert len(held) == 4 and list(held) == new and router.matched(0, old) == 0
    router.route("c", new[:1], [0, 0])  # touching a block makes it the newest
    assert list(held)[-1] == new[0]


def test_dead_replicas_get_nothing_and_round_robin_takes_turns():
    router = PrefixRouter(2)
    chain = hashes(*range(8))
    router.route("a", chain, [0, 0])
    router.mark_dead(0)
    assert router.route("b", chain, [0, 0]).replica == 1
    router.mark_dead(1)
    with pytest.raises(RuntimeError, match="no live replica"):
        router.route("c", chain, [0, 0])
    turns = PrefixRouter(3, policy="round_robin")
    assert [turns.route(str(i), chain, [0, 0, 0]).replica for i in range(4)] == [0, 1, 2, 0]
    assert turns.decisions[-1].reason == "round_robin" and turns.decisions[-1].matched_blocks == 2


def test_hit_rate_and_decision_history():
    router = PrefixRouter(2, history=3)
    chain = hashes(*range(8))
    for i in range(5):
        router.route(str(i), chain, [0, 0])
    routes = router.replicas[0]
    assert (routes.routed, routes.hit_rate) == (5, 8 / 10)  # every block but the first request's
    assert [d.request_id for d in router.decisions] == ["2", "3", "4"]


@pytest.mark.parametrize(("args", "message"), [((0,), "at least 1"), ((2, 10, "random"), "policy must be one of")])
def test_bad_settings_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        PrefixRouter(*args)


def test_replicas_without_ray_fail_at_once_with_how_to_install_it(monkeypatch, capsys):
    from minivllm.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert main(["serve", "--data-parallel-size", "2"]) == 2
    assert "pip install 'minivllm[ray]'" in capsys.readouterr().err
