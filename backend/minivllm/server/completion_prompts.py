"""What /v1/completions does with its prompts beyond generating: a list of prompts in one request,
`echo` (the prompt returned before the completion, its tokens in `logprobs` too) and vLLM's
`prompt_logprobs`, all from the engine's `RequestOutput.prompt_logprobs`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from minivllm.engine.api import RequestOutput
from minivllm.server import openai_protocol as p
from minivllm.server.errors import bad_request

Prompt = tuple[str | None, list[int] | None]  # (text, None) or (None, token ids)
TextOf = Callable[[int], str]  # a token id's text


def completion_prompts(prompt: str | list, max_prompts: int) -> list[Prompt]:
    """OpenAI's prompt: a string, a list of token ids, or a list of either (one engine request each)."""
    if isinstance(prompt, str):
        return [(prompt, None)]
    if all(isinstance(x, int) for x in prompt):
        return [(None, list(prompt))]
    if not all(isinstance(x, str) or (isinstance(x, list) and all(isinstance(t, int) for t in x)) for x in prompt):
        raise bad_request(
            "prompt must be a string, a list of token ids, or a list of strings or of token-id lists", "prompt"
        )
    if len(prompt) > max_prompts:
        raise bad_request(
            f"prompt is a list of {len(prompt)} prompts; this server runs at most {max_prompts} per "
            f"request (max_num_seqs): send the rest in another request",
            "prompt",
        )
    return [(x, None) if isinstance(x, str) else (None, list(x)) for x in prompt]


def engine_prompt_logprobs(req: p.CompletionRequest) -> int | None:
    """The top-N the engine gathers at each prompt position: what vLLM's `prompt_logprobs` asks for,
    or what `echo` with `logprobs` shows, whichever is more (None: neither)."""
    wanted = []
    if req.prompt_logprobs is not None:
        if req.stream and req.prompt_logprobs != 0:  # vLLM's rule
            raise bad_request("`prompt_logprobs` are not available when `stream=True`", "prompt_logprobs")
        if not req.stream:
            wanted.append(req.prompt_logprobs)
    if req.echo and req.logprobs is not None:
        wanted.append(req.logprobs)
    return max(wanted, default=None)  # type: ignore[type-var]


def _alternatives(entry: dict[int, float], engine_n: int, n: int) -> list[tuple[int, float]]:
    """The `n` likeliest tokens of an entry (the prompt token first, then the engine's top-N, which
    may include it), most likely first."""
    items = list(entry.items())
    top = items[1:] if len(items) > engine_n else items
    return sorted(top, key=lambda kv: -kv[1])[:n]


@dataclass
class EchoPart:
    """The prompt as a choice's text starts: its text, and its tokens' logprobs when asked."""

    text: str
    logprobs: p.CompletionLogprobs | None


def echo_part(
    out: RequestOutput,
    entries: list[dict[int, float] | None] | None,
    engine_n: int,
    logprobs: int | None,
    text_of: TextOf,
    decode: Callable[[list[int]], str],
) -> EchoPart:
    """OpenAI's echo: the prompt text (as sent, or the token ids decoded); with `logprobs`, one
    entry per prompt token, the first without a logprob (null), offsets from the prompt's start."""
    text = out.prompt if out.prompt is not None else decode(out.prompt_token_ids)
    if logprobs is None:
        return EchoPart(text, None)
    lp = p.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    offset = 0
    for i, token in enumerate(out.prompt_token_ids):
        entry = entries[i] if entries is not None and i < len(entries) else None
        token_text = text_of(token)
        lp.tokens.append(token_text)
        lp.text_offset.append(offset)
        offset += len(token_text)
        if entry is None:
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
            continue
        chosen = next(iter(entry.items()))
        lp.token_logprobs.append(chosen[1])
        lp.top_logprobs.append({text_of(t): v for t, v in [chosen, *_alternatives(entry, engine_n, logprobs)]})
    return EchoPart(text, lp)


def with_echo(echo: EchoPart, completion: p.CompletionLogprobs | None) -> p.CompletionLogprobs | None:
    """The echoed prompt's logprobs followed by the completion's."""
    if echo.logprobs is None:
        return completion
    if completion is None:
        return echo.logprobs
    a, b = echo.logprobs, completion
    return p.CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


def vllm_prompt_logprobs(
    out: RequestOutput, engine_n: int, n: int, text_of: TextOf
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else {token id: {"logprob",
    "rank", "decoded_token"}}, the prompt token first (its rank in the whole vocabulary), then the
    top `n` (ranks 1..n)."""
    entries, ranks = out.prompt_logprobs, out.prompt_logprob_ranks
    if entries is None or ranks is None:
        return None
    result: list[dict[str, dict[str, Any]] | None] = []
    for entry, rank in zip(entries, ranks):
        if entry is None:
            result.append(None)
            continue
        token, lp = next(iter(entry.items()))
        row = {str(token): {"logprob": lp, "rank": rank, "decoded_token": text_of(token)}}
        for place, (alt, alt_lp) in enumerate(_alternatives(entry, engine_n, n), start=1):
            row.setdefault(str(alt), {"logprob": alt_lp, "rank": place, "decoded_token": text_of(alt)})
        result.append(row)
    return result


def without_generation(out: RequestOutput) -> RequestOutput:
    """The output with its samples emptied: echo with max_tokens 0 shows the prompt alone."""
    return replace(
        out,
        outputs=[
            replace(
                o,
                text="",
                token_ids=[],
                logprobs=None if o.logprobs is None else [],
                finish_reason=o.finish_reason and "length",
                stop_reason=None,
                num_tokens=0,
            )
            for o in out.outputs
        ],
    )
