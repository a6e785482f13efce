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

The strings are compiled into one Aho-Corasick automaton, so each new character costs O(1)
(amortized) whatever the number of stop strings, and the automaton's state says at once how much
text to hold back: its depth is the longest suffix that could still grow into a stop string.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopAutomaton:
    """Aho-Corasick over the stop strings. State 0 is the root; `depth[s]` is the length of the
    text state s stands for, `match[s]` the longest stop string ending there (None: none)."""

    def __init__(self, patterns: list[str]):
        self.goto: list[dict[str, int]] = [{}]
        self.depth, self.match = [0], [None]
        for pattern in patterns:
            state = 0
            for ch in pattern:
                state = self.goto[state].get(ch) or self._add(state, ch)
            self.match[state] = pattern  # the longest stop string ending here: this one
        self.fail = [0] * len(self.goto)
        self._link_failures()

    def _add(self, state: int, ch: str) -> int:
        self.goto.append({})
        self.depth.append(self.depth[state] + 1)
        self.match.append(None)
        self.goto[state][ch] = len(self.goto) - 1
        return len(self.goto) - 1

    def _link_failures(self) -> None:
        queue = list(self.goto[0].values())
        for state in queue:  # breadth first: a state's failure is shallower, so already linked
            for ch, child in self.goto[state].items():
                self.fail[child] = self.step(self.fail[state], ch) if state else 0
                if self.match[child] is None:
                    self.match[child] = self.match[self.fail[child]]
                queue.append(child)

    def step(self, state: int, ch: str) -> int:
        while state and ch not in self.goto[state]:
            state = self.fail[state]
        return self.goto[state].get(ch, 0)


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
        self._automaton = StopAutomaton(self.stop)
        self._state = 0

    @property
    def held(self) -> str:
        """Text currently held back (a possible start of a stop string)."""
        return self._held

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stop:
            return delta, False
        buf, automaton, state = self._held + delta, self._automaton, self._state
        for i, ch in enumerate(delta):
            state = automaton.step(state, ch)
            matched = automaton.match[state]
            if matched is not None:  # the first to complete; at one end, the longest starts first
                end = len(self._held) + i + 1
                self.stopped, self.matched, self._held = True, matched, ""
                return (buf[:end] if self.include_stop_str_in_output else buf[: end - len(matched)]), True
        self._state = state
        hold = automaton.depth[state]
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """Release held-back text (generation finished without a match)."""
        if self.stopped:
            return ""
        out, self._held = self._held, ""
        return out
