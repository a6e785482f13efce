"""Checks a request must pass before it is queued, so that nothing can wait forever."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minivllm.sampling.params import SamplingParams

if TYPE_CHECKING:
    from minivllm.engine.llm_engine import LLMEngine


class RequestRejectedError(ValueError):
    """The request can never run on this engine (too long, too big for the KV pool, bad ids)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def validate_request(ids: list[int], params: SamplingParams, engine: "LLMEngine") -> int:
    """Returns the effective max_tokens; raises RequestRejectedError with both numbers on failure."""
    params.validate()
    limit, vocab = engine.max_model_len, engine.loaded.config.vocab_size
    _check_stop_list(params, engine.config)
    if params.top_k > vocab:
        raise RequestRejectedError(f"top_k must be -1 or 0 (disabled) or at most the vocabulary size {vocab}, "
                                   f"got {params.top_k}", "top_k")
    if not ids:
        raise RequestRejectedError("the prompt is empty", "prompt")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise RequestRejectedError(f"prompt token id {bad[0]} is out of range for vocabulary size {vocab}", "prompt")
    if len(ids) >= limit:
        raise RequestRejectedError(
            f"the prompt is {len(ids)} tokens long, which does not fit this model's maximum context length "
            f"(max_model_len) of {limit} tokens", "prompt")
    max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
    if len(ids) + max_tokens > limit:
        raise RequestRejectedError(
            f"this model's maximum context length is {limit} tokens, but {len(ids) + max_tokens} were requested "
            f"({len(ids)} in the prompt and {max_tokens} for the completion); reduce the prompt or max_tokens",
            "max_tokens")
    _check_fits_pool(len(ids), max_tokens, params, engine)
    return max_tokens


def _check_stop_list(params: SamplingParams, config) -> None:
    stop = params.stop or []
    if len(stop) > config.max_stop_strings:
        raise RequestRejectedError(f"stop must hold at most {config.max_stop_strings} strings, got {len(stop)}", "stop")
    if sum(map(len, stop)) > config.max_stop_chars:
        raise RequestRejectedError(f"stop strings must total at most {config.max_stop_chars} characters, "
                                   f"got {sum(map(len, stop))}", "stop")


def _check_fits_pool(prompt_len: int, max_tokens: int, params: SamplingParams, engine: "LLMEngine") -> None:
    width = (params.beam_width or params.n) if params.use_beam_search else params.n
    cfg, num_blocks = engine.config, engine.block_manager.num_blocks
    if width > cfg.max_num_seqs:
        raise RequestRejectedError(
            f"the request runs {width} sequences at once but max_num_seqs is {cfg.max_num_seqs}", "n")
    if width > cfg.max_num_batched_tokens:  # its sequences decode together: one token each per step
        raise RequestRejectedError(
            f"the request runs {width} sequences at once but max_num_batched_tokens is "
            f"{cfg.max_num_batched_tokens}", "n")
    # the prompt is shared; each sequence needs its own copy of the last partial block onwards
    needed = _blocks(prompt_len + max_tokens, cfg.block_size) + (width - 1) * (_blocks(max_tokens, cfg.block_size) + 1)
    if needed > num_blocks:
        raise RequestRejectedError(
            f"the request needs up to {needed} KV blocks ({prompt_len} prompt tokens + {max_tokens} new tokens "
            f"x {width} sequence(s), block size {cfg.block_size}) but the whole KV pool has {num_blocks} blocks",
            "max_tokens")
