"""vLLM's request fields that shape a request around the engine call: prompt truncation, `best_of`,
`cache_salt`, the request's own id, and token ids shown in place of (or beside) token text."""

from __future__ import annotations

from dataclasses import replace

from minivllm.engine.api import RequestOutput
from minivllm.server import openai_protocol as p
from minivllm.server.errors import bad_request
from minivllm.server.middleware import adopt_request_id

MAX_CACHE_SALT_CHARS = 1024


def truncated(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: as many as the context holds)."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len
    if keep < 1:
        raise bad_request(f"truncate_prompt_tokens must be -1 or >= 1, got {keep}", "truncate_prompt_tokens")
    if keep > max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens ({keep}) is greater than this model's context (max_model_len) "
            f"of {max_model_len} tokens",
            "truncate_prompt_tokens",
        )
    return ids[-keep:]


def samples_to_draw(req: p.SamplingFields) -> int:
    """How many samples the engine draws: `best_of` (the n best by cumulative log-prob are returned)
    or n. Streaming would have to show samples before knowing which are best: then best_of must equal n."""
    best_of = req.best_of
    if best_of is None or best_of == req.n:
        return req.n
    if not isinstance(best_of, int) or best_of < req.n:
        raise bad_request(f"best_of must be an integer >= n ({req.n}), got {best_of!r}", "best_of")
    if req.stream:
        raise bad_request(
            "best_of greater than n is not available with stream=true: the best samples are known only at the end",
            "best_of",
        )
    if req.use_beam_search:
        raise bad_request("best_of cannot be combined with beam search: the beam width is n", "best_of")
    return best_of


def best_samples(out: RequestOutput, n: int) -> RequestOutput:
    """The `n` samples with the highest cumulative log-probability, numbered 0..n-1 in that order."""
    if len(out.outputs) <= n:
        return out
    ranked = sorted(out.outputs, key=lambda o: -(o.cumulative_logprob or 0.0))[:n]
    return replace(out, outputs=[replace(o, index=i) for i, o in enumerate(ranked)])


def cache_salt(req: p.SamplingFields) -> str | None:
    salt = req.cache_salt
    if salt is not None and (not salt or len(salt) > MAX_CACHE_SALT_CHARS):
        raise bad_request(
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters", "cache_salt"
        )
    return salt


def adopt_body_request_id(scope, req: p.SamplingFields) -> None:
    """The body's `request_id` (vLLM's) names the request, as an X-Request-Id header does."""
    if req.request_id is not None:
        try:
            adopt_request_id(scope, req.request_id)
        except ValueError as exc:
            raise bad_request(str(exc), "request_id") from None
