"""An OpenAI request's fields as engine inputs: its SamplingParams, its chat messages, and the
options its response is rendered with. The routes read a request here, top to bottom, then hand
the engine's outputs to `openai_serving.py`, which only renders responses."""

from __future__ import annotations

from typing import Any

from minivllm.engine.api import StructuredOutputsParams
from minivllm.sampling.params import SamplingParams
from minivllm.server import openai_protocol as p
from minivllm.server.errors import bad_request
from minivllm.server.structured_request import structured_outputs
from minivllm.server.tools import ToolPlan, render_tool_calls
from minivllm.server.vllm_fields import samples_to_draw

_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_params(
    req: p.SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    names: dict[str, str] | None = None,
    structured: StructuredOutputsParams | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The request's SamplingParams; out-of-range values become a 400 naming the field."""
    kwargs: dict[str, Any] = dict(
        logit_bias=req.logit_bias,
        structured_outputs=structured,
        prompt_logprobs=prompt_logprobs,
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words,
        n=samples_to_draw(req),
        stop=req.stop,
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        stop_token_ids=req.stop_token_ids,
        logprobs=logprobs,
        use_beam_search=req.use_beam_search,
        length_penalty=req.length_penalty,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
    )
    kwargs.update({k: getattr(req, k) for k in _OPTIONAL if getattr(req, k) is not None})
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        field_name = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), (names or {}).get(field_name, field_name)) from None


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's


def chat_messages(req: p.ChatCompletionRequest) -> list[dict[str, str]]:
    if not req.messages:
        raise bad_request("messages must contain at least one message", "messages")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.role!r}", "messages")
        if isinstance(m.content, list):
            if any(part.type != "text" for part in m.content):
                raise bad_request(f"messages[{i}]: only text content parts are supported", "messages")
            content = "".join(part.text or "" for part in m.content)
        else:
            content = m.content or ""
        if m.tool_calls:
            content = render_tool_calls(content, m.tool_calls)
        out.append({"role": m.role, "content": content})
    return out


def chat_params(req: p.ChatCompletionRequest, tools: ToolPlan | None) -> SamplingParams:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    use_completion = req.max_completion_tokens is not None
    max_tokens = req.max_completion_tokens if use_completion else req.max_tokens
    names = {"max_tokens": "max_completion_tokens" if use_completion else "max_tokens", "logprobs": "top_logprobs"}
    structured = structured_outputs(req)
    if tools is not None and tools.forced:
        if structured is not None:
            raise bad_request(
                "tool_choice required or named forces a tool call; it cannot be combined with a "
                "structured-output constraint",
                "tool_choice",
            )
        structured = tools.grammar()
    if req.prompt_logprobs and req.stream:  # vLLM's rule
        raise bad_request("`prompt_logprobs` are not available when `stream=True`", "prompt_logprobs")
    return sampling_params(
        req,
        max_tokens,
        (req.top_logprobs or 0) if req.logprobs else None,
        names,
        structured,
        prompt_logprobs=None if req.stream else req.prompt_logprobs,
    )


def job_options(req: p.SamplingFields) -> dict:
    """The response options both routes read off the request the same way."""
    opts = req.stream_options
    return dict(
        include_usage=bool(opts and opts.include_usage),
        continuous_usage=bool(opts and opts.continuous_usage_stats),
        shown_n=req.n,
        return_token_ids=bool(req.return_token_ids),
    )
