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
from minivllm.server.errors import APIError, bad_request, decode_body
from minivllm.server.middleware import request_id_of, unique_request_id
from minivllm.server.state import ServerState, server_of
from minivllm.text.tokenizer_utils import load_chat_template_prompt

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
    outputs = ae.generate(prompt, job.params, request_id_of(request.scope), prompt_ids, priority)
    model = job.model

    def on_finished(out: RequestOutput) -> None:
        server.metrics.observe(model, out)

    try:
        with _engine_errors():
            if not stream:
                final = await _until_disconnect(request, _whole(outputs))
                on_finished(final)
                return Response(s.full_response(job, final))
            first = await _until_disconnect(request, outputs.__anext__())
    except ClientDisconnected:
        return Response(b"", status_code=400)  # nobody is listening any more
    body = s.sse_stream(job, first, outputs, on_finished)
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
    if req.echo or req.suffix:
        raise bad_request("echo and suffix are not supported", "echo" if req.echo else "suffix")
    prompt, prompt_ids = s.completion_prompt(req)
    _check_prompt_size(server, len(prompt or ""), "prompt")
    params = s.sampling_params(req, req.max_tokens, req.logprobs)
    job = s.Job(s.COMPLETION, f"cmpl-{request_id_of(request.scope)}", model, params, server.token_text,
                include_usage=bool(req.stream_options and req.stream_options.include_usage))
    return await _respond(request, server, ae, job, req.stream, prompt, prompt_ids, req.priority)


@post("/chat/completions", status_code=200, summary="Chat completion (OpenAI-compatible)")
async def chat_completions(request: Request) -> Response:
    server, req, ae, model = await _open(request, p.ChatCompletionRequest)
    params = _chat_params(req)
    messages = s.chat_messages(req)
    _check_prompt_size(server, sum(len(m["content"]) for m in messages), "messages")
    with _engine_errors():
        prompt_ids = await ae.tokenize(lambda tok: load_chat_template_prompt(tok, messages, req.add_generation_prompt))
    job = s.Job(s.CHAT, f"chatcmpl-{request_id_of(request.scope)}", model, params, server.token_text,
                top_logprobs=req.top_logprobs or 0,
                include_usage=bool(req.stream_options and req.stream_options.include_usage))
    return await _respond(request, server, ae, job, req.stream, None, prompt_ids, req.priority)


def _chat_params(req: p.ChatCompletionRequest) -> SamplingParams:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    use_completion = req.max_completion_tokens is not None
    max_tokens = req.max_completion_tokens if use_completion else req.max_tokens
    names = {"max_tokens": "max_completion_tokens" if use_completion else "max_tokens", "logprobs": "top_logprobs"}
    return s.sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, names)


def openai_router() -> Router:
    return Router("/v1", route_handlers=[list_models, completions, chat_completions],
                  guards=[require_api_key], tags=["OpenAI API"])
