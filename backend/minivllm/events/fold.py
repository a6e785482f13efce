"""Folding events onto a snapshot: the reference for the dashboard's reducer.

`fold(snapshot, events)` returns the state those events lead to. The engine's own snapshot taken
after the same events must be equal (modulo finished requests that aged out of its history):
that is how tests prove the event stream tells the whole story.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

from minivllm.events import types as ev


class StateFolder:
    def __init__(self, snapshot: ev.Snapshot):
        snap = copy.deepcopy(snapshot)
        self.seq, self.ts, self.step, self.config = snap.seq, snap.ts, snap.step, snap.config
        self.requests: dict[str, ev.RequestState] = {r.request_id: r for r in snap.requests}
        self.blocks: list[ev.BlockState] = snap.blocks

    def apply_all(self, events: Iterable[ev.Event]) -> StateFolder:
        for event in events:
            self.apply(event)
        return self

    def apply(self, e: ev.Event) -> None:
        if e.seq <= self.seq:
            return  # already folded (resume overlaps are harmless)
        self.seq, self.ts = e.seq, e.ts
        handler = getattr(self, "_on_" + type(e).__name__, None)
        if handler is not None:
            handler(e)

    def snapshot(self) -> ev.Snapshot:
        return ev.Snapshot(
            seq=self.seq,
            ts=self.ts,
            step=self.step,
            config=self.config,
            requests=list(self.requests.values()),
            blocks=self.blocks,
        )

    # ---- helpers ------------------------------------------------------------------------------

    def _seq(self, request_id: str, seq_id: int) -> ev.SeqState | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        return next((s for s in request.seqs if s.seq_id == seq_id), None)

    def _set_refs(self, block_ids: list[int], ref_counts: list[int]) -> None:
        for b, r in zip(block_ids, ref_counts):
            self.blocks[b].ref_count = r

    def _set_table(self, request_id: str, seq_id: int, table: list[int]) -> None:
        seq = self._seq(request_id, seq_id)
        if seq is not None:
            seq.block_table = list(table)

    # ---- handlers -----------------------------------------------------------------------------

    def _on_RequestArrived(self, e: ev.RequestArrived) -> None:
        self.requests[e.request_id] = ev.RequestState(
            request_id=e.request_id,
            state="WAITING",
            prompt_tokens=e.prompt_tokens,
            max_tokens=e.max_tokens,
            n=e.n,
            priority=e.priority,
            arrival_ts=e.ts,
            sampling=e.sampling,
            prompt_preview=e.prompt_preview,
        )

    def _on_RequestStateChanged(self, e: ev.RequestStateChanged) -> None:
        request = self.requests.get(e.request_id)
        if request is None:
            return
        request.state = e.state
        if e.state == "PREEMPTED":
            request.num_preemptions += 1
            for seq in request.seqs:
                seq.num_computed, seq.block_table = 0, []
        if e.state == "FINISHED":
            request.finish_ts, request.finish_reason = e.ts, e.finish_reason

    def _on_SeqAdded(self, e: ev.SeqAdded) -> None:
        request = self.requests.get(e.request_id)
        if request is None:
            return
        parent = self._seq(e.request_id, e.parent_seq_id) if e.parent_seq_id is not None else None
        request.seqs.append(
            ev.SeqState(
                seq_id=e.seq_id,
                parent_seq_id=e.parent_seq_id,
                num_tokens=e.num_tokens,
                num_prompt_tokens=e.num_prompt_tokens,
                num_computed=parent.num_computed if parent else 0,
                block_table=[],
            )
        )

    def _on_SeqRemoved(self, e: ev.SeqRemoved) -> None:
        request = self.requests.get(e.request_id)
        if request is not None:
            request.seqs = [s for s in request.seqs if s.seq_id != e.seq_id]

    def _on_TokenGenerated(self, e: ev.TokenGenerated) -> None:
        request = self.requests.get(e.request_id)
        if request is None:
            return
        request.output_tokens += 1
        if request.first_token_ts is None:
            request.first_token_ts = e.ts
        seq = self._seq(e.request_id, e.seq_id)
        if seq is not None:
            seq.num_tokens += 1

    def _on_StepScheduled(self, e: ev.StepScheduled) -> None:
        self.step = e.step
        for chunk in e.prefill + e.decode:
            seq = self._seq(chunk.request_id, chunk.seq_id)
            if seq is not None:
                seq.num_computed = chunk.start + chunk.num_tokens

    def _on_SpecVerified(self, e: ev.SpecVerified) -> None:
        seq = self._seq(e.request_id, e.seq_id)
        if seq is not None:  # the rejected drafts' positions roll back
            seq.num_computed -= len(e.proposed) - e.accepted

    def _on_BlocksAllocated(self, e: ev.BlocksAllocated) -> None:
        for b in e.block_ids:
            self.blocks[b].ref_count = 1
        self._set_table(e.request_id, e.seq_id, e.table)

    def _on_BlocksShared(self, e: ev.BlocksShared) -> None:
        self._set_refs(e.block_ids, e.ref_counts)
        self._set_table(e.request_id, e.seq_id, e.table)

    def _on_BlocksFreed(self, e: ev.BlocksFreed) -> None:
        self._set_refs(e.block_ids, e.ref_counts)
        if e.whole_table:
            self._set_table(e.request_id, e.seq_id, [])
        elif e.table is not None:
            self._set_table(e.request_id, e.seq_id, e.table)

    def _on_BlocksCached(self, e: ev.BlocksCached) -> None:
        for b, h in zip(e.block_ids, e.hashes):
            self.blocks[b].block_hash = h

    def _on_BlocksEvicted(self, e: ev.BlocksEvicted) -> None:
        for b in e.block_ids:
            self.blocks[b].block_hash = None

    def _on_BlocksCopied(self, e: ev.BlocksCopied) -> None:
        for b in e.block_ids:
            self.blocks[b].ref_count = 1
        self._set_table(e.request_id, e.seq_id, e.table)

    def _on_ConfigChanged(self, e: ev.ConfigChanged) -> None:
        self.config = e.config
        self.requests = {}
        self.blocks = [ev.BlockState(block_id=i, ref_count=0, block_hash=None) for i in range(e.config.num_blocks)]


def fold(snapshot: ev.Snapshot, events: Iterable[ev.Event]) -> ev.Snapshot:
    return StateFolder(snapshot).apply_all(events).snapshot()
