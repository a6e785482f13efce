"""Stop-string detection over a stream of text deltas.

The detokenizer produces text in arbitrary chunks, so a stop string may be
split across several deltas (``"<|" + "end" + "|>"``).  :class:`StopStringMatcher`
holds back the longest suffix of the not-yet-emitted text that could still be
the beginning of a stop string, so a stop string is never leaked to the client.

When several stop strings occur, the one that *completes first* wins (as if
the text had arrived one character at a time); ties go to the one that starts
earliest.  The result is therefore independent of how the text was chunked.
E.g. with ``stop=["foo", "foobar"]`` the text ``"xfoobar"`` stops at
``"foo"``.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopStringMatcher:
    """Incremental stop-string matcher for one sequence.

    ``feed(delta)`` returns ``(text_safe_to_emit, stopped)``.  Once stopped,
    further feeds return ``("", True)``.  ``flush()`` returns the held-back
    text when generation ends for another reason (EOS, max_tokens).
    ``matched`` is the stop string that ended generation, or ``None``.
    """

    def __init__(self, stop: Iterable[str] | None, include_stop_str_in_output: bool = False) -> None:
        # Empty strings would match immediately; duplicates are pointless.
        self.stop: list[str] = list(dict.fromkeys(s for s in (stop or []) if s))
        self.include_stop_str_in_output = include_stop_str_in_output
        self.matched: str | None = None
        self.stopped = False
        self._held = ""
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1

    @property
    def held(self) -> str:
        """Text currently held back (a possible start of a stop string)."""
        return self._held

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stop:
            return delta, False
        buf = self._held + delta
        if not buf:
            return "", False

        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self.stop:
            i = buf.find(s)
            if i >= 0:
                cand = (i + len(s), i, s)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is not None:
            end, start, s = best
            self.stopped = True
            self.matched = s
            self._held = ""
            return (buf[:end] if self.include_stop_str_in_output else buf[:start]), True

        hold = self._partial_match_len(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """Release held-back text (generation finished without a match)."""
        if self.stopped:
            return ""
        out, self._held = self._held, ""
        return out

    def _partial_match_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        for k in range(min(len(buf), self._max_hold), 0, -1):
            tail = buf[-k:]
            for s in self.stop:
                if len(s) > k and s.startswith(tail):
                    return k
        return 0
