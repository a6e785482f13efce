"""The OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

A client that goes away aborts its request: while the handler waits for output it also listens
for `http.disconnect`, and a streaming body that stops being read is closed, which closes the
engine's output generator, whose `finally` aborts the request before the next engine step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import contextmanager
from typing import TypeVar

from litestar import Request, Response, Router, get, post
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from minivllm.engine.api import AsyncEngine, EngineDeadError, OutputAccumulator, RequestOutput, RequestRejectedError
from minivllm.sampling.params import SamplingParams
from minivllm.server import openai_protocol as p
from minivllm.server import openai_serving as s
from minivllm.server.auth import require_api_key
from minivllm.server.completion_prompts import Prompt, completion_prompts, engine_prompt_logprobs
from minivllm.server.errors import APIError, bad_request, decode_body
from minivllm.server.middleware import request_id_of, unique_request_id
from minivllm.server.state import ServerState, server_of
from minivllm.server.streams import all_or_none
from minivllm.server.structured_request import structured_outputs
from minivllm.server.chat_prompt import chat_prompt_ids, check_template_options
from minivllm.server.tools import ToolPlan, tool_plan
from minivllm.server.unsupported import refuse_unsupported_chat, refuse_unsupported_completion

T = TypeVar("T")


class ClientDisconnected(Exception):
    pass


async def _open(request: Request, body_type: type[T]) -> tuple[ServerState, T, AsyncEngine, str]:
    """The steps every generation route starts with: decode the body, the engine (503 while it
    loads), the model name (404 for another)."""
    server = server_of(request)
    req = decode_body(await request.body(), body_type)
    ae = server.engine()
    unique_request_id(request.scope, ae.has_stream)
    return server, req, ae, _check_model(server, req.model)


MAX_CHARS_PER_TOKEN = 64  # more than any tokenizer's longest token: a cheap bound before tokenizing


def _check_prompt_size(server: ServerState, chars: int, param: str) -> None:
    """Refuse a prompt that cannot fit the context whatever its tokens, before the seconds a
    multi-MB text takes to tokenize."""
    limit = (server.max_model_len or 0) * MAX_CHARS_PER_TOKEN
    if limit and chars > limit:
        raise bad_request(f"the prompt is {chars} characters long; this model's context of {server.max_model_len} "
                          f"tokens cannot hold more than about {limit} characters", param)


def _check_model(server: ServerState, model: str | None) -> str:
    if model and model != server.model_name:
        raise APIError(404, f"the model `{model}` does not exist; this server serves `{server.model_name}`",
                       param="model", code="model_not_found")
    return server.model_name or ""


@contextmanager
def _engine_errors():
    """Errors raised by the engine for one request, as API errors."""
    try:
        yield
    except RequestRejectedError as exc:
        raise bad_request(str(exc), exc.param) from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code="engine_dead") from None
    except ValueError as exc:
        raise bad_request(str(exc)) from None


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable` unless the client disconnects first (then cancel it)."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def _whole(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The engine streams deltas; a non-streaming response needs them all, folded together."""
    whole, final = OutputAccumulator(), None
    async for out in outputs:
        final = whole.add(out)
    assert final is not None
    return final


async def _respond(request: Request, server: ServerState, ae: AsyncEngine, job: s.Job, stream: bool,
                   prompt: str | None, prompt_ids: list[int] | None, priority: int) -> Response:
    return await _respond_all(request, server, ae, job, stream, [(prompt, prompt_ids)], priority)


async def _respond_all(request: Request, server: ServerState, ae: AsyncEngine, job: s.Job, stream: bool,
                       prompts: list[Prompt], priority: int) -> Response:
    """One engine request per prompt (ids `<request id>-<i>` for a list of prompts), run concurrently:
    every one is checked before the response starts, and a failure of any aborts the others."""
    rid = request_id_of(request.scope)
    ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    streams = [ae.generate(text, job.params, request_id, token_ids, priority)
               for request_id, (text, token_ids) in zip(ids, prompts)]
    model = job.model

    def on_finished(out: RequestOutput) -> None:
        server.metrics.observe(model, out)

    handed_over = False
    try:
        with _engine_errors():
            if not stream:
                finals = await _until_disconnect(request, all_or_none(_whole(o) for o in streams))
                for final in finals:
                    on_finished(final)
                return Response(s.full_response(job, finals))
            firsts = await _until_disconnect(request, all_or_none(anext(o) for o in streams))
            handed_over = True
    except ClientDisconnected:
        return Response(b"", status_code=400)  # nobody is listening any more
    finally:
        if not handed_over:  # a request that already answered is aborted with the others
            for o in streams:
                await o.aclose()
    body = s.sse_stream(job, firsts, streams, on_finished)
    return Stream(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                  background=BackgroundTask(body.aclose))  # runs when the client disconnected too


@get("/models", summary="List the served model")
async def list_models(request: Request) -> p.ModelList:
    server = server_of(request)
    server.engine()
    name = server.model_name or ""
    return p.ModelList(data=[p.ModelCard(id=name, created=server.created, root=name,
                                         max_model_len=server.max_model_len or 0)])


@post("/completions", status_code=200, summary="Text completion (OpenAI-compatible)")
async def completions(request: Request) -> Response:
    server, req, ae, model = await _open(request, p.CompletionRequest)
    refuse_unsupported_completion(req)
    prompts = completion_prompts(req.prompt, ae.config.max_num_seqs)
    if len(prompts) > 1:  # they run as `<id>-<i>`: those must be free too
        unique_request_id(request.scope, lambda rid: any(ae.has_stream(f"{rid}-{i}") for i in range(len(prompts))))
    for prompt, _ in prompts:
        _check_prompt_size(server, len(prompt or ""), "prompt")
    echo_only = req.echo and req.max_tokens == 0  # OpenAI's way to score a prompt: one token is drawn, not shown
    params = s.sampling_params(req, 1 if echo_only else req.max_tokens, req.logprobs,
                               structured=structured_outputs(req), prompt_logprobs=engine_prompt_logprobs(req))
    with _engine_errors():
        await _compile_grammars(ae, params, None)
    job = s.Job(s.COMPLETION, f"cmpl-{request_id_of(request.scope)}", model, params, server.token_text,
                include_usage=bool(req.stream_options and req.stream_options.include_usage),
                continuous_usage=bool(req.stream_options and req.stream_options.continuous_usage_stats), echo=req.echo,
                echo_only=echo_only, prompt_logprobs=None if req.stream else req.prompt_logprobs)
    return await _respond_all(request, server, ae, job, req.stream, prompts, req.priority)


@post("/chat/completions", status_code=200, summary="Chat completion (OpenAI-compatible)")
async def chat_completions(request: Request) -> Response:
    server, req, ae, model = await _open(request, p.ChatCompletionRequest)
    refuse_unsupported_chat(req)
    check_template_options(req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs)
    tools = tool_plan(req)
    params = _chat_params(req, tools)
    messages = s.chat_messages(req)
    _check_prompt_size(server, sum(len(m["content"]) for m in messages), "messages")
    with _engine_errors():
        await _compile_grammars(ae, params, tools)
        prompt_ids = await ae.tokenize(lambda tok: chat_prompt_ids(
            tok, messages, tools, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, template_kwargs=req.chat_template_kwargs))
    job = s.Job(s.CHAT, f"chatcmpl-{request_id_of(request.scope)}", model, params, server.token_text,
                top_logprobs=req.top_logprobs or 0,
                include_usage=bool(req.stream_options and req.stream_options.include_usage),
                continuous_usage=bool(req.stream_options and req.stream_options.continuous_usage_stats), tools=tools,
                prompt_logprobs=None if req.stream else req.prompt_logprobs)
    return await _respond(request, server, ae, job, req.stream, None, prompt_ids, req.priority)


async def _compile_grammars(ae: AsyncEngine, params: SamplingParams, tools: ToolPlan | None) -> None:
    """Off the engine thread, so a new schema never stalls the running batch. Offered tools are
    compiled even when not forced: that is what checks their parameter schemas."""
    if params.structured_outputs is not None:
        await ae.compile_grammar(params.structured_outputs)
    if tools is not None and not tools.forced:
        await ae.compile_grammar(tools.grammar())


def _chat_params(req: p.ChatCompletionRequest, tools: ToolPlan | None) -> SamplingParams:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    use_completion = req.max_completion_tokens is not None
    max_tokens = req.max_completion_tokens if use_completion else req.max_tokens
    names = {"max_tokens": "max_completion_tokens" if use_completion else "max_tokens", "logprobs": "top_logprobs"}
    structured = structured_outputs(req)
    if tools is not None and tools.forced:
        if structured is not None:
            raise bad_request("tool_choice required or named forces a tool call; it cannot be combined with a "
                              "structured-output constraint", "tool_choice")
        structured = tools.grammar()
    if req.prompt_logprobs and req.stream:  # vLLM's rule
        raise bad_request("`prompt_logprobs` are not available when `stream=True`", "prompt_logprobs")
    return s.sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, names, structured,
                             prompt_logprobs=None if req.stream else req.prompt_logprobs)


def openai_router() -> Router:
    return Router("/v1", route_handlers=[list_models, completions, chat_completions],
                  guards=[require_api_key], tags=["OpenAI API"])
