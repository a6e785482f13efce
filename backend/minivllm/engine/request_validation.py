"""Checks a request must pass before it is queued, so that nothing can wait forever."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.arith import ceil_div
from minivllm.errors import RequestRejectedError
from minivllm.sampling.params import SamplingParams
from minivllm.text.bad_words import bad_words_token_ids


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the model's and the engine's configured sizes."""

    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_stop_strings: int
    max_stop_chars: int
    chunked_prefill: bool = True  # off: a prompt (or a recompute) must fit one step's token budget
    # a sliding KV window (core/kv_window.py): the most tokens a sequence's cache holds (0: no window). A
    # request may then run past max_model_len; max_tokens defaults to max_model_len new tokens.
    kv_window: int = 0
    # the model's sliding-window attention (Mistral): a sequence holds only its window's blocks (0: none)
    attention_window: int = 0


def validate_request(ids: list[int], params: SamplingParams, limits: RequestLimits) -> int:
    """Returns the effective max_tokens; raises RequestRejectedError with both numbers on failure."""
    params.validate()
    limit, vocab = limits.max_model_len, limits.vocab_size
    _check_stop_list(params, limits)
    if params.top_k > vocab:
        raise RequestRejectedError(
            f"top_k must be -1 or 0 (disabled) or at most the vocabulary size {vocab}, got {params.top_k}", "top_k"
        )
    for field_name, token_ids in (
        ("logit_bias", params.logit_bias or {}),
        ("allowed_token_ids", params.allowed_token_ids or ()),
    ):
        bad_ids = [t for t in token_ids if t >= vocab]
        if bad_ids:
            raise RequestRejectedError(
                f"{field_name} token id {bad_ids[0]} is out of range for vocabulary size {vocab}", field_name
            )
    if not ids:
        raise RequestRejectedError("the prompt is empty", "prompt")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise RequestRejectedError(f"prompt token id {bad[0]} is out of range for vocabulary size {vocab}", "prompt")
    if limits.kv_window:
        return _windowed_max_tokens(ids, params, limits)
    if len(ids) >= limit:
        raise RequestRejectedError(
            f"the prompt is {len(ids)} tokens long, which does not fit this model's maximum context length "
            f"(max_model_len) of {limit} tokens",
            "prompt",
        )
    max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
    if len(ids) + max_tokens > limit:
        raise RequestRejectedError(
            f"this model's maximum context length is {limit} tokens, but {len(ids) + max_tokens} were requested "
            f"({len(ids)} in the prompt and {max_tokens} for the completion); reduce the prompt or max_tokens",
            "max_tokens",
        )
    _check_fits_pool(len(ids), max_tokens, params, limits)
    if not limits.chunked_prefill and len(ids) + max_tokens > limits.max_num_batched_tokens:
        raise RequestRejectedError(
            f"with chunked prefill off a request must fit one step's token budget (max_num_batched_tokens "
            f"{limits.max_num_batched_tokens}): a recompute after preemption runs its prompt and output at once, "
            f"but {len(ids)} prompt + {max_tokens} new tokens were requested",
            "max_tokens",
        )
    return max_tokens


def _windowed_max_tokens(ids: list[int], params: SamplingParams, limits: RequestLimits) -> int:
    """Under a KV window any length fits (the cache keeps at most `limits.kv_window` tokens); what the
    window cannot serve is refused by name."""
    refused = {
        "n": params.n > 1 or params.use_beam_search,  # forks would share blocks the window shifts in place
        "prompt_logprobs": params.prompt_logprobs is not None,  # every prompt position against a full context
    }
    for name, bad in refused.items():
        if bad:
            raise RequestRejectedError(f"{name} is not supported with a KV window (--kv-window)", name)
    max_tokens = params.max_tokens if params.max_tokens is not None else limits.max_model_len
    held = min(len(ids), limits.kv_window)
    _check_fits_pool(held, min(max_tokens, limits.kv_window - held), params, limits)
    return max_tokens


def tokenize_bad_words(params: SamplingParams, tokenizer) -> None:
    """vLLM's bad_words as token sequences, once per request (the sampler checks them every step)."""
    if params.bad_words and params.bad_words_token_ids is None:
        if tokenizer is None:
            raise RequestRejectedError("bad_words need a tokenizer; this model has none", "bad_words")
        params.bad_words_token_ids = bad_words_token_ids(tokenizer, params.bad_words)


def _check_stop_list(params: SamplingParams, config: RequestLimits) -> None:
    stop = params.stop or []
    if len(stop) > config.max_stop_strings:
        raise RequestRejectedError(f"stop must hold at most {config.max_stop_strings} strings, got {len(stop)}", "stop")
    total = sum(map(len, stop))
    if total > config.max_stop_chars:
        raise RequestRejectedError(
            f"stop strings must total at most {config.max_stop_chars} characters, got {total}", "stop"
        )


def _check_fits_pool(prompt_len: int, max_tokens: int, params: SamplingParams, cfg: RequestLimits) -> None:
    width = (params.beam_width or params.n) if params.use_beam_search else params.n
    if width > cfg.max_num_seqs:
        raise RequestRejectedError(
            f"the request runs {width} sequences at once but max_num_seqs is {cfg.max_num_seqs}", "n"
        )
    if width > cfg.max_num_batched_tokens:  # its sequences decode together: one token each per step
        raise RequestRejectedError(
            f"the request runs {width} sequences at once but max_num_batched_tokens is {cfg.max_num_batched_tokens}",
            "n",
        )
    # the prompt is shared; each sequence needs its own copy of the last partial block onwards
    span = prompt_len + max_tokens
    # one sequence under a model's window holds at once a window, a step's chunk and a partial block (a
    # resuming fork recomputes its whole shared prefix: not bounded so)
    if cfg.attention_window and cfg.chunked_prefill and width == 1:
        span = min(span, cfg.attention_window - 1 + cfg.max_num_batched_tokens + cfg.block_size)
    needed = ceil_div(span, cfg.block_size) + (width - 1) * (ceil_div(max_tokens, cfg.block_size) + 1)
    if needed > cfg.num_blocks:
        raise RequestRejectedError(
            f"the request needs up to {needed} KV blocks ({prompt_len} prompt tokens + {max_tokens} new tokens "
            f"x {width} sequence(s), block size {cfg.block_size}) but the whole KV pool has {cfg.num_blocks} blocks",
            "max_tokens",
        )


def validate_pooling_prompt(ids: list[int], limits: RequestLimits) -> None:
    """A pooling request's prompt (it generates nothing, so it may fill the whole context)."""
    limit, vocab = limits.max_model_len, limits.vocab_size
    if limits.kv_window:  # pooling reads states by absolute position; a window's are cache positions
        raise RequestRejectedError("pooling requests are not supported with a KV window (--kv-window)", "model")
    if not ids:
        raise RequestRejectedError("the prompt is empty", "prompt")
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestRejectedError(f"prompt token id {bad} is out of range for vocabulary size {vocab}", "prompt")
    if len(ids) > limit:
        raise RequestRejectedError(
            f"the prompt is {len(ids)} tokens long, more than this model's maximum context "
            f"length (max_model_len) of {limit} tokens",
            "prompt",
        )
    needed = ceil_div(len(ids), limits.block_size)
    if needed > limits.num_blocks:
        raise RequestRejectedError(
            f"the prompt needs {needed} KV blocks (block size {limits.block_size}) but the "
            f"whole KV pool has {limits.num_blocks} blocks",
            "prompt",
        )
