"""Compiling structured-output constraints into llguidance grammars, and one matcher per sequence.

llguidance was chosen over xgrammar by measurement (docs/ARCHITECTURE.md, "Structured outputs"):
on this project's 2-core box its masks cost 4.3 ms a step at 32 constrained sequences against
xgrammar's 6.7 ms, a new matcher costs ~1.5 ms, and it has no dependencies (xgrammar pulls triton,
1 GB, for GPU kernels a CPU engine does not use).

`GrammarCompiler.compile` validates and caches by constraint; it is thread-safe, so the server
compiles off the engine thread and the engine's own call finds the cache warm.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy as llnumpy  # not llguidance.torch: importing it imports torch's compiler (~2.5 s, ~70 MiB)
from llguidance.gbnf_to_lark import any_to_lark
import torch

from minivllm.engine.errors import RequestRejectedError
from minivllm.engine.malloc_tuning import release_free_heap
from minivllm.structured.params import StructuredOutputsParams

CACHE_SIZE = 256  # compiled constraints kept (a grammar string and its validation: small)


class GrammarError(RequestRejectedError):
    """The constraint cannot be compiled; the message says why, prefixed by the request field."""


def to_llguidance(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) for one constraint."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.schema() if kind == "json" else {"type": "object"}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_json_layout(params))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":  # a Lark alternation of literal strings (JSON escapes are Lark's too)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    # Lark as is; GBNF (llama.cpp's, the EBNF vLLM's xgrammar backend takes) converted to Lark
    return llguidance.LLMatcher.grammar_from_lark(any_to_lark(params.grammar or ""))


def _json_layout(params: StructuredOutputsParams) -> dict[str, Any]:
    """Separators as `json.dumps` writes them; whitespace only where the request allows it."""
    layout: dict[str, Any] = {"item_separator": ", ", "key_separator": ": ",
                              "whitespace_flexible": params.any_whitespace or params.whitespace_pattern is not None}
    if params.whitespace_pattern is not None:
        layout["whitespace_pattern"] = params.whitespace_pattern
    return layout


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    def fork(self) -> "GrammarMatcher":
        return GrammarMatcher(self._matcher.deep_copy())

    def accept(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise ValueError(f"the grammar rejected token {token_id}: {self._matcher.get_error()}")

    @property
    def is_finished(self) -> bool:
        """Nothing but end-of-sequence can follow: the output is complete."""
        return self._matcher.is_stopped()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        llnumpy.fill_next_token_bitmask(self._matcher, bitmask.numpy(), row)  # a view: fills the tensor


class CompiledGrammar:
    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str):
        self._tokenizer = tokenizer
        self.grammar = grammar

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(llguidance.LLMatcher(self._tokenizer, self.grammar, log_level=0))


class GrammarCompiler:
    """Constraints -> compiled grammars, cached; the llguidance tokenizer is built on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def for_params(self, params: Any) -> CompiledGrammar | None:
        """A request's grammar (None: unconstrained). Cached: the server compiles off the engine
        thread first, so the engine's own call finds it ready."""
        return self.compile(params.structured_outputs) if params.structured_outputs is not None else None

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        key = params.cache_key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            compiled = self._compile(params)
            self._cache[key] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return compiled

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        tokenizer = self._llg_tokenizer(params)
        try:
            grammar = to_llguidance(params)
        except Exception as exc:  # noqa: BLE001 - the GBNF converter raises plain Exceptions
            raise GrammarError(f"{params.source}: invalid {_NAMES[params.kind]}: {exc}", params.source) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise GrammarError(f"{params.source}: invalid {_NAMES[params.kind]}: {error.strip()}", params.source)
        return CompiledGrammar(tokenizer, grammar)

    def _llg_tokenizer(self, params: StructuredOutputsParams) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            if self._hf_tokenizer is None:
                raise GrammarError(f"{params.source}: structured outputs need the model's tokenizer, and this "
                                   f"engine runs without one", params.source)
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
            # building it serialises the whole tokenizer; the engine's malloc settings keep such freed
            # memory for reuse, which held ~46 MiB of RSS for good (measured): hand it back, once
            release_free_heap()
        return self._tokenizer


_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regular expression",
          "choice": "choice list", "grammar": "grammar"}


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.from_numpy(llnumpy.allocate_token_bitmask(rows, vocab_size))


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: disallowed tokens' logits become -inf. (llguidance's own version is wrapped in
    `torch.compile`: a C++ compile at first use, a system compiler required, and measured here at
    16 ms a call for one row; unpacking the bits with plain tensor ops costs well under 1 ms.)"""
    bits = _BITS.to(bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).view(bitmask.shape[0], -1)[:, :logits.shape[1]]
    logits.masked_fill_(allowed.to(logits.device) == 0, float("-inf"))
