"""Compiling structured-output constraints into llguidance grammars, and one matcher per sequence.

llguidance was chosen over xgrammar by measurement (docs/ARCHITECTURE.md, "Structured outputs"):
on this project's 2-core box its masks cost 4.3 ms a step at 32 constrained sequences against
xgrammar's 6.7 ms, a new matcher costs ~1.5 ms, and it has no dependencies (xgrammar pulls triton,
1 GB, for GPU kernels a CPU engine does not use).

`GrammarCompiler.compile` validates and caches by constraint; it is thread-safe, so the server
compiles off the engine thread and the engine's own call finds the cache warm. Compiling also
builds a template matcher and computes its first mask, so that the engine thread only copies it
(~0.1 ms where building one from a 5,000-property schema takes 0.4-1.5 s), and a constraint the
parser cannot follow is refused before the request runs. Anything a constraint makes llguidance
raise or report, at compilation or while generating, is the client's error naming the field.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy as llnumpy  # not llguidance.torch: importing it imports torch's compiler (~2.5 s, ~70 MiB)
import torch
from llguidance.gbnf_to_lark import any_to_lark, is_lark_syntax

from minivllm.errors import RequestRejectedError
from minivllm.malloc_tuning import release_free_heap
from minivllm.structured.params import StructuredOutputsParams
from minivllm.structured.termination import never_finishing_rules

CACHE_SIZE = 256  # compiled constraints kept (a grammar string and its template matcher)
# ... and their memory, estimated from the constraint's length: a compiled grammar's RSS measured 41-55
# bytes per character of its JSON (15,000 choices: 8.7 MiB; a 2,000-property schema: 5 MiB; a 5,000-way
# regex: 3 MiB), so 256 of the largest held ~2 GiB until an attack run's end. 64 is the upper estimate.
CACHE_BYTES = 256 << 20
BYTES_PER_CHAR = 64
TRIM_AFTER_BYTES = 32 << 20  # evicted since the last trim: then the freed heap goes back to the OS
# llguidance's default limits (2,000 Earley items a row, 50,000 a mask step), with errors that name the
# problem without the parser state and the whole grammar (a 5,000-property schema's error ran to 200 KB)
LIMITS = llguidance.LLParserLimits(verbose_errors=False)


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
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(choice_lark(params.choice or ()))
    return llguidance.LLMatcher.grammar_from_lark(grammar_lark(params.grammar or ""))


def choice_lark(choices: tuple[str, ...]) -> str:
    """One terminal, an alternation of literals (JSON escapes are Lark's too). A terminal is one
    lexeme, matched by the lexer's automaton; as a rule's alternatives each choice would be an
    Earley item, and past 2,000 of them the parser gives up at the first token."""
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices)


_GBNF_RULE = re.compile(r"(?m)^[ \t]*([A-Za-z][A-Za-z0-9_-]*)[ \t]*::=")


def grammar_lark(text: str) -> str:
    """Lark as is; GBNF (llama.cpp's, the EBNF vLLM's xgrammar backend takes) converted to Lark.
    Raises ValueError for a rule defined twice (the converter would keep the last silently) and for
    rules that can never finish (see `termination.py`)."""
    converted = not is_lark_syntax(text)
    if converted:
        names = _GBNF_RULE.findall(text)
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"rule {', '.join(twice)} is defined more than once")
        text = any_to_lark(text)
    endless = never_finishing_rules(text)
    if endless and converted:  # GBNF's `root` is Lark's `start`
        endless = ["root" if name == "start" else name for name in endless]
    if endless:
        raise ValueError(
            f"rule {', '.join(endless)} can never finish: every alternative leads back to a rule "
            f'that cannot finish (give the recursion a base case, e.g. `a: "x" a | "x"`)'
        )
    return text


def _json_layout(params: StructuredOutputsParams) -> dict[str, Any]:
    """Separators as `json.dumps` writes them; whitespace only where the request allows it."""
    layout: dict[str, Any] = {
        "item_separator": ", ",
        "key_separator": ": ",
        "whitespace_flexible": params.any_whitespace or params.whitespace_pattern is not None,
    }
    if params.whitespace_pattern is not None:
        layout["whitespace_pattern"] = params.whitespace_pattern
    return layout


class GrammarMatcher:
    """One sequence's position in its grammar. `source` names the request field the constraint
    came from: a matcher that fails (a parser limit reached while generating) raises GrammarError."""

    def __init__(self, matcher: llguidance.LLMatcher, source: str = "structured_outputs"):
        self._matcher = matcher
        self.source = source

    def fork(self) -> GrammarMatcher:
        return GrammarMatcher(self._matcher.deep_copy(), self.source)

    def accept(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise self._failure(f"the constraint rejected token {token_id}")

    @property
    def is_finished(self) -> bool:
        """Nothing but end-of-sequence can follow: the output is complete."""
        return self._matcher.is_stopped()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        llnumpy.fill_next_token_bitmask(self._matcher, bitmask.numpy(), row)  # a view: fills the tensor
        if self._matcher.is_error():  # its mask then allows only the end: an empty or cut answer, not ours
            raise self._failure("the constraint's parser stopped computing the next token's mask")

    def _failure(self, what: str) -> GrammarError:
        error = self._matcher.get_error().replace("<non-verbose/>", "").strip() or "the parser stopped"
        return GrammarError(f"{self.source}: {what}: {error}", self.source)


class CompiledGrammar:
    """A validated grammar and a template matcher at its start, its first mask computed: each
    sequence's matcher is a copy."""

    def __init__(self, template: llguidance.LLMatcher, source: str):
        self._template = template
        self.source = source

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy(), self.source)


class GrammarCompiler:
    """Constraints -> compiled grammars, cached; the llguidance tokenizer is built on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self.cached_bytes = 0  # estimated, of the entries in the cache
        self._evicted_bytes = 0  # estimated, since the heap was last trimmed
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
            self.cached_bytes += estimated_bytes(key)
            self._evict_beyond_bounds()
            return compiled

    def _evict_beyond_bounds(self) -> None:
        """Least recently used first, never the newest; the freed heap is handed back in batches."""
        while len(self._cache) > 1 and (len(self._cache) > CACHE_SIZE or self.cached_bytes > CACHE_BYTES):
            key, _ = self._cache.popitem(last=False)
            self.cached_bytes -= estimated_bytes(key)
            self._evicted_bytes += estimated_bytes(key)
        if self._evicted_bytes >= TRIM_AFTER_BYTES:
            self._evicted_bytes = 0
            release_free_heap()

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        tokenizer = self._llg_tokenizer(params)
        invalid = f"{params.source}: invalid {_NAMES[params.kind]}"
        try:
            grammar = to_llguidance(params)
            error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=LIMITS)
            if error:
                raise GrammarError(f"{invalid}: {error.strip()}", params.source)
            template = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
            GrammarMatcher(template, params.source).fill_mask(allocate_bitmask(1, self.vocab_size), 0)
        except GrammarError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever a constraint makes the converter or llguidance raise
            raise GrammarError(f"{invalid}: {exc}", params.source) from None
        return CompiledGrammar(template, params.source)

    def _llg_tokenizer(self, params: StructuredOutputsParams) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            if self._hf_tokenizer is None:
                raise GrammarError(
                    f"{params.source}: structured outputs need the model's tokenizer, and this engine runs without one",
                    params.source,
                )
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
            # building it serialises the whole tokenizer; the engine's malloc settings keep such freed
            # memory for reuse, which held ~46 MiB of RSS for good (measured): hand it back, once
            release_free_heap()
        return self._tokenizer


def estimated_bytes(cache_key: str) -> int:
    """A compiled grammar's memory, from its constraint's length (see BYTES_PER_CHAR)."""
    return len(cache_key) * BYTES_PER_CHAR


_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regular expression",
    "choice": "choice list",
    "grammar": "grammar",
}


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.from_numpy(llnumpy.allocate_token_bitmask(rows, vocab_size))


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: disallowed tokens' logits become -inf. (llguidance's own version is wrapped in
    `torch.compile`: a C++ compile at first use, a system compiler required, and measured here at
    16 ms a call for one row; unpacking the bits with plain tensor ops costs well under 1 ms.)"""
    bits = _BITS.to(bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).view(bitmask.shape[0], -1)[:, : logits.shape[1]]
    logits.masked_fill_(allowed.to(logits.device) == 0, float("-inf"))
