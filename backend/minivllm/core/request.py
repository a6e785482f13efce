"""Requests and their sequences: the plain objects all scheduling state lives on.

A sequence's progress is one rule (as in vLLM v1): `num_computed` catches up with `num_tokens`.
A prefill chunk, a decode step and a recompute after preemption are all the same thing: run the
tokens in [num_computed, num_tokens). The step in which a sequence catches up gives its logits.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from minivllm.core.block_manager import hash_block_tokens, hash_salt
from minivllm.core.pooling import PromptPooling
from minivllm.core.prompt_logprobs import PromptLogprobs
from minivllm.sampling.beam_search import BeamSearchState
from minivllm.sampling.params import SamplingParams
from minivllm.structured.grammar import CompiledGrammar, GrammarMatcher
from minivllm.text.detokenizer import IncrementalDetokenizer
from minivllm.text.stop_strings import StopStringMatcher


class RequestStatus(str, enum.Enum):
    WAITING = "WAITING"
    PREFILL = "PREFILL"
    DECODE = "DECODE"
    PREEMPTED = "PREEMPTED"
    FINISHED = "FINISHED"


_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    request: Request
    token_ids: list[int]
    num_prompt_tokens: int
    parent_seq_id: int | None = None
    sample_index: int = 0  # which of the request's n samples this is
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed: int = 0
    dropped: int = 0  # tokens a sliding KV window dropped from its cache (core/kv_window.py)
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    stop_matcher: StopStringMatcher | None = None
    text: str = ""
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token: chosen + top-N
    cumulative_logprob: float = 0.0
    reported_text_len: int = 0  # how much of `text` / tokens earlier outputs already carried
    reported_tokens: int = 0
    reported_logprobs: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    _block_hashes: list[int] = field(default_factory=list, repr=False)
    # speculative decoding: tokens proposed to follow `token_ids`, verified in the next step, and
    # the draft's distributions they were drawn from ([k, vocab]; None: chosen deterministically)
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    grammar: GrammarMatcher | None = None  # structured outputs: where the output stands in its grammar

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_remaining(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of the full blocks of `token_ids`, kept as the sequence grows (vLLM's
        `request.block_hashes`), so admission and prefix-cache commits never rehash a block."""
        hashes = self._block_hashes
        for i in range(len(hashes), self.num_tokens // block_size):
            tokens = tuple(self.token_ids[i * block_size : (i + 1) * block_size])
            hashes.append(hash_block_tokens(hashes[-1] if hashes else self.request.salt_hash, tokens))
        return hashes

    def clear_drafts(self) -> None:
        self.draft_token_ids, self.draft_probs = [], None

    def inherit_block_hashes(self, parent: Sequence) -> None:
        """A fork starts with its parent's tokens: their hashes carry over."""
        self._block_hashes = list(parent._block_hashes)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    max_tokens: int = 16  # params.max_tokens, or what max_model_len leaves when that is None
    priority: int = 0  # lower runs first, as in vLLM
    status: RequestStatus = RequestStatus.WAITING
    seqs: list[Sequence] = field(default_factory=list)  # live sequences
    finished_seqs: list[Sequence] = field(default_factory=list)
    beam: BeamSearchState | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    num_cached_prompt_tokens: int = 0
    restored_tokens: int = 0  # of its cached prefix, tokens the disk tier read back since it last waited
    num_preemptions: int = 0
    num_generated_events: int = 0  # tokens reported so far, over all sequences
    preview: str = ""  # first characters of the prompt, for display
    forked: bool = False  # n > 1 requests fork their samples once the prompt is computed
    # After a preemption, a request with several sequences recomputes their common prefix once, in
    # its first sequence; the others are forked from it at this many tokens (None: nothing pending).
    refork_at: int | None = None
    error: str | None = None  # why the request failed inside the engine (it then finished as "abort")
    error_param: str | None = None  # the request field at fault when the failure is the client's (a 400)
    prompt_logprobs: PromptLogprobs | None = None  # gathered when params.prompt_logprobs asks for them
    grammar: CompiledGrammar | None = None  # structured outputs: each sequence gets a matcher of it
    cache_salt: str | None = None  # vLLM's: requests share cached prefix blocks only under the same salt
    pooling: PromptPooling | None = None  # a pooling request (embeddings): samples nothing, see core/pooling.py

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = PromptLogprobs(self.params.prompt_logprobs, len(self.prompt_token_ids))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def salt_hash(self) -> int | None:
        """The parent of the first block's chained hash: a salt changes every block's hash after it."""
        return None if self.cache_salt is None else hash_salt(self.cache_salt)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def num_remaining_tokens(self) -> int:
        if self.refork_at is None:
            return sum(s.num_remaining for s in self.seqs)
        # followers will be forked at refork_at: only their own tails remain for them
        return self.seqs[0].num_remaining + sum(s.num_tokens - self.refork_at for s in self.seqs[1:])

    @property
    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.arrival_time)

    def common_prefix_len(self) -> int:
        """Tokens all live sequences agree on, leaving each at least one token to compute (the
        sequences of a request are sampled together, so each needs its own logits)."""
        first = self.seqs[0].token_ids
        shared = min(s.num_tokens for s in self.seqs) - 1
        for other in self.seqs[1:]:
            shared = next((i for i in range(shared) if other.token_ids[i] != first[i]), shared)
        return shared

    def all_seqs(self) -> list[Sequence]:
        return self.seqs + self.finished_seqs
