"""RequestOutputs into OpenAI responses and stream chunks (the request side is `openai_inputs.py`)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

import msgspec

from minivllm.engine.api import CompletionOutput, EngineDeadError, RequestFailedError, RequestOutput
from minivllm.sampling.params import SamplingParams
from minivllm.server import openai_protocol as p
from minivllm.server.api_types import RequestTimings
from minivllm.server.completion_prompts import EchoPart, echo_part, vllm_prompt_logprobs, with_echo, without_generation
from minivllm.server.errors import error_body
from minivllm.server.streams import merged
from minivllm.server.tools import ToolCallStream, ToolPlan, parse_tool_calls
from minivllm.server.vllm_fields import best_samples

log = logging.getLogger("minivllm.server")

_encoder = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"
# ---- shared pieces ---------------------------------------------------------------------------


def timings(out: RequestOutput | list[RequestOutput]) -> RequestTimings:
    """One request's timings, or those of a list of prompts' requests taken as one: from the first
    arrival to the first token anywhere and to the last finish; counts summed."""
    outs = out if isinstance(out, list) else [out]
    ms = [o.metrics for o in outs]
    arrival = min(m.arrival_time for m in ms)
    scheduled, first_token = _earliest(m.first_scheduled_time for m in ms), _earliest(m.first_token_time for m in ms)
    finished = None if any(m.finished_time is None for m in ms) else max(m.finished_time for m in ms)  # type: ignore[type-var]
    generated = sum(o.num_generated_tokens for o in outs)
    samples = sum(len(o.outputs) for o in outs)
    decode_s = (finished - first_token) if finished and first_token else None
    # tokens after each sample's first, per second of decoding
    rate = (generated - samples) / decode_s if decode_s and generated > samples else None
    return RequestTimings(
        ttft_s=None if first_token is None else first_token - arrival,
        queue_s=None if scheduled is None else scheduled - arrival,
        e2e_s=None if finished is None else finished - arrival,
        tokens_per_s=rate,
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outs),
        cached_prompt_tokens=sum(m.num_cached_tokens for m in ms),
        generated_tokens=generated,
        num_preemptions=sum(m.num_preemptions for m in ms),
    )


def _earliest(times) -> float | None:
    return min((t for t in times if t is not None), default=None)


def usage(out: RequestOutput | list[RequestOutput]) -> p.Usage:
    """Tokens of one request, or summed over a list of prompts' requests."""
    outs = out if isinstance(out, list) else [out]
    prompt, completion = sum(len(o.prompt_token_ids) for o in outs), sum(o.num_generated_tokens for o in outs)
    return p.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=p.PromptTokensDetails(cached_tokens=sum(o.metrics.num_cached_tokens for o in outs)),
    )


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


class TokenIdText(TokenText):
    """vLLM's return_tokens_as_token_ids: logprobs name each token `token_id:<id>`, which any client
    can map back, whatever bytes the token holds."""

    def _decode(self, token_id: int) -> str:
        return f"token_id:{token_id}"


def token_text_for(req: p.SamplingFields, tokens: TokenText) -> TokenText:
    return TokenIdText(tokens.tokenizer) if req.return_tokens_as_token_ids else tokens


def chat_logprobs(entries: list[dict[int, float]], top_n: int, tokens: TokenText) -> p.ChatLogprobs:
    content = []
    for d in entries:
        items = list(d.items())  # the chosen token first, then the top-N (it may be among them)
        chosen_id, chosen_lp = items[0]
        top = sorted(items[1:] if len(items) > top_n else items, key=lambda kv: -kv[1])[:top_n]
        chosen = tokens.text(chosen_id)
        content.append(
            p.TokenLogprob(
                token=chosen,
                logprob=chosen_lp,
                bytes=list(chosen.encode()),
                top_logprobs=[
                    p.TopLogprob(token=(t := tokens.text(i)), logprob=lp, bytes=list(t.encode())) for i, lp in top
                ],
            )
        )
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

    def _chunk(self, job: Job, choices: list, **extra):
        return self.chunk_type(id=job.response_id, created=job.created, model=job.model, choices=choices, **extra)

    def usage_chunk(self, job: Job, out: RequestOutput | list[RequestOutput]):
        return self._chunk(job, [], usage=usage(out), timings=timings(out))

    def whole(self, job: Job, outs: list[RequestOutput]):
        """The response to a request of one prompt (chat has no other kind)."""
        return self.response(job, outs[0], [o for o in outs[0].outputs if o.index < job.n])  # type: ignore[attr-defined]


class ChatFormat(_Format):
    """OpenAI's chat completion shapes."""

    chunk_type = p.ChatCompletionChunk

    def response(self, job: Job, out: RequestOutput, outputs: list[CompletionOutput]) -> p.ChatCompletionResponse:
        choices = [self._choice(job, o) for o in outputs]
        prompt_logprobs = (
            vllm_prompt_logprobs(out, job.params.prompt_logprobs or 0, job.prompt_logprobs, job.tokens.text)
            if job.prompt_logprobs is not None
            else None
        )
        return p.ChatCompletionResponse(
            id=job.response_id,
            created=job.created,
            model=job.model,
            choices=choices,
            usage=usage(out),
            timings=timings(out),
            prompt_logprobs=prompt_logprobs,
            prompt_token_ids=out.prompt_token_ids if job.return_token_ids else None,
        )

    def _choice(self, job: Job, o: CompletionOutput) -> p.ChatChoice:
        content, calls = parse_tool_calls(o.text) if job.tools is not None else (o.text, [])
        if job.chat_echo:
            content = job.chat_echo + (content or "")
        return p.ChatChoice(
            index=o.index,
            message=p.ChatResponseMessage(content=content, tool_calls=calls),
            logprobs=self._logprobs(job, o.logprobs),
            finish_reason=_finish_reason(o.finish_reason, bool(calls)),
            stop_reason=o.stop_reason,
            token_ids=o.token_ids if job.return_token_ids else None,
        )

    def chunk(self, job: Job, o: CompletionOutput, text_offset: int) -> p.ChatCompletionChunk:
        delta = p.DeltaMessage(content=o.text)
        finish_reason = o.finish_reason
        if job.tool_streams is not None:
            stream = job.tool_streams[o.index]
            content, calls = stream.feed(o.text)
            if o.finish_reason is not None:
                content += stream.flush()
            first = len(stream.calls)
            stream.calls.extend(calls)
            content = stream.content_of(content)
            delta = p.DeltaMessage(
                content=content if content or not calls else None,
                tool_calls=[_delta_call(first + i, c) for i, c in enumerate(calls)] or None,
            )
            finish_reason = _finish_reason(o.finish_reason, bool(stream.calls))
        choice = p.ChatChunkChoice(
            index=o.index,
            delta=delta,
            logprobs=self._logprobs(job, o.logprobs),
            finish_reason=finish_reason,
            token_ids=o.token_ids if job.return_token_ids else None,
        )
        return self._chunk(job, [choice])

    def opening_chunks(self, job: Job, prompt_ids: list[int]) -> list[p.ChatCompletionChunk]:
        """The role comes first, once per choice (with chat's echo, the message the reply continues);
        the first chunk carries the prompt's token ids when asked."""
        prompt_tokens = len(prompt_ids)
        opening = p.Usage(prompt_tokens=prompt_tokens, completion_tokens=0, total_tokens=prompt_tokens)
        return [
            self._chunk(
                job,
                [p.ChatChunkChoice(index=i, delta=p.DeltaMessage(role="assistant", content=job.chat_echo))],
                usage=opening if job.continuous_usage else None,
                prompt_token_ids=prompt_ids if job.return_token_ids and i == 0 else None,
            )
            for i in range(job.n)
        ]

    @staticmethod
    def _logprobs(job: Job, entries: list[dict[int, float]] | None) -> p.ChatLogprobs | None:
        return chat_logprobs(entries, job.top_logprobs, job.tokens) if entries is not None else None


def _finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


def _delta_call(index: int, call: p.ToolCall) -> p.DeltaToolCall:
    """A whole call in one delta: its id, type, name and all of its arguments."""
    return p.DeltaToolCall(
        index=index,
        id=call.id,
        type="function",
        function=p.DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments),
    )


class CompletionFormat(_Format):
    """OpenAI's (legacy) text completion shapes."""

    chunk_type = p.CompletionChunk

    def whole(self, job: Job, outs: list[RequestOutput]) -> p.CompletionResponse:
        """Every prompt's choices, numbered prompt-major (prompt i, sample j: index i * n + j);
        usage and timings over all of them."""
        n, choices = job.n, []
        outs = [shown(job, out) for out in outs]
        for i, out in enumerate(outs):
            echo = self.echo(job, out, out.prompt_logprobs) if job.echo else None
            prompt_logprobs = (
                vllm_prompt_logprobs(out, job.params.prompt_logprobs or 0, job.prompt_logprobs, job.tokens.text)
                if job.prompt_logprobs is not None
                else None
            )
            choices += [
                self._choice(job, replace(o, index=i * n + o.index), 0, echo, prompt_logprobs, out.prompt_token_ids)
                for o in out.outputs
                if o.index < n
            ]
        return p.CompletionResponse(
            id=job.response_id,
            created=job.created,
            model=job.model,
            choices=choices,
            usage=usage(outs),
            timings=timings(outs),
        )

    def chunk(
        self,
        job: Job,
        o: CompletionOutput,
        text_offset: int,
        echo: EchoPart | None = None,
        prompt_ids: list[int] | None = None,
    ) -> p.CompletionChunk:
        """`echo`: the prompt, which a choice's first chunk carries before its text (as it carries
        `prompt_ids`, the prompt's token ids, when asked)."""
        return self._chunk(job, [self._choice(job, o, text_offset, echo, prompt_ids=prompt_ids)])

    def opening_chunks(self, job: Job, prompt_ids: list[int]) -> list[p.CompletionChunk]:
        return []

    @staticmethod
    def echo(job: Job, out: RequestOutput, entries: list[dict[int, float] | None] | None) -> EchoPart:
        tokens = job.tokens
        return echo_part(
            out,
            entries,
            job.params.prompt_logprobs or 0,
            job.params.logprobs,
            tokens.text,
            lambda ids: (
                tokens.tokenizer.decode(ids, skip_special_tokens=False)
                if tokens.tokenizer
                else "".join(map(tokens.text, ids))
            ),
        )

    @staticmethod
    def _choice(
        job: Job,
        o: CompletionOutput,
        text_offset: int,
        echo: EchoPart | None = None,
        prompt_logprobs: list | None = None,
        prompt_ids: list[int] | None = None,
    ) -> p.CompletionChoice:
        text, start = (o.text, text_offset) if echo is None else (echo.text + o.text, text_offset + len(echo.text))
        logprobs = completion_logprobs(o.logprobs, job.tokens, start) if o.logprobs is not None else None
        if echo is not None:
            logprobs = with_echo(echo, logprobs)
        ids = job.return_token_ids
        return p.CompletionChoice(
            index=o.index,
            text=text,
            logprobs=logprobs,
            finish_reason=o.finish_reason,
            stop_reason=o.stop_reason,
            prompt_logprobs=prompt_logprobs,
            prompt_token_ids=prompt_ids if ids else None,
            token_ids=o.token_ids if ids else None,
        )


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
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: every chunk carries the usage so far
    created: int = field(default_factory=lambda: int(time.time()))
    tools: ToolPlan | None = None  # chat with tools offered: the output is parsed for calls
    tool_streams: list[ToolCallStream] | None = None  # streaming with tools: one parser per choice
    echo: bool = False  # completions: each choice's text starts with its prompt
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (the one token drawn is not shown)
    prompt_logprobs: int | None = None  # completions: vLLM's prompt_logprobs (top-N per prompt token) per choice
    shown_n: int | None = None  # choices per prompt when the engine draws more (best_of); None: params.n
    return_token_ids: bool = False  # vLLM's: prompt and sampled token ids beside the text
    chat_echo: str = ""  # chat's echo: the last (assistant) message the reply continues, shown before it

    def __post_init__(self) -> None:
        if self.tools is not None:
            self.tool_streams = [ToolCallStream() for _ in range(self.n)]

    @property
    def n(self) -> int:
        return self.shown_n or self.params.n


def full_response(
    job: Job, out: RequestOutput | list[RequestOutput]
) -> p.ChatCompletionResponse | p.CompletionResponse:
    """`out`: the whole output (the engine's deltas accumulated); a list: each prompt's, in order."""
    outs = out if isinstance(out, list) else [out]
    if job.n < job.params.n:  # best_of: the best n of the samples drawn
        outs = [best_samples(o, job.n) for o in outs]
    return job.format.whole(job, outs)


def shown(job: Job, out: RequestOutput) -> RequestOutput:
    """What a response shows of an output: with `echo_only`, no generated token (OpenAI's echo
    with max_tokens 0, which scores a prompt)."""
    return without_generation(out) if job.echo_only else out


class StreamState:
    """Per choice (numbered over all prompts): the text already sent (completion logprobs count
    offsets from it), whether its first chunk and its finish_reason went out; per prompt, its
    prompt log-probs (the request's first output carries them; an echo may need them later)."""

    def __init__(self, n: int):
        self.text_offset = [0] * n
        self.started = [False] * n
        self.done = [False] * n
        self.prompt_logprobs: dict[int, list[dict[int, float] | None]] = {}


def chunks_for(job: Job, out: RequestOutput, state: StreamState, prompt: int = 0) -> list[bytes]:
    """The SSE chunks for one engine output (a delta) of the `prompt`-th prompt: one chunk per choice
    that has news; with `echo`, a choice's first chunk carries the prompt."""
    if out.prompt_logprobs is not None:
        state.prompt_logprobs[prompt] = out.prompt_logprobs
    out = shown(job, out)
    n, result = job.n, []
    so_far = usage(out) if job.continuous_usage else None  # num_tokens counts every token so far
    for o in out.outputs:
        if o.index >= n:
            continue
        i = prompt * n + o.index
        if state.done[i]:
            continue
        first = not state.started[i]
        echo = job.echo and first
        news = o.text or o.finish_reason is not None or o.logprobs or (job.return_token_ids and o.token_ids)
        if not echo and not news:
            continue
        if i != o.index:
            o = replace(o, index=i)
        if echo:
            part = COMPLETION.echo(job, out, state.prompt_logprobs.get(prompt))
            chunk = COMPLETION.chunk(job, o, state.text_offset[i], part)
            state.text_offset[i] += len(part.text)
        else:
            chunk = job.format.chunk(job, o, state.text_offset[i])
        if first and job.return_token_ids and job.format is COMPLETION:  # chat's opening chunk carries them
            chunk.choices[0].prompt_token_ids = out.prompt_token_ids
        chunk.usage = so_far
        result.append(sse(chunk))
        state.text_offset[i] += len(o.text)
        state.started[i] = True
        state.done[i] = o.finish_reason is not None
    return result


async def sse_stream(
    job: Job, firsts: list[RequestOutput], rests: list[AsyncIterator[RequestOutput]], on_finished
) -> AsyncIterator[bytes]:
    """The whole SSE body of one request per prompt (`firsts`: each one's first output, `rests`:
    the rest of its stream), their chunks interleaved as they come. Closing this generator closes
    the streams, which aborts their requests; so does a failure of any of them."""
    state = StreamState(job.n * len(firsts))
    finals = list(firsts)
    live = merged({i: rests[i] for i, out in enumerate(firsts) if not out.finished})
    try:
        for opening in job.format.opening_chunks(job, firsts[0].prompt_token_ids):
            yield sse(opening)
        for i, out in enumerate(firsts):
            for chunk in chunks_for(job, out, state, i):
                yield chunk
        async for i, out in live:
            finals[i] = out
            for chunk in chunks_for(job, out, state, i):
                yield chunk
        for out in finals:
            if out.finished:
                on_finished(out)
        if job.include_usage:
            yield sse(job.format.usage_chunk(job, [shown(job, out) for out in finals]))
    except RequestFailedError as exc:  # the engine's own account: this request failed, the others go on
        yield sse(
            error_body(400, str(exc), exc.param)
            if exc.param is not None
            else error_body(500, str(exc), code="request_failed")
        )
    except EngineDeadError as exc:  # the engine (or the replica) running it died: say which, in the stream
        yield sse(error_body(503, str(exc), code="engine_dead"))
    except Exception as exc:  # noqa: BLE001 - the status line is gone: report in the stream
        log.exception("internal error while streaming %s", job.response_id)
        yield sse(
            error_body(
                500,
                f"internal error while generating ({type(exc).__name__}); the server log has "
                f"the details under {job.response_id}",
                code="internal_error",
            )
        )
    finally:
        await live.aclose()  # first: no read of a stream may be in flight when it is closed
        for rest in rests:
            await rest.aclose()
    yield DONE
