"""Turning OpenAI requests into engine calls and RequestOutputs into OpenAI responses and chunks."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import msgspec

from minivllm.engine.api import CompletionOutput, RequestFailedError, RequestOutput
from minivllm.sampling.params import SamplingParams
from minivllm.server import openai_protocol as p
from minivllm.server.api_types import RequestTimings
from minivllm.server.errors import bad_request, error_body

log = logging.getLogger("minivllm.server")

_encoder = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"
_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_params(req: p.SamplingFields, max_tokens: int | None, logprobs: int | None,
                    names: dict[str, str] | None = None) -> SamplingParams:
    """The request's SamplingParams; out-of-range values become a 400 naming the field."""
    kwargs: dict[str, Any] = dict(
        n=req.n, stop=req.stop, seed=req.seed, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, max_tokens=max_tokens, min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos, stop_token_ids=req.stop_token_ids, logprobs=logprobs,
        use_beam_search=req.use_beam_search, length_penalty=req.length_penalty,
        skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output)
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
        out.append({"role": m.role, "content": content})
    return out


def completion_prompt(req: p.CompletionRequest) -> tuple[str | None, list[int] | None]:
    """A string or a list of token ids; a batch of one is unwrapped, larger batches are refused."""
    prompt = req.prompt
    if isinstance(prompt, list) and any(isinstance(x, (str, list)) for x in prompt):
        if len(prompt) != 1:
            raise bad_request("batched prompts are not supported: send one request per prompt", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, None
    if not all(isinstance(x, int) for x in prompt):
        raise bad_request("prompt must be a string or a list of token ids", "prompt")
    return None, list(prompt)


# ---- shared pieces ---------------------------------------------------------------------------


def timings(out: RequestOutput) -> RequestTimings:
    m = out.metrics
    generated = out.num_generated_tokens
    decode_s = (m.finished_time - m.first_token_time) if m.finished_time and m.first_token_time else None
    # tokens after each sample's first, per second of decoding
    rate = (generated - len(out.outputs)) / decode_s if decode_s and generated > len(out.outputs) else None
    return RequestTimings(ttft_s=m.ttft, queue_s=m.queue_time, e2e_s=m.e2e_latency, tokens_per_s=rate,
                          prompt_tokens=len(out.prompt_token_ids), cached_prompt_tokens=m.num_cached_tokens,
                          generated_tokens=generated, num_preemptions=m.num_preemptions)


def usage(out: RequestOutput) -> p.Usage:
    prompt, completion = len(out.prompt_token_ids), out.num_generated_tokens
    return p.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=p.PromptTokensDetails(cached_tokens=out.metrics.num_cached_tokens))


def sse(payload: Any) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


class TokenText:
    """Token id -> its text, for logprobs (cached; the tokenizer's decode is read-only)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"<{token_id}>"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(entries: list[dict[int, float]], top_n: int, tokens: TokenText) -> p.ChatLogprobs:
    content = []
    for d in entries:
        items = list(d.items())  # the chosen token first, then the top-N (it may be among them)
        chosen_id, chosen_lp = items[0]
        top = sorted(items[1:] if len(items) > top_n else items, key=lambda kv: -kv[1])[:top_n]
        chosen = tokens.text(chosen_id)
        content.append(p.TokenLogprob(
            token=chosen, logprob=chosen_lp, bytes=list(chosen.encode()),
            top_logprobs=[p.TopLogprob(token=(t := tokens.text(i)), logprob=lp, bytes=list(t.encode()))
                          for i, lp in top]))
    return p.ChatLogprobs(content=content)


def completion_logprobs(entries: list[dict[int, float]], tokens: TokenText, offset: int = 0) -> p.CompletionLogprobs:
    out = p.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for d in entries:
        chosen_id, chosen_lp = next(iter(d.items()))
        text = tokens.text(chosen_id)
        out.tokens.append(text)
        out.token_logprobs.append(chosen_lp)
        out.top_logprobs.append({tokens.text(i): lp for i, lp in d.items()})
        out.text_offset.append(offset)
        offset += len(text)
    return out


# ---- one request's response ------------------------------------------------------------------


class _Format:
    """What both response shapes share: a chunk's header and the closing usage chunk."""

    chunk_type: type[p.ChatCompletionChunk] | type[p.CompletionChunk]

    def _chunk(self, job: "Job", choices: list, **extra):
        return self.chunk_type(id=job.response_id, created=job.created, model=job.model, choices=choices, **extra)

    def usage_chunk(self, job: "Job", out: RequestOutput):
        return self._chunk(job, [], usage=usage(out), timings=timings(out))


class ChatFormat(_Format):
    """OpenAI's chat completion shapes."""

    chunk_type = p.ChatCompletionChunk

    def response(self, job: "Job", out: RequestOutput, outputs: list[CompletionOutput]) -> p.ChatCompletionResponse:
        choices = [p.ChatChoice(index=o.index, message=p.ChatResponseMessage(content=o.text),
                                logprobs=self._logprobs(job, o.logprobs), finish_reason=o.finish_reason,
                                stop_reason=o.stop_reason) for o in outputs]
        return p.ChatCompletionResponse(id=job.response_id, created=job.created, model=job.model, choices=choices,
                                        usage=usage(out), timings=timings(out))

    def chunk(self, job: "Job", o: CompletionOutput, text_offset: int) -> p.ChatCompletionChunk:
        choice = p.ChatChunkChoice(index=o.index, delta=p.DeltaMessage(content=o.text),
                                   logprobs=self._logprobs(job, o.logprobs), finish_reason=o.finish_reason)
        return self._chunk(job, [choice])

    def opening_chunks(self, job: "Job") -> list[p.ChatCompletionChunk]:
        """The role comes first, once per choice."""
        return [self._chunk(job, [p.ChatChunkChoice(index=i, delta=p.DeltaMessage(role="assistant", content=""))])
                for i in range(job.params.n)]

    @staticmethod
    def _logprobs(job: "Job", entries: list[dict[int, float]] | None) -> p.ChatLogprobs | None:
        return chat_logprobs(entries, job.top_logprobs, job.tokens) if entries is not None else None


class CompletionFormat(_Format):
    """OpenAI's (legacy) text completion shapes."""

    chunk_type = p.CompletionChunk

    def response(self, job: "Job", out: RequestOutput, outputs: list[CompletionOutput]) -> p.CompletionResponse:
        return p.CompletionResponse(id=job.response_id, created=job.created, model=job.model,
                                    choices=[self._choice(job, o, 0) for o in outputs], usage=usage(out),
                                    timings=timings(out))

    def chunk(self, job: "Job", o: CompletionOutput, text_offset: int) -> p.CompletionChunk:
        return self._chunk(job, [self._choice(job, o, text_offset)])

    def opening_chunks(self, job: "Job") -> list[p.CompletionChunk]:
        return []

    @staticmethod
    def _choice(job: "Job", o: CompletionOutput, text_offset: int) -> p.CompletionChoice:
        logprobs = completion_logprobs(o.logprobs, job.tokens, text_offset) if o.logprobs is not None else None
        return p.CompletionChoice(index=o.index, text=o.text, logprobs=logprobs, finish_reason=o.finish_reason,
                                  stop_reason=o.stop_reason)


CHAT, COMPLETION = ChatFormat(), CompletionFormat()


@dataclass
class Job:
    """What a handler hands to the response builders."""

    format: ChatFormat | CompletionFormat
    response_id: str
    model: str
    params: SamplingParams
    tokens: TokenText
    top_logprobs: int = 0  # chat: how many alternatives to list
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


def full_response(job: Job, out: RequestOutput) -> p.ChatCompletionResponse | p.CompletionResponse:
    """`out`: the whole output (the engine's deltas accumulated)."""
    return job.format.response(job, out, [o for o in out.outputs if o.index < job.params.n])


class StreamState:
    """Per choice: the text already sent (completion logprobs count offsets from it), and whether
    its finish_reason went out."""

    def __init__(self, n: int):
        self.text_offset = [0] * n
        self.done = [False] * n


def chunks_for(job: Job, out: RequestOutput, state: StreamState) -> list[bytes]:
    """The SSE chunks for one engine output (a delta): one chunk per choice that has news."""
    result = []
    for o in out.outputs:
        i = o.index
        if i >= job.params.n or state.done[i]:
            continue
        if not o.text and o.finish_reason is None and not o.logprobs:
            continue
        result.append(sse(job.format.chunk(job, o, state.text_offset[i])))
        state.text_offset[i] += len(o.text)
        state.done[i] = o.finish_reason is not None
    return result


async def sse_stream(job: Job, first: RequestOutput, rest: AsyncIterator[RequestOutput],
                     on_finished) -> AsyncIterator[bytes]:
    """The whole SSE body. Closing this generator closes `rest`, which aborts the request."""
    state = StreamState(job.params.n)
    try:
        for opening in job.format.opening_chunks(job):
            yield sse(opening)
        out = first
        while True:
            for chunk in chunks_for(job, out, state):
                yield chunk
            if out.finished:
                break
            try:
                out = await rest.__anext__()
            except StopAsyncIteration:
                break
        if out.finished:
            on_finished(out)
        if job.include_usage:
            yield sse(job.format.usage_chunk(job, out))
    except RequestFailedError as exc:  # the engine's own account: this request failed, the others go on
        yield sse(error_body(500, str(exc), code="request_failed"))
    except Exception as exc:  # noqa: BLE001 - the status line is gone: report in the stream
        log.exception("internal error while streaming %s", job.response_id)
        yield sse(error_body(500, f"internal error while generating ({type(exc).__name__}); the server log has "
                                  f"the details under {job.response_id}", code="internal_error"))
    finally:
        await rest.aclose()
    yield DONE
