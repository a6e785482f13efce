"""The shared-memory collectives of tensor-parallel ranks on one machine (kernels/cpu/shm_collectives.cpp,
model/tensor_parallel.py): sums and gathers against the plain arithmetic, across the chunk edge, on every
rank the same bits, many generations in a row, and a peer that has exited named instead of a hang."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from minivllm.kernels.cpu import native
from minivllm.model import tensor_parallel
from minivllm.model.tensor_parallel import SEGMENT_SLOT_BYTES, TPGroup

pytestmark = pytest.mark.skipif(native.available() is not None, reason=f"native kernels: {native.available()}")

WORLD = 3  # more ranks than the 2 the engine tests run: the sum's order and the slots' layout matter
SLOT_FLOATS = SEGMENT_SLOT_BYTES // 4
SIZES = (1, 7, 4096, SLOT_FLOATS, SLOT_FLOATS + 5, 2 * SLOT_FLOATS + 100)  # one chunk, at the edge, several


def rank_input(rank: int, size: int, round_: int) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(1000 * round_ + 10 * rank + size % 7))


def _rank_main(rank: int, segment: str, results) -> None:
    """Each rank checks its own results against the arithmetic (the same bits on every rank) and reports
    (size, sum right, gather right) per round: tensors through a queue outlive their sender poorly."""
    tp = TPGroup(rank, WORLD, shm=tensor_parallel.map_segment(segment, rank, WORLD))
    report = []
    for round_, size in enumerate(SIZES * 2):  # twice: both slots of every chunk reused
        inputs = [rank_input(r, size, round_) for r in range(WORLD)]
        summed = tp.all_reduce(inputs[rank].clone())
        gathered = tp.all_gather(inputs[rank].view(-1, 1))
        expected = inputs[0] + inputs[1] + inputs[2]  # rank order, as every rank sums
        whole = torch.equal(torch.cat(gathered, 1), torch.stack(inputs, 1))
        report.append((size, torch.equal(summed, expected), whole))
    results.put((rank, report))


def test_every_rank_gets_the_sum_and_the_gather_in_rank_order():
    segment = tensor_parallel.create_segment(WORLD)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=_rank_main, args=(r, segment, results)) for r in range(WORLD)]
    for p in ranks:
        p.start()
    try:
        got = dict(results.get(timeout=120) for _ in ranks)
    finally:
        for p in ranks:
            p.join(30)
        os.unlink(segment)
    assert all(p.exitcode == 0 for p in ranks)
    assert got == {r: [(size, True, True) for size in SIZES * 2] for r in range(WORLD)}


def test_a_peer_that_has_exited_is_named_not_waited_for():
    segment = tensor_parallel.create_segment(2)
    peer = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
    peer.start()
    peer.join()
    try:
        tp = TPGroup(0, 2, shm=tensor_parallel.map_segment(segment, 0, 2))
        tp.shm.view(torch.int64)[8 + 1] = peer.pid  # rank 1's line: a process that has ended
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"rank 1 \(pid {peer.pid}\) has exited"):
            tp.all_reduce(torch.ones(4))
        assert time.monotonic() - start < 30
    finally:
        os.unlink(segment)


def test_tensors_the_segment_does_not_carry_are_refused():
    segment = tensor_parallel.create_segment(2)
    try:
        tp = TPGroup(0, 2, shm=tensor_parallel.map_segment(segment, 0, 2))
        with pytest.raises(RuntimeError, match="contiguous fp32 CPU tensor"):
            torch.ops.minivllm_native.shm_all_reduce_(torch.ones(4, dtype=torch.float64), tp.shm, 0, 2)
        with pytest.raises(RuntimeError, match="rank 2 outside the 2 ranks"):
            torch.ops.minivllm_native.shm_all_reduce_(torch.ones(4), tp.shm, 2, 2)
    finally:
        os.unlink(segment)
