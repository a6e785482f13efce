"""Prompt lookup (n-gram) drafting: find the sequence's last n tokens earlier in its own tokens and
propose what followed them there. No model, microseconds a step; it pays when the answer repeats
its input (quoting, rewriting, editing code)."""

from __future__ import annotations

from collections.abc import Sequence


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix
    n-gram (n from `max_n` down to `min_n`); [] when no suffix recurs."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = list(tokens[total - n :])
        first = suffix[0]
        # scan right to left: the latest occurrence is the likeliest continuation
        for start in range(total - n - 1, -1, -1):
            if tokens[start] == first and list(tokens[start : start + n]) == suffix:
                follow = list(tokens[start + n : start + n + k])
                if follow:
                    return follow
    return []
