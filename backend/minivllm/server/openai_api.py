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
from minivllm.server.chat_prompt import check_template_options, request_prompt_ids
from minivllm.server.completion_prompts import Prompt, completion_prompts, engine_prompt_logprobs
from minivllm.server.errors import APIError, bad_request, decode_body
from minivllm.server.middleware import request_id_of, unique_request_id
from minivllm.server.openai_inputs import chat_messages, chat_params, job_options, sampling_params
from minivllm.server.prompt_size import largest, template_chars
from minivllm.server.state import ServerState, server_of
from minivllm.server.streams import all_or_none
from minivllm.server.structured_request import structured_outputs
from minivllm.server.tools import ToolPlan, tool_plan
from minivllm.server.unsupported import refuse_unsupported_chat, refuse_unsupported_completion
from minivllm.server.vllm_fields import adopt_body_request_id, cache_salt, truncated

T = TypeVar("T")


class ClientDisconnected(Exception):
    pass


async def _open(request: Request, body_type: type[T]) -> tuple[ServerState, T, AsyncEngine, str]:
    """The steps every generation route starts with: decode the body, the engine (503 while it
    loads), the request's id (the body's `request_id` wins), the model name (404 for another)."""
    server = server_of(request)
    req = decode_body(await request.body(), body_type)
    ae = server.engine()
    adopt_body_request_id(request.scope, req)  # type: ignore[arg-type]
    unique_request_id(request.scope, ae.has_stream)
    return server, req, ae, check_model(server, req.model)


MAX_CHARS_PER_TOKEN = 64  # more than any tokenizer's longest token: a cheap bound before tokenizing


def check_prompt_size(server: ServerState, chars: int, param: str) -> None:
    """Refuse a prompt that cannot fit the context whatever its tokens, before the seconds a
    multi-MB text takes to tokenize."""
    limit = (server.max_model_len or 0) * MAX_CHARS_PER_TOKEN
    if limit and chars > limit:
        raise bad_request(
            f"the prompt is {chars} characters long; this model's context of {server.max_model_len} "
            f"tokens cannot hold more than about {limit} characters",
            param,
        )


def check_model(server: ServerState, model: str | None) -> str:
    if model and model != server.model_name:
        raise APIError(
            404,
            f"the model `{model}` does not exist; this server serves `{server.model_name}`",
            param="model",
            code="model_not_found",
        )
    return server.model_name or ""


@contextmanager
def engine_errors():
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


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
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


async def _respond_all(
    request: Request,
    server: ServerState,
    ae: AsyncEngine,
    job: s.Job,
    stream: bool,
    prompts: list[Prompt],
    priority: int,
    salt: str | None,
    preview: str | None = None,
) -> Response:
    """One engine request per prompt (ids `<request id>-<i>` for a list of prompts), run concurrently:
    every one is checked before the response starts, and a failure of any aborts the others."""
    rid = request_id_of(request.scope)
    ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    streams = [
        ae.generate(text, job.params, request_id, token_ids, priority, salt, preview)
        for request_id, (text, token_ids) in zip(ids, prompts)
    ]
    model = job.model

    def on_finished(out: RequestOutput) -> None:
        server.metrics.observe(model, out)

    handed_over = False
    try:
        with engine_errors():
            if not stream:
                finals = await until_disconnect(request, all_or_none(_whole(o) for o in streams))
                for final in finals:
                    on_finished(final)
                return Response(s.full_response(job, finals))
            firsts = await until_disconnect(request, all_or_none(anext(o) for o in streams))
            handed_over = True
    except ClientDisconnected:
        return Response(b"", status_code=400)  # nobody is listening any more
    finally:
        if not handed_over:  # a request that already answered is aborted with the others
            for o in streams:
                await o.aclose()
    body = s.sse_stream(job, firsts, streams, on_finished)
    return Stream(
        body,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
        background=BackgroundTask(body.aclose),
    )  # runs when the client disconnected too


@get("/models", summary="List the served model")
async def list_models(request: Request) -> p.ModelList:
    server = server_of(request)
    server.engine()
    name = server.model_name or ""
    return p.ModelList(
        data=[p.ModelCard(id=name, created=server.created, root=name, max_model_len=server.max_model_len or 0)]
    )


@post("/completions", status_code=200, summary="Text completion (OpenAI-compatible)")
async def completions(request: Request) -> Response:
    server, req, ae, model = await _open(request, p.CompletionRequest)
    refuse_unsupported_completion(req)
    prompts = completion_prompts(req.prompt, ae.config.max_num_seqs)
    if len(prompts) > 1:  # they run as `<id>-<i>`: those must be free too
        unique_request_id(request.scope, lambda rid: any(ae.has_stream(f"{rid}-{i}") for i in range(len(prompts))))
    for prompt, _ in prompts:
        check_prompt_size(server, len(prompt or ""), "prompt")
    echo_only = req.echo and req.max_tokens == 0  # OpenAI's way to score a prompt: one token is drawn, not shown
    params = sampling_params(
        req,
        1 if echo_only else req.max_tokens,
        req.logprobs,
        structured=structured_outputs(req),
        prompt_logprobs=engine_prompt_logprobs(req),
    )
    salt = cache_salt(req)
    with engine_errors():
        await compile_grammars(ae, params, None)
        prompts = await _tokenized(ae, prompts, req, server.max_model_len or 0)
    job = s.Job(
        s.COMPLETION,
        f"cmpl-{request_id_of(request.scope)}",
        model,
        params,
        s.token_text_for(req, server.token_text),
        echo=req.echo,
        echo_only=echo_only,
        prompt_logprobs=None if req.stream else req.prompt_logprobs,
        **job_options(req),
    )
    return await _respond_all(request, server, ae, job, req.stream, prompts, req.priority, salt)


async def _tokenized(
    ae: AsyncEngine, prompts: list[Prompt], req: p.CompletionRequest, max_model_len: int
) -> list[Prompt]:
    """Text prompts stay text (the engine tokenizes them) unless the request changes how: without
    the tokenizer's special tokens, or truncated (then the text no longer matches: echo decodes the ids)."""
    if req.add_special_tokens and req.truncate_prompt_tokens is None:
        return prompts
    out = []
    for text, ids in prompts:
        if ids is None:
            ids = await ae.tokenize(
                lambda tok, text=text: list(tok.encode(text, add_special_tokens=req.add_special_tokens))
            )
        kept = truncated(ids, req.truncate_prompt_tokens, max_model_len)
        out.append((text if len(kept) == len(ids) else None, kept))
    return out


@post("/chat/completions", status_code=200, summary="Chat completion (OpenAI-compatible)")
async def chat_completions(request: Request) -> Response:
    server, req, ae, model = await _open(request, p.ChatCompletionRequest)
    refuse_unsupported_chat(req)
    check_template_options(req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs)
    tools = tool_plan(req)
    params = chat_params(req, tools)
    messages = chat_messages(req)
    sizes = template_chars(messages, tools, req.chat_template, req.chat_template_kwargs)
    check_prompt_size(server, sum(sizes.values()), largest(sizes))
    check_chat_template(server, req.chat_template)
    salt = cache_salt(req)
    with engine_errors():
        await compile_grammars(ae, params, tools)
        prompt_ids = await ae.tokenize(lambda tok: request_prompt_ids(tok, req, messages, tools))
    prompt_ids = truncated(prompt_ids, req.truncate_prompt_tokens, server.max_model_len or 0)
    echoed = messages[-1]["content"] if req.echo and messages[-1]["role"] == "assistant" else ""
    job = s.Job(
        s.CHAT,
        f"chatcmpl-{request_id_of(request.scope)}",
        model,
        params,
        s.token_text_for(req, server.token_text),
        top_logprobs=req.top_logprobs or 0,
        tools=tools,
        prompt_logprobs=None if req.stream else req.prompt_logprobs,
        chat_echo=echoed,
        **job_options(req),
    )
    preview = next((m["content"] for m in reversed(messages) if m["role"] == "user"), None)
    return await _respond_all(request, server, ae, job, req.stream, [(None, prompt_ids)], req.priority, salt, preview)


def check_chat_template(server: ServerState, template: str | None) -> None:
    """A request's own Jinja template runs on the tokenizer pool; as in vLLM, only a trusted
    deployment accepts one."""
    if template is not None and not server.config.trust_request_chat_template:
        raise bad_request(
            "this server does not accept a chat_template in requests; start it with "
            "--trust-request-chat-template to allow it",
            "chat_template",
        )


async def compile_grammars(ae: AsyncEngine, params: SamplingParams, tools: ToolPlan | None) -> None:
    """Off the engine thread, so a new schema never stalls the running batch. Offered tools are
    compiled even when not forced: that is what checks their parameter schemas."""
    if params.structured_outputs is not None:
        await ae.compile_grammar(params.structured_outputs)
    if tools is not None and not tools.forced:
        await ae.compile_grammar(tools.grammar())


def openai_router() -> Router:
    return Router(
        "/v1",
        route_handlers=[list_models, completions, chat_completions],
        guards=[require_api_key],
        tags=["OpenAI API"],
    )
