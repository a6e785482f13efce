"""vLLM's `bad_words` as token sequences: each word as it reads at the start of the text and after a
space, since BPE and SentencePiece tokenizers spell the two differently ("Paris" vs " Paris")."""

from __future__ import annotations

from typing import Any


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    sequences: list[list[int]] = []
    for word in words:
        bare = word.lstrip()
        for text in (bare, " " + bare):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences
