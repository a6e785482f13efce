"""Who moves progress, and what the pieces around it report: the scheduler plans on values and
advances `num_computed` only in `update_from_output`; sequences keep their block hashes; the block
manager queues events that carry the table as it was; outputs are deltas that fold back whole."""

from __future__ import annotations

import pytest

from minivllm.core import block_manager as block_manager_mod
from minivllm.core import request as request_mod
from minivllm.core.block_manager import BlockManager, hash_block_tokens
from minivllm.core.request import Request, RequestStatus, Sequence
from minivllm.core.scheduler import Scheduler, SchedulerConfig
from minivllm.engine.outputs import CompletionOutput, OutputAccumulator, RequestMetrics, RequestOutput
from minivllm.sampling.params import SamplingParams

BS = 4


def new_request(rid: str, prompt: list[int], arrival: float = 0.0, n: int = 1) -> Request:
    request = Request(rid, None, prompt, SamplingParams(n=n, max_tokens=8), arrival)
    request.seqs.append(Sequence(request, list(prompt), len(prompt)))
    return request


def scheduler(num_blocks: int, budget: int = 64) -> Scheduler:
    statuses = []

    def set_status(request, status, reason, *_):
        request.status = status
        statuses.append((request.request_id, status))

    return Scheduler(SchedulerConfig(budget, 8, 256), BlockManager(num_blocks, BS), set_status)


# ---- progress ---------------------------------------------------------------------------------


def test_progress_moves_only_in_update_from_output():
    sched = scheduler(num_blocks=16, budget=6)
    request = new_request("a", list(range(10, 23)))  # 13 tokens: chunks of 6, 6, 1
    sched.add(request)
    seq, done = request.seqs[0], 0
    while done < seq.num_tokens:
        plan = sched.schedule()
        (chunk,) = plan.scheduled
        assert chunk.start == seq.num_computed == done, "scheduling must not move progress"
        sched.update_from_output(plan)
        done += chunk.num_tokens
        assert seq.num_computed == done
    assert plan.sampled() == [(chunk, 0)] and chunk.completes


def test_a_refused_admission_leaves_the_request_as_it_was():
    sched = scheduler(num_blocks=4)
    running = new_request("running", list(range(100, 111)))  # 11 tokens: 3 of the 4 blocks
    sched.add(running)
    sched.update_from_output(sched.schedule())
    # a resuming request with two samples whose common prefix lies beyond the cached part:
    # admission would have to plan a re-fork; the pool cannot hold it
    waiting = new_request("waiting", list(range(200, 209)), arrival=1.0)
    waiting.seqs.append(Sequence(waiting, list(range(200, 209)) + [7], 9, sample_index=1))
    waiting.seqs[0].token_ids.append(5)
    waiting.status = RequestStatus.PREEMPTED
    sched.add(waiting)
    plan = sched.schedule()
    assert plan.queue_head is waiting and "out of KV blocks" in plan.queue_head_reason
    assert [s.num_computed for s in waiting.seqs] == [0, 0] and waiting.refork_at is None
    assert not any(sched.bm.has_seq(s.seq_id) for s in waiting.seqs)


def test_admission_reads_the_sequences_block_hashes_instead_of_rehashing(monkeypatch):
    calls = []
    counting = lambda parent, tokens: calls.append(tokens) or hash_block_tokens(parent, tokens)  # noqa: E731
    monkeypatch.setattr(request_mod, "hash_block_tokens", counting)
    monkeypatch.setattr(block_manager_mod, "hash_block_tokens", counting)
    sched = scheduler(num_blocks=5)
    sched.add(new_request("big", list(range(100, 117))))  # 17 tokens: all 5 blocks
    sched.update_from_output(sched.schedule())
    calls.clear()
    head = new_request("head", list(range(300, 321)), arrival=1.0)  # 21 tokens: 5 full blocks
    sched.add(head)
    for _ in range(10):  # the queue head is tried every step
        assert sched.schedule().queue_head is head
    assert len(calls) == 5, f"{len(calls)} blocks hashed for 5 blocks over 10 admission attempts"


def test_sequence_block_hashes_chain_and_carry_over_to_a_fork():
    request = new_request("a", list(range(1, 11)))
    seq = request.seqs[0]
    expected, parent = [], None
    for i in range(2):
        parent = hash_block_tokens(parent, tuple(range(1 + i * BS, 1 + (i + 1) * BS)))
        expected.append(parent)
    assert seq.block_hashes(BS) == expected  # 10 tokens: two full blocks
    seq.token_ids += [11, 12]
    assert seq.block_hashes(BS)[:2] == expected and len(seq.block_hashes(BS)) == 3
    child = Sequence(request, list(seq.token_ids), 10)
    child.inherit_block_hashes(seq)
    assert child.block_hashes(BS) == seq.block_hashes(BS)
    bm = BlockManager(8, BS)
    assert bm.find_cached_prefix(seq.token_ids, seq.block_hashes(BS)) == bm.find_cached_prefix(seq.token_ids)


# ---- block events -------------------------------------------------------------------------------


def test_block_events_carry_the_table_as_it_was_and_are_taken_once():
    bm = BlockManager(6, BS)
    bm.allocate_seq(1, "a", [1, 2, 3])
    assert bm.ensure_capacity(1, 9)
    bm.fork(1, 2, "a")
    bm.free_seq(1)
    events = bm.take_events()
    assert bm.take_events() == [], "events are handed out once"
    allocated, shared, released = events
    assert (allocated.kind, allocated.table, allocated.seq_released) == ("allocated", [0, 1, 2], False)
    assert (shared.kind, shared.seq_id, shared.table) == ("shared", 2, [0, 1, 2])
    assert (released.kind, released.seq_id, released.table, released.seq_released) == ("released", 1, [], True)


def test_evictions_report_the_hashes_that_left_the_cache():
    bm = BlockManager(2, BS)
    bm.allocate_seq(1, "a", [1, 2, 3, 4, 5])
    assert bm.ensure_capacity(1, 5)
    bm.commit_full_blocks(1, [1, 2, 3, 4, 5], 4)
    cached = bm.blocks[bm.block_table(1)[0]].block_hash
    bm.free_seq(1)
    bm.allocate_seq(2, "b", [9, 9, 9, 9, 9, 9, 9, 9, 9])
    bm.take_events()
    assert bm.ensure_capacity(2, 8)  # needs both blocks: the cached one is evicted
    evicted = [e for e in bm.take_events() if e.kind == "evicted"]
    assert [e.block_hashes for e in evicted] == [[cached]]


# ---- outputs --------------------------------------------------------------------------------------


def delta(
    index: int, text: str, tokens: list[int], num_tokens: int, finish: str | None = None, logprobs: list | None = None
) -> CompletionOutput:
    return CompletionOutput(index, text, tokens, -1.0, logprobs, finish, None, num_tokens)


def output(*outputs: CompletionOutput, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], list(outputs), finished, RequestMetrics(arrival_time=0.0))


def test_deltas_fold_back_into_the_whole_output():
    fold = OutputAccumulator()
    first = fold.add(output(delta(0, "Hel", [5], 1, logprobs=[{5: -0.1}])))
    assert first.outputs[0].text == "Hel"
    fold.add(output(delta(0, "lo", [6], 2, logprobs=[{6: -0.2}]), delta(1, "Hi", [7, 8], 2)))  # a sample forks
    final = fold.add(output(delta(1, "!", [9], 3, finish="stop"), delta(0, "", [], 2, finish="length"), finished=True))
    a, b = final.outputs
    assert (a.index, a.text, a.token_ids, a.logprobs, a.finish_reason) == (
        0,
        "Hello",
        [5, 6],
        [{5: -0.1}, {6: -0.2}],
        "length",
    )
    assert (b.index, b.text, b.token_ids, b.finish_reason) == (1, "Hi!", [7, 8, 9], "stop")
    assert final.finished and final.num_generated_tokens == 5
    again = fold.add(output(delta(0, "x", [1], 1)))
    assert again.outputs[0].text == "x", "a finished request is forgotten: its id starts afresh"


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_the_first_delta_is_copied_not_kept(with_logprobs):
    fold = OutputAccumulator()
    first = output(delta(0, "a", [1], 1, logprobs=[{1: -1.0}] if with_logprobs else None))
    fold.add(first)
    fold.add(output(delta(0, "b", [2], 2, logprobs=[{2: -1.0}] if with_logprobs else None)))
    assert first.outputs[0].token_ids == [1], "the engine's delta must not grow"
