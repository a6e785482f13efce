"""Translating engine state into wire types: block events, request states, snapshots."""

from __future__ import annotations

from minivllm.core.block_manager import BlockEvent, BlockManager
from minivllm.core.request import Request, Sequence
from minivllm.events import types as ev
from minivllm.sampling.params import SamplingParams


def block_event(e: BlockEvent) -> ev.Event | None:
    """A queued block-manager change -> its wire event (the table as it was right after it)."""
    owner, seq_id = e.owner or "", e.seq_id if e.seq_id is not None else -1
    if e.kind == "allocated":
        return ev.BlocksAllocated(request_id=owner, seq_id=seq_id, block_ids=e.block_ids, table=e.table)
    if e.kind == "shared":
        return ev.BlocksShared(
            request_id=owner,
            seq_id=seq_id,
            block_ids=e.block_ids,
            ref_counts=e.ref_counts,
            prefix_hit=e.prefix_hit,
            table=e.table,
        )
    if e.kind in ("freed", "released"):
        return ev.BlocksFreed(
            request_id=owner,
            seq_id=seq_id,
            block_ids=e.block_ids,
            ref_counts=e.ref_counts,
            whole_table=e.seq_released,
            table=None if e.seq_released else e.table,
            dropped=e.dropped,
        )
    if e.kind == "cached":
        return ev.BlocksCached(
            request_id=owner,
            seq_id=seq_id,
            block_ids=e.block_ids,
            hashes=_hashes(e),
        )
    if e.kind == "restored":  # read back from the disk tier: cached and free, no sequence yet
        return ev.BlocksCached(request_id="", seq_id=-1, block_ids=e.block_ids, hashes=_hashes(e), from_disk=True)
    if e.kind == "evicted":
        return ev.BlocksEvicted(block_ids=e.block_ids, hashes=_hashes(e), to_disk=e.to_disk)
    if e.kind == "copied":
        return ev.BlocksCopied(
            request_id=owner,
            seq_id=seq_id,
            src_block_ids=e.src_block_ids or [],
            block_ids=e.block_ids,
            ref_counts=e.ref_counts,
            table=e.table,
        )
    return None


def _hashes(e: BlockEvent) -> list[str]:
    return [ev.hash_hex(h) or "" for h in e.block_hashes or []]


_DEFAULT_PARAMS = SamplingParams()  # built and validated once, not per arrival / snapshot


def sampling_summary(request: Request) -> dict[str, object]:
    """The request's non-default decoding settings, for display; a pooling request's pooling."""
    if request.pooling is not None:
        return {"pooling": request.pooling.params.describe()}
    defaults = _DEFAULT_PARAMS
    keys = (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "n",
        "use_beam_search",
        "beam_width",
        "length_penalty",
        "min_tokens",
        "ignore_eos",
        "logprobs",
        "stop",
    )
    summary: dict[str, object] = {
        k: getattr(request.params, k) for k in keys if getattr(request.params, k) != getattr(defaults, k)
    }
    if "stop" in summary:
        summary["stop"] = stop_summary(request.params.stop)  # type: ignore[arg-type]
    summary["max_tokens"] = request.max_tokens
    if request.params.structured_outputs is not None:
        summary["structured_outputs"] = request.params.structured_outputs.kind
    if request.params.logit_bias:
        summary["logit_bias"] = len(request.params.logit_bias)  # how many tokens it biases
    if request.params.allowed_token_ids:
        summary["allowed_token_ids"] = len(request.params.allowed_token_ids)
    if request.params.bad_words:
        summary["bad_words"] = len(request.params.bad_words)
    if request.cache_salt is not None:
        summary["cache_salt"] = True  # the salt itself is a tenant's secret: only that it is set
    return summary


STOP_SHOWN, STOP_CHARS_SHOWN = 4, 40


def stop_summary(stop: list[str]) -> list[str]:
    """The stop list as shown in events and snapshots: a few entries, each cut short, and a count of
    the rest (a snapshot carries this for every request it lists)."""
    shown = [s if len(s) <= STOP_CHARS_SHOWN else s[: STOP_CHARS_SHOWN - 1] + "…" for s in stop[:STOP_SHOWN]]
    return shown + ([f"(+{len(stop) - STOP_SHOWN} more)"] if len(stop) > STOP_SHOWN else [])


def seq_state(seq: Sequence, bm: BlockManager) -> ev.SeqState:
    return ev.SeqState(
        seq_id=seq.seq_id,
        parent_seq_id=seq.parent_seq_id,
        num_tokens=seq.num_tokens,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_computed=seq.num_computed,
        block_table=bm.held_blocks(seq.seq_id),
        finished=seq.finished,
    )


def request_state(request: Request, bm: BlockManager) -> ev.RequestState:
    return ev.RequestState(
        request_id=request.request_id,
        state=request.status.value,
        prompt_tokens=request.num_prompt_tokens,
        max_tokens=request.max_tokens,
        n=request.params.n,
        priority=request.priority,
        arrival_ts=request.arrival_time,
        sampling=sampling_summary(request),
        prompt_preview=request.preview,
        output_tokens=request.num_generated_events,
        first_token_ts=request.first_token_time,
        finish_ts=request.finish_time,
        finish_reason=request.finish_reason,
        num_preemptions=request.num_preemptions,
        seqs=[seq_state(s, bm) for s in request.seqs],
    )


def block_states(bm: BlockManager) -> list[ev.BlockState]:
    """Hashes are shown only for blocks reachable through the prefix cache."""
    return [
        ev.BlockState(
            block_id=b.block_id,
            ref_count=b.ref_count,
            block_hash=ev.hash_hex(b.block_hash) if bm.is_cached(b.block_id) else None,
        )
        for b in bm.blocks
    ]
