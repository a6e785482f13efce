"""Turns one step's scheduled work into tensors, runs the model, returns logits (and hands pooling
requests the final hidden states of their rows).

The runner knows nothing about requests or scheduling: it sees sequences as (new tokens, how many
tokens are already cached, block table) and lays single-token rows first (they take the paged
decode-attention path), then multi-token chunks (prefill attention over the cached prefix). The
split is by token count, not by a request's phase: a prefill may end with a one-token chunk. A
table's FREED slots (blocks that left a sliding window) go to the model as block 0: never attended.
"""

from __future__ import annotations

import time

import torch

from minivllm.arith import ceil_div
from minivllm.cache import compiler_cache_dir
from minivllm.console import progress
from minivllm.core.step_work import PromptLogprobsRows, SeqWork
from minivllm.engine.prompt_logprob_pass import target_logprobs
from minivllm.model.attention import (
    AttentionMetadata,
    KVCache,
    PrefillChunk,
    native_decode_ready,
    reads_pool_directly,
    reads_pool_with_triton,
)
from minivllm.model.compiled import compiled_step_for, graph_count, warm_up_shapes
from minivllm.model.cuda_graphs import DecodeGraphs
from minivllm.model.kv_window import apply_shifts, layer_rotaries
from minivllm.model.llama import LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = next(model.parameters()).device
        self.dtype = model.norm.weight.dtype  # the activations' dtype (quantized layers keep floats around them)
        self.graphs: DecodeGraphs | None = None  # CUDA: decode steps replayed from graphs (warmed_up)
        self.window = getattr(model.config, "attention_window", None)  # sliding-window attention (Mistral)

    @staticmethod
    def for_model(model: LlamaModel, kv_cache: KVCache) -> ModelRunner:
        """The runner the model asks for: a tensor-parallel rank 0's sends each call to its workers first
        (`model.runner_class`, set by engine/tp_workers.py)."""
        return getattr(model, "runner_class", ModelRunner)(model, kv_cache)

    def warmed_up(self, max_rows: int, max_model_len: int, graph_rows: int | None = None) -> ModelRunner:
        """Compile every decode graph a step of up to `max_rows` sequences can need, now (with
        progress) rather than in the first requests' steps; none where the native step runs every
        decode step. Writes garbage K/V into block 0: only for a fresh pool. Eagerly only the decode
        attention kernel is readied: the native one on a CPU (built on a first start: seconds that a
        first request would otherwise wait), the Triton one on CUDA (compiled and checked, before any
        graph holds it). On CUDA the decode graphs are captured next, over the compiled layers where
        they compiled (model/cuda_graphs.py), for up to `graph_rows` rows (default `max_rows`;
        speculation's verify steps hold more)."""
        if self.device.type == "cpu":
            native_decode_ready()
        else:  # Triton's decode kernel checked now, before any compile or capture asks (attention.py)
            reads_pool_with_triton(self.kv_cache.k[0])
        compiled = compiled_step_for(self.model, max_rows, self.kv_cache.k[0])
        if compiled is not None and compiled.active:
            self._compile_decode(compiled, max_rows, max_model_len)
        if self.model.may_capture and self.kv_cache.scratch_block is not None:
            return self._captured(graph_rows or max_rows, max_model_len)
        progress(f"decode steps: {self.model.compilation()}")
        return self

    def close(self) -> None:
        """Nothing to release here; a tensor-parallel runner stops its workers (engine/tp_workers.py)."""

    def _compile_decode(self, compiled, max_rows: int, max_model_len: int) -> None:
        for pool in (*self.kv_cache.k, *self.kv_cache.v):  # a rebuilt pool of another size: no new graph
            torch._dynamo.maybe_mark_dynamic(pool, 0)
            torch._dynamo.maybe_mark_dynamic(pool, 1)
        shapes = warm_up_shapes(self.model, max_rows, (max_model_len - 1) // self.block_size + 1)
        started, graphs = time.perf_counter(), graph_count()
        compiled.steady = False
        for i, (rows, width) in enumerate(shapes, 1):
            progress(f"compiling decode step {i}/{len(shapes)} ({rows} row{'s' if rows > 1 else ''}) ...")
            work = [SeqWork([0], (width - 1) * self.block_size, [0] * width) for _ in range(rows)]
            self.execute(work, [])
        # Steps the native step runs (model/native_step.py) compile nothing; where it ran them all, a later
        # compiled call (a benchmark turning it off) must be free to compile, so guards stay checked.
        compiled.steady = graph_count() > graphs
        progress(f"{compiled.describe()}: ready in {time.perf_counter() - started:.1f}s (cache {compiler_cache_dir()})")

    def _captured(self, max_rows: int, max_model_len: int) -> ModelRunner:
        """Captures the decode graphs; a failure (an operator CUDA graphs cannot hold) leaves decode
        steps eager with one warning naming the cause, never a dead server."""
        try:
            self.graphs = DecodeGraphs(self.model, self.kv_cache, max_rows, ceil_div(max_model_len, self.block_size))
        except Exception as exc:  # noqa: BLE001 - the capture's failure, whatever it is, must not stop serving
            self.model.may_capture = False
            self.model.eager_reason = f"CUDA graph capture failed: {type(exc).__name__}: {str(exc)[:300]}"
            progress(f"WARNING: {self.model.eager_reason}; decode steps run eagerly")
        self.model.captured = self.graphs
        progress(f"decode steps: {self.model.compilation()}")
        return self

    def execute(
        self,
        single: list[SeqWork],
        chunks: list[SeqWork],
        copies: list[tuple[int, int]] | None = None,
        hidden_states_out: list[torch.Tensor] | None = None,
        num_layers: int | None = None,
        shifts: list[tuple[list[int], int]] | None = None,
    ) -> torch.Tensor:
        """Returns fp32 logits [rows, vocab]: each sequence's `num_logits` rows, in the order
        single-token rows, then chunks. `num_layers`: the early-exit draft (see LlamaModel). A work
        with `prompt_logprobs` also gets its rows' log-probs, handed to its sink.

        With a native or compiled step, single-token rows run through it even beside chunks, in a pass
        of their own: those steps and eager code sum in different orders, so otherwise a token's bits
        (and a seeded sample) would depend on whether another request's prompt shared its step."""
        self.kv_cache.copy_blocks(copies or [])
        if shifts:  # a sliding KV window's drops: later keys move back to their new cache positions
            apply_shifts(self.kv_cache.k, layer_rotaries(self.model), shifts)
        compiled = self.model.compiled is not None and self.model.compiled.active
        own_pass = compiled or self.model.native_step is not None or self.graphs is not None
        if single and chunks and own_pass and hidden_states_out is None:
            return torch.cat([self._forward(single, [], None, num_layers), self._forward([], chunks, None, num_layers)])
        return self._forward(single, chunks, hidden_states_out, num_layers)

    def _forward(
        self,
        single: list[SeqWork],
        chunks: list[SeqWork],
        hidden_states_out: list[torch.Tensor] | None,
        num_layers: int | None,
    ) -> torch.Tensor:
        ids, pos, slots, rows, wanted, pooled = self._host_inputs(single + chunks)
        hidden = None
        if self.graphs is not None and not chunks and hidden_states_out is None and num_layers is None:
            hidden = self.graphs.run(
                ids,
                pos,
                slots,
                [w.num_computed + 1 for w in single],
                [w.blocks_in_use(self.block_size) for w in single],
            )  # None: no graph holds it
        if hidden is None:
            dev = self.device
            hidden = self.model(
                torch.tensor(ids, dtype=torch.long, device=dev),
                torch.tensor(pos, dtype=torch.long, device=dev),
                self.kv_cache,
                self._metadata(single, chunks, slots),
                hidden_states_out,
                num_layers,
            )
        for start, work in pooled:  # pooling requests: hidden states, no logits
            work.pooled(work.num_computed, hidden[start : start + len(work.token_ids)])  # type: ignore[misc]
        every_row = len(rows) == hidden.shape[0]  # rows ascend: all of them is hidden itself (a decode step)
        if not rows:  # only pooling chunks ran: no LM head call on zero rows
            logits = hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        else:
            logits = self.model.compute_logits(
                hidden if every_row else hidden[torch.tensor(rows, dtype=torch.long, device=self.device)]
            )
        for start, asked in wanted:  # only requests that asked: nothing to do for the others
            first = start + asked.first_row
            asked.sink(
                *target_logprobs(
                    self.model.compute_logits,
                    hidden[first : first + len(asked.targets)],
                    asked.targets,
                    asked.top_n,
                    self.model.config.vocab_size,
                )
            )
        return logits

    def _host_inputs(self, works: list[SeqWork]):
        """Token ids, positions, KV slots, logits rows, prompt log-prob rows and pooling chunks (with
        their first row) of a step, as lists."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        wanted: list[tuple[int, PromptLogprobsRows]] = []
        pooled: list[tuple[int, SeqWork]] = []
        for work in works:
            n = len(work.token_ids)
            start = len(ids)
            if work.prompt_logprobs is not None:
                wanted.append((start, work.prompt_logprobs))
            if work.pooled is not None:
                pooled.append((start, work))
            ids.extend(work.token_ids)
            positions = range(work.num_computed, work.num_computed + n)
            pos.extend(positions)
            slots.extend(self._slot(work.block_table, p) for p in positions)
            rows.extend(range(start + n - work.num_logits, start + n))
        return ids, pos, slots, rows, wanted, pooled

    def _metadata(self, single: list[SeqWork], chunks: list[SeqWork], slots: list[int]) -> AttentionMetadata:
        dev = self.device
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decode_tokens=len(single),
            decode_block_tables=self._padded_tables(single),
            decode_context_lens=(torch.tensor([w.num_computed + 1 for w in single], device=dev) if single else None),
            prefills=self._prefill_chunks(chunks, offset=len(single)),
            block_size=self.block_size,
            dtype=self.dtype,
            decode_mask_read=not reads_pool_directly(self.kv_cache.k[0], len(single), self.dtype, self.window),
            window=self.window,
        )

    def _slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def _padded_tables(self, works: list[SeqWork]) -> torch.Tensor | None:
        if not works:
            return None
        # at least 2 wide (the extra column is masked): dynamo specializes a size of 1, so a width of
        # 1 would need a compiled graph of its own per row range
        width = max(2, *(len(w.blocks_in_use(self.block_size)) for w in works))
        rows = [w.block_table[:width] + [0] * (width - min(width, len(w.block_table))) for w in works]
        return self._no_freed(torch.tensor(rows, dtype=torch.long, device=self.device))

    def _prefill_chunks(self, prefills: list[SeqWork], offset: int) -> list[PrefillChunk]:
        chunks, start = [], offset
        for w in prefills:
            end = start + len(w.token_ids)
            table = self._no_freed(torch.tensor(w.blocks_in_use(self.block_size), dtype=torch.long, device=self.device))
            chunks.append(PrefillChunk(start, end, w.num_computed, table))
            start = end
        return chunks

    def _no_freed(self, table: torch.Tensor) -> torch.Tensor:
        """FREED slots (-1) as block 0: attention never reads keys before its window (model/attention.py)."""
        return table.clamp_(min=0) if self.window is not None else table
