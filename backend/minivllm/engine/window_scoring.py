"""Teacher-forced scoring through an engine's own KV pool, block manager and sliding-window drops: the
perplexity a --kv-window costs (`minivllm bench kv`, tests). Outside the engine loop: one sequence of its
own, run in chunks as the scheduler would run them."""

from __future__ import annotations

from minivllm.core.step_work import SeqWork

SEQ_ID = -7  # the scoring's own sequence in an idle engine's block manager


def score(engine, ids: list[int], chunk: int) -> tuple[float, int]:
    """Mean next-token NLL of `ids` and the most blocks its sequence held: chunks run as the scheduler
    would run them (drops at each chunk's start, the kept keys shifted, positions in the cache)."""
    bm, runner, window = engine.block_manager, engine.runner, engine.config.window
    bm.allocate_seq(SEQ_ID, "bench", [], prefix=[])
    total, dropped, peak = 0.0, 0, 0
    for start in range(0, len(ids) - 1, chunk):
        tokens = ids[start : min(start + chunk, len(ids) - 1)]
        shifts = []
        num_blocks = window.blocks_to_drop(start - dropped) if window is not None else 0
        if num_blocks:
            shifts.append((bm.drop_window(SEQ_ID, num_blocks), num_blocks * bm.block_size))
            dropped += num_blocks * bm.block_size
        assert bm.ensure_capacity(SEQ_ID, start + len(tokens)), "the bench's pool is too small"
        table = bm.block_table(SEQ_ID)
        peak = max(peak, len(table))
        work = SeqWork(tokens, start - dropped, table, num_logits=len(tokens))
        logits = runner.execute([], [work], shifts=shifts)
        targets = logits.new_tensor(ids[start + 1 : start + 1 + len(tokens)]).long()
        total -= logits.log_softmax(-1).gather(1, targets[:, None]).sum().item()
    bm.free_seq(SEQ_ID)
    return total / (len(ids) - 1), peak
