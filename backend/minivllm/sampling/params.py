"""Per-request decoding parameters (names and defaults follow vLLM's ``SamplingParams``)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from minivllm.structured.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1  # a torch generator seed is an int64; sample i of a request uses seed + i
MAX_LENGTH_PENALTY = 10.0  # generated_len ** length_penalty must stay a finite float
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it
MAX_BAD_WORDS = 1024  # each is tokenized on arrival and checked at every step: bounded
MAX_BAD_WORD_CHARS = 256


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    """A finite int or float (NaN and infinities would poison every logit they touch)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class SamplingParams:
    """How to pick the tokens of one request.

    ``top_k`` of 0 or -1 disables top-k. ``stop`` is normalised to a list of strings and
    ``stop_token_ids`` to a list of ints. ``logprobs=N`` asks for the top-N alternatives of each
    generated token (0 = only the chosen token's logprob). With ``use_beam_search``,
    ``beam_width`` defaults to ``n`` and temperature / top-k / top-p / min-p are ignored.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI semantics)
    prompt_logprobs: int | None = None  # top-N alternatives at each prompt position (0: the prompt token only)
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled (vLLM's)
    bad_words: list[str] | None = None  # never generated (vLLM's): each word's last token is banned after its others
    bad_words_token_ids: list[list[int]] | None = None  # their tokenizations; filled by the engine from bad_words

    def __post_init__(self) -> None:
        # Normalise.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.bad_words = list(self.bad_words) if self.bad_words else None
        if self.logit_bias is not None:
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()} or None
        if self.use_beam_search and self.beam_width is None:
            self.beam_width = self.n
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending field and value."""
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not _is_number(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not (self.top_k in (-1, 0) or self.top_k >= 1):
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if not _is_number(self.presence_penalty) or not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        if not _is_number(self.frequency_penalty) or not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        width = max(self.n, self.beam_width if _is_int(self.beam_width) else 1)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED - (width - 1)):
            raise ValueError(
                f"seed must be an integer in [0, {MAX_SEED - (width - 1)}] (2**63 - 1 less one per "
                f"extra sample), got {self.seed!r}"
            )
        if not all(isinstance(s, str) for s in self.stop):  # type: ignore[union-attr]
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):  # type: ignore[union-attr]
            raise ValueError(f"stop must not contain empty strings, got {self.stop!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):  # type: ignore[union-attr]
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        if not _is_number(self.length_penalty) or abs(self.length_penalty) > MAX_LENGTH_PENALTY:
            raise ValueError(
                f"length_penalty must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], "
                f"got {self.length_penalty!r}"
            )
        if self.beam_width is not None and (not _is_int(self.beam_width) or self.beam_width < 1):
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        self._validate_extras()
        if self.use_beam_search:
            assert self.beam_width is not None
            if self.n > self.beam_width:
                raise ValueError(f"n must be <= beam_width={self.beam_width} for beam search, got {self.n!r}")

    def _validate_token_lists(self) -> None:
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or not all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)
        ):
            raise ValueError(
                f"allowed_token_ids must be a non-empty list of token ids (integers >= 0), "
                f"got {self.allowed_token_ids!r}"
            )
        if self.bad_words is not None:
            if len(self.bad_words) > MAX_BAD_WORDS or not all(isinstance(w, str) for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of at most {MAX_BAD_WORDS} strings")
            if any(not w.strip() or len(w) > MAX_BAD_WORD_CHARS for w in self.bad_words):
                raise ValueError(f"bad_words must hold non-blank strings of at most {MAX_BAD_WORD_CHARS} characters")

    def _validate_extras(self) -> None:
        self._validate_token_lists()
        for token, bias in (self.logit_bias or {}).items():
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not _is_number(bias) or abs(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.prompt_logprobs!r}")
        if self.structured_outputs is not None and self.use_beam_search:
            raise ValueError(
                "structured_outputs cannot be combined with beam search (use_beam_search): a beam "
                "keeps the most likely continuations, which a grammar mask would have to follow per "
                "beam; use sampling or greedy decoding"
            )

    # ------------------------------------------------------------------ helpers
    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS and not self.use_beam_search

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def reads_output_tokens(self) -> bool:
        """Only penalties, min_tokens and bad words read a sequence's output so far: skip copying it otherwise."""
        return self.needs_penalties or self.min_tokens > 0 or bool(self.bad_words_token_ids)

    @property
    def effective_top_k(self) -> int:
        """top-k with the "off" values (0, -1) mapped to 0."""
        return self.top_k if self.top_k > 0 else 0


_INTEGER = re.compile(r"-?[0-9]+")


def _token_key(key: object) -> object:
    """JSON object keys are strings: OpenAI's logit_bias sends {"50256": -100}. ASCII digits only:
    `str.isdigit` also takes "²", which `int` then refuses (the key stays, and validation names it)."""
    if isinstance(key, str) and _INTEGER.fullmatch(key.strip()):
        return int(key)
    return key
