"""vLLM's `prompt_logprobs`: a request's log-probs of its own prompt tokens, gathered chunk by chunk.

Entry i is prompt token i's log-prob (plus the top-N alternatives) under the model's raw
distribution at position i - 1; entry 0 is None (nothing precedes the first token). A prefill
chunk over positions [start, start + n) yields the entries of tokens start + 1 .. start + n, up to
the prompt's end. Entries are kept by position, so a recompute after a preemption asks for none it
already has, and a request whose entries are still incomplete takes no prefix-cache hit: cached
tokens never run through the model, so they would have no logits (vLLM does the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PromptLogprobs:
    top_n: int  # alternatives per position besides the prompt token (0: the prompt token only)
    num_prompt_tokens: int
    # per prompt token: {token_id: logprob}, the prompt token first, then the top-N (the shape of
    # the generated tokens' entries); None for the first token
    entries: list[dict[int, float] | None] = field(default_factory=lambda: [None])
    ranks: list[int | None] = field(default_factory=lambda: [None])  # the prompt token's rank (1: the likeliest)
    reported: bool = False

    @property
    def pending(self) -> bool:
        """Some prompt position still has to run through the model for its entry."""
        return len(self.entries) < self.num_prompt_tokens

    def targets(self, token_ids: list[int], start: int, num_tokens: int) -> tuple[int, list[int]] | None:
        """For a chunk running positions [start, start + num_tokens): (the chunk's first row that
        yields a missing entry, the prompt token each row from there predicts), or None."""
        first = max(start, len(self.entries) - 1)
        end = min(start + num_tokens, self.num_prompt_tokens - 1)
        if first >= end:
            return None
        return first - start, token_ids[first + 1 : end + 1]

    def add(self, first: int, entries: list[dict[int, float]], ranks: list[int]) -> None:
        """The entries of prompt tokens first, first + 1, ... (`targets` asked for them); any this
        request already has are skipped, so an entry is never added twice."""
        skip = len(self.entries) - first
        if skip < 0:
            raise ValueError(f"prompt logprobs from token {first} on, but only {len(self.entries)} are known")
        self.entries.extend(entries[skip:])
        self.ranks.extend(ranks[skip:])

    def take(self) -> tuple[list[dict[int, float] | None], list[int | None]] | None:
        """(entries, ranks) once they are complete, the first time only (the request's first output)."""
        if self.reported or self.pending:
            return None
        self.reported = True
        return self.entries, self.ranks
