"""Incremental (streaming) detokenization.

Turning one token id at a time into text is not as simple as decoding each
token on its own:

* byte-level BPE (GPT-2 style) tokens are raw bytes, so a multi-byte UTF-8
  character (CJK, emoji, accented letters) may be split over several tokens;
  decoding a prefix of them gives ``"\\ufffd"``;
* SentencePiece / Metaspace decoders strip the ``"▁"`` (space) of the *first*
  token they see, so decoding a lone ``"▁Paris"`` gives ``"Paris"`` although
  in context it reads ``" Paris"``; byte-fallback tokens (``<0xE6>``) are only
  turned into text when a whole run of them forms valid UTF-8.

We therefore use the prefix-offset / read-offset technique: keep a small
window of token ids ending at the newest token.  ``window[:read]`` are tokens
whose text was already emitted (context), ``window[read:]`` are tokens not yet
emitted.  On every new token the window is decoded once and compared with the
(cached) decode of the context part; the difference is the new text.  When
text is emitted the window slides forward, so each step costs O(window), not
O(output length).  Text is held back while the decoded window ends with a
replacement character (an incomplete UTF-8 sequence that a later token may
complete) or when the new tokens produce no text yet.

The first window is seeded with the tail of the prompt, so the first output
token is decoded in context (its leading space is kept for SentencePiece
tokenizers).  For byte-level BPE tokenizers the concatenated deltas equal
``tokenizer.decode(output_ids, skip_special_tokens=...)``.  For Metaspace
tokenizers they equal the text the output adds to the decoded prompt, i.e.
``decode(prompt + output)[len(decode(prompt)):]``, which is
``decode(output)`` with the first token's leading space kept.

``clean_up_tokenization_spaces`` is never applied: it rewrites text across
token boundaries (``" ." -> "."``) and cannot be done while streaming without
retracting already-emitted text.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"

# Number of prompt tokens used as left context for the first output token.
INITIAL_CONTEXT_TOKENS = 5
# If this many tokens are held back without producing text (a long run of
# invalid UTF-8, or tokens that decode to nothing), emit whatever decode()
# gives so the window stays bounded.  Valid UTF-8 never needs more than 4
# byte tokens to finish a character.
MAX_HELD_TOKENS = 16

# tokenizer -> ids that decode(skip_special_tokens=True) drops (computed once).
_SKIP_IDS_CACHE: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


class IncrementalDetokenizer:
    """Streaming detokenizer for one sequence.

    >>> detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    >>> for tid in generated_ids:
    ...     delta = detok.append(tid)   # new text, possibly ""
    >>> tail = detok.flush()            # held-back text at the end
    >>> detok.text                      # everything emitted so far
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self.num_tokens = 0  # output tokens appended so far

        backend = getattr(tokenizer, "backend_tokenizer", None)
        # Call the Rust tokenizer directly when there is one: identical result
        # to tokenizer.decode() (minus clean-up) without the Python overhead.
        self._backend = backend if backend is not None and hasattr(backend, "decode") else None
        self._vocab_size = len(tokenizer)
        self._skip_ids = self._cached_skip_ids() if skip_special_tokens else frozenset()

        # Window state.  _ids[:_read] is context whose text is _prefix_text.
        context = self._initial_context(prompt_token_ids or [])
        self._ids: list[int] = context
        self._read = len(context)
        self._prefix_text = self._decode(context) if context else ""

    # ------------------------------------------------------------------ api
    def append(self, token_id: int) -> str:
        """Add one generated token; return the text it makes safe to emit."""
        token_id = int(token_id)
        self.num_tokens += 1
        if token_id in self._skip_ids:
            # Special tokens are dropped before the decoder runs, so they can
            # never change the text; keeping them out keeps the window small.
            return ""
        if not 0 <= token_id < self._vocab_size:
            # Unknown ids (e.g. padded model vocab) decode to nothing.
            return ""
        self._ids.append(token_id)
        new_text = self._decode(self._ids)
        held = len(self._ids) - self._read
        if held < MAX_HELD_TOKENS and (len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR)):
            return ""
        return self._commit(new_text)

    def flush(self) -> str:
        """Emit whatever is still held back (end of generation)."""
        if len(self._ids) == self._read:
            return ""
        return self._commit(self._decode(self._ids))

    def extend(self, token_ids: Sequence[int]) -> str:
        """Append several tokens; return the concatenated delta."""
        return "".join(self.append(t) for t in token_ids)

    # ------------------------------------------------------------ internals
    def _commit(self, new_text: str) -> str:
        delta = new_text[len(self._prefix_text) :]
        # Slide: the tokens just emitted become the context of the next step.
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _cached_skip_ids(self) -> frozenset[int]:
        try:
            ids = _SKIP_IDS_CACHE.get(self.tokenizer)
        except TypeError:  # not weak-referenceable / hashable
            return self._special_ids_to_skip()
        if ids is None:
            ids = _SKIP_IDS_CACHE[self.tokenizer] = self._special_ids_to_skip()
        return ids

    def _special_ids_to_skip(self) -> frozenset[int]:
        tok = self.tokenizer
        if self._backend is not None:
            # The Rust decoder skips added tokens flagged special.
            added = getattr(tok, "added_tokens_decoder", None) or {}
            ids = {int(i) for i, t in added.items() if getattr(t, "special", False)}
        else:
            ids = {int(i) for i in getattr(tok, "all_special_ids", [])}
        # Only trust the set when decode() really drops the token.
        return frozenset(i for i in ids if self._decode([i]) == "")

    def _initial_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        tail: list[int] = []
        for tid in reversed(prompt_token_ids):
            tid = int(tid)
            if tid in self._skip_ids or not 0 <= tid < self._vocab_size:
                continue
            tail.append(tid)
            if len(tail) == INITIAL_CONTEXT_TOKENS:
                break
        tail.reverse()
        # Use the longest tail that decodes cleanly: a window starting inside
        # a multi-byte character would poison the first output bytes
        # (byte-fallback decodes a whole invalid run as "\ufffd"s), and a
        # prompt ending mid-character is better decoded without context.
        for start in range(len(tail)):
            ctx = tail[start:]
            t = self._decode(ctx)
            if not t.startswith(REPLACEMENT_CHAR) and not t.endswith(REPLACEMENT_CHAR):
                return ctx
        return []
