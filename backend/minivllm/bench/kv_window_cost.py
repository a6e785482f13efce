"""What a sliding KV window (--kv-window, StreamingLLM) costs in quality and saves in memory: the shipped
text scored token by token through the engine's own pool, block manager and key shifts, with each window
and with full attention over the same tokens (as many as full attention fits), and the peak KV blocks
the sequence held."""

from __future__ import annotations

from importlib import resources

from minivllm.bench.common import progress
from minivllm.engine.factory import engine_for
from minivllm.engine.window_scoring import score

TEXT_FILE = "declaration_of_independence.txt"


def print_window_cost(engine, windows: tuple[int, ...], sinks: int = 4) -> None:
    ids = engine.loaded.tokenizer.encode(resources.files("minivllm.bench").joinpath("data", TEXT_FILE).read_text())
    bs = engine.config.block_size
    ids = ids[: min(len(ids), engine.max_model_len, engine.block_manager.num_blocks * bs)]
    print(f"\nKV window: next-token perplexity of {len(ids)} tokens of {TEXT_FILE}, scored in 64-token chunks:")
    print(f"  {'attention':<26} {'perplexity':>10} {'peak KV blocks':>15}")
    for window in (None, *windows):
        label = "full" if window is None else f"window {window}, sinks {sinks}"
        progress(f"scoring with {label}")
        config = engine.config.with_changes(kv_window=window, kv_sinks=sinks, max_num_batched_tokens=64)
        nll, peak = score(engine_for(engine.loaded, config), ids, 64)
        print(f"  {label:<26} {2.718281828459045**nll:>10.2f} {peak:>15}")
