"""The sliding KV window's sizes (StreamingLLM): which blocks a windowed sequence keeps and when it drops.

Whole blocks throughout: the first `sinks` tokens round up to `sink_blocks`, the window to
`window_blocks`; blocks leave in groups of `drop_blocks` (a quarter of the window, at least one block)
so each key is shifted only ~4 times in its life. A sequence holding more than
(sinks + window + drop) blocks' worth of computed tokens drops whole groups, oldest first after the
sinks, until it holds at most that: with a step's tokens on top, its cache stays under `max_cache_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.arith import ceil_div


@dataclass(frozen=True)
class KVWindow:
    window: int  # tokens kept after the sinks (rounded up to whole blocks)
    sinks: int  # first tokens always kept (attention sinks; rounded up to whole blocks)
    block_size: int

    @property
    def sink_blocks(self) -> int:
        return ceil_div(self.sinks, self.block_size)

    @property
    def window_blocks(self) -> int:
        return ceil_div(self.window, self.block_size)

    @property
    def drop_blocks(self) -> int:
        return max(1, self.window // 4 // self.block_size)

    @property
    def kept_tokens(self) -> int:
        """The most computed tokens a sequence holds once this step's drops are done."""
        return (self.sink_blocks + self.window_blocks + self.drop_blocks) * self.block_size

    def max_cache_tokens(self, step_tokens: int) -> int:
        """The most tokens a windowed sequence's cache holds within a step of `step_tokens` tokens: also
        one past the largest rotary position it uses."""
        return self.kept_tokens + step_tokens

    def blocks_to_drop(self, cached_tokens: int) -> int:
        """Blocks to drop (whole groups) from a sequence holding `cached_tokens` computed tokens."""
        excess = cached_tokens - (self.sink_blocks + self.window_blocks) * self.block_size
        group = self.drop_blocks * self.block_size
        if excess <= group:
            return 0
        return (ceil_div(excess, group) - 1) * self.drop_blocks
