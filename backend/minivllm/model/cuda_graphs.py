"""Decode steps replayed from CUDA graphs: one graph per (row bucket, block-table width bucket).

Why: on a GPU a small model's decode step is hundreds of short kernels (~15 a layer), each launched
from Python for a few microseconds of CPU time, longer than most of them run. A captured graph
launches them all in one call; vLLM and nano-vllm capture one per batch size for the same reason.

How: every decode step (each row one token, no multi-token chunk) is padded up to the smallest
captured bucket that holds it: rows to 1, 2, 4, 8 ... up to the most the engine schedules, the
block-table width to 2, 4, 8 ... blocks up to the longest sequence's. Padding rows write their K/V
into the pool's scratch block (`KVCache(scratch_block=True)`: the block manager never hands it out)
and attend to it alone; padding table columns point at it and lie past every context length, so the
mask hides them (the Triton decode kernel, kernels/triton/attention.py, never reads past a context
length: no mask there). A step's inputs travel in one host-to-device copy into the buffer the graph reads
(ids, positions, slots, context lengths and the table are views of it). Graphs share one memory pool
and are captured largest first, so the smaller ones reuse its blocks.

Steps with multi-token chunks (prefill), hidden-state capture, an early exit, or more rows or blocks
than the largest bucket run eagerly. The capture itself is a seam (`capture`): tests on a machine
without CUDA run the same padding and static buffers through `no_capture`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from minivllm.console import progress
from minivllm.model.attention import AttentionMetadata, KVCache, reads_pool_directly

Step = Callable[[], torch.Tensor]


def buckets(limit: int, first: int = 1) -> list[int]:
    """Powers of two from `first` below `limit`, then `limit` itself: the sizes a graph is captured at."""
    sizes, size = [], first
    while size < limit:
        sizes.append(size)
        size *= 2
    return [*sizes, max(limit, first)]


def bucket_for(sizes: Sequence[int], n: int) -> int | None:
    """The smallest size that holds n (None: more than the largest)."""
    return next((s for s in sizes if s >= n), None)


def no_capture(step: Step) -> Step:
    """Runs the step eagerly at each replay: the padded static-buffer path without a graph."""
    return step


class CudaGraphCapture:
    """Captures steps into CUDA graphs that share one memory pool."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, step: Step) -> Step:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # lazy set-up (cuBLAS handles, workspaces) happens outside the capture
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        replay.graph = graph  # for timing the replay alone (scripts/gpu_step_times.py)
        return replay


class _Graph:
    """One bucket's graph and the static input buffer it reads."""

    def __init__(self, rows: int, width: int, scratch_block: int, block_size: int, device: torch.device):
        self.rows, self.width = rows, width
        self.pad_slot, self.pad_block = scratch_block * block_size, scratch_block
        # ids, positions, slots, context lengths ([rows] each), then the block table [rows, width]
        self.inputs = torch.tensor(self.padded([], [], [], [], []), dtype=torch.long, device=device)
        self.replay: Step | None = None

    def views(self) -> tuple[torch.Tensor, ...]:
        r = self.rows
        ids, pos, slots, lens = self.inputs[: 4 * r].view(4, r).unbind(0)
        return ids, pos, slots, lens, self.inputs[4 * r :].view(r, self.width)

    def padded(
        self, ids: list[int], positions: list[int], slots: list[int], context_lens: list[int], tables: list[list[int]]
    ) -> list[int]:
        """The buffer's contents for a step of len(ids) <= rows rows (an empty step: all padding)."""
        pad = self.rows - len(ids)
        flat = [b for t in tables for b in (*t, *[self.pad_block] * (self.width - len(t)))]
        return [
            *ids,
            *[0] * pad,
            *positions,
            *[0] * pad,
            *slots,
            *[self.pad_slot] * pad,
            *context_lens,
            *[1] * pad,
            *flat,
            *[self.pad_block] * (pad * self.width),
        ]


class DecodeGraphs:
    """The decode graphs of one model over one KV pool."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        max_rows: int,
        max_width: int,
        capture: Callable[[Step], Step] | None = None,
    ):
        if kv_cache.scratch_block is None:
            raise ValueError("decode graphs need a KV pool with a scratch block (KVCache(scratch_block=True))")
        self.model, self.kv_cache = model, kv_cache
        self.row_sizes, self.width_sizes = buckets(max_rows), buckets(max_width, first=2)
        self.device = kv_cache.k[0].device
        self.dtype = model.norm.weight.dtype
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.capture_s = 0.0
        compiled = model.compiled
        # what the graphs hold: the compiled layers' kernels where compiling worked, else eager ones
        self.holds = (
            f"compiled layers ({compiled.backend}, {compiled.group} a graph)"
            if compiled is not None and compiled.active
            else "eager kernels"
        )
        self.replays = 0  # steps served by a graph (tests: none captured or missed in steady state)
        self._capture_all(capture or CudaGraphCapture())

    def _capture_all(self, capture: Callable[[Step], Step]) -> None:
        shapes = [(r, w) for r in reversed(self.row_sizes) for w in reversed(self.width_sizes)]  # largest first
        started = time.perf_counter()
        for i, (rows, width) in enumerate(shapes, 1):
            if i == 1 or i % 8 == 0 or i == len(shapes):
                progress(f"capturing decode graph {i}/{len(shapes)} ({rows} rows x {width} blocks) ...")
            graph = _Graph(rows, width, self.kv_cache.scratch_block, self.kv_cache.block_size, self.device)
            graph.replay = capture(self._step(graph))
            self.graphs[rows, width] = graph
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - started

    def _step(self, graph: _Graph) -> Step:
        ids, positions, slots, context_lens, tables = graph.views()

        def step() -> torch.Tensor:
            # built inside the step: where the portable attention runs, the decode mask is computed from
            # the static context lengths on replay; a kernel that reads the pool needs none
            meta = AttentionMetadata(
                slot_mapping=slots,
                num_decode_tokens=graph.rows,
                decode_block_tables=tables,
                decode_context_lens=context_lens,
                prefills=[],
                block_size=self.kv_cache.block_size,
                dtype=self.dtype,
                decode_mask_read=not reads_pool_directly(self.kv_cache.k[0], graph.rows, self.dtype),
            )
            return self.model(ids, positions, self.kv_cache, meta)

        return step

    def describe(self) -> str:
        return (
            f"CUDA graphs of {self.holds} (decode steps: {len(self.row_sizes)} row buckets up to "
            f"{self.row_sizes[-1]} x {len(self.width_sizes)} block-table widths up to {self.width_sizes[-1]}, "
            f"{len(self.graphs)} graphs captured in {self.capture_s:.1f}s; prefill chunks eager)"
        )

    def run(
        self, ids: list[int], positions: list[int], slots: list[int], context_lens: list[int], tables: list[list[int]]
    ) -> torch.Tensor | None:
        """The final-normed hidden states of a decode step's rows, or None where no bucket holds it.
        `tables`: each row's blocks in use (no padding)."""
        rows = bucket_for(self.row_sizes, len(ids))
        width = bucket_for(self.width_sizes, max(map(len, tables)))
        if rows is None or width is None:
            return None
        graph = self.graphs[rows, width]
        host = torch.tensor(graph.padded(ids, positions, slots, context_lens, tables), dtype=torch.long)
        graph.inputs.copy_(host)
        self.replays += 1
        return graph.replay()[: len(ids)]
