"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request becomes the chat request it amounts to (responses_input.py) and runs the chat-completions
path: the same tool plan, sampling parameters, grammars and prompt rendering, so a greedy response
equals the chat completion of the same conversation. Finished responses are kept in the
`ResponseStore` on `app.state.responses` (unless `store: false`) for `previous_response_id`."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response, Router, delete, get, post
from litestar.background_tasks import BackgroundTask
from litestar.params import FromPath
from litestar.response import Stream

from minivllm.engine.api import RequestFailedError, RequestOutput
from minivllm.server import responses_protocol as r
from minivllm.server.auth import require_api_key
from minivllm.server.chat_prompt import chat_prompt_ids
from minivllm.server.errors import APIError, decode_body
from minivllm.server.middleware import request_id_of, unique_request_id
from minivllm.server.openai_api import (
    ClientDisconnected,
    check_model,
    check_prompt_size,
    compile_grammars,
    engine_errors,
    until_disconnect,
)
from minivllm.server.openai_inputs import chat_messages, chat_params
from minivllm.server.response_store import ResponseStore, StoredResponse
from minivllm.server.responses_input import (
    chat_request,
    echoed_tools,
    output_as_input,
    refuse_unsupported,
    responses_params,
)
from minivllm.server.responses_output import OutputBuilder, new_id
from minivllm.server.state import ServerState, server_of
from minivllm.server.tools import ToolPlan, tool_plan
from minivllm.server.unsupported import refuse_unsupported_chat
from minivllm.server.vllm_fields import adopt_body_request_id, cache_salt

log = logging.getLogger("minivllm.server")


def store_of(request: Request) -> ResponseStore:
    return request.app.state.responses


def _previous(store: ResponseStore, response_id: str | None) -> StoredResponse | None:
    if response_id is None:
        return None
    found = store.get(response_id)
    if found is None:  # OpenAI's answer for an unknown id (here also: expired, evicted, deleted or store: false)
        raise APIError(
            400,
            f"Previous response with id '{response_id}' not found: it is unknown, was not stored, "
            "was deleted or has expired",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return found


def _stored(store: ResponseStore, response_id: str) -> StoredResponse:
    found = store.get(response_id)
    if found is None:
        raise APIError(404, f"No response found with id '{response_id}'", param="response_id", code="not_found")
    return found


@post("/responses", status_code=200, summary="Create a model response (OpenAI Responses API)")
async def create_response(request: Request) -> Response:
    server = server_of(request)
    req = decode_body(await request.body(), r.ResponsesRequest)
    ae = server.engine()  # a 503 while the model loads
    adopt_body_request_id(request.scope, req)  # type: ignore[arg-type]
    unique_request_id(request.scope, ae.has_stream)
    model = check_model(server, req.model)
    refuse_unsupported(req)
    store = store_of(request)
    previous = _previous(store, req.previous_response_id)
    with responses_params():
        chat = chat_request(req, list(previous.conversation) if previous else [])
        refuse_unsupported_chat(chat)
        salt = cache_salt(chat)
        tools = tool_plan(chat)
        params = chat_params(chat, tools)
        messages = chat_messages(chat)
    check_prompt_size(server, sum(len(m["content"]) for m in messages), "input")
    limit = (server.max_model_len or 0) - (req.max_output_tokens or 1)
    with responses_params(), engine_errors():
        await compile_grammars(ae, params, tools)
        prompt_ids = await ae.tokenize(lambda tok: _prompt_ids(tok, messages, tools, limit, req.truncation == "auto"))
    response = _in_progress(req, model)
    turns = chat.messages[1:] if req.instructions else chat.messages  # instructions are not carried over
    builder = OutputBuilder(
        response,
        tools is not None,
        chat.top_logprobs if chat.logprobs else None,
        server.token_text,
        stream=bool(req.stream),
    )
    run = _Run(server, store if response.store else None, turns, builder)
    outputs = ae.generate(None, params, request_id_of(request.scope), prompt_ids, req.priority, salt)
    if not req.stream:
        return await _whole_response(request, run, outputs)
    return await _streamed_response(request, run, outputs)


def _in_progress(req: r.ResponsesRequest, model: str) -> r.Response:
    """The Response before any output: the request's settings as OpenAI echoes them."""
    return r.Response(
        id=new_id("resp"),
        created_at=time.time(),
        status="in_progress",
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        model=model,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        previous_response_id=req.previous_response_id,
        store=req.store is not False,
        temperature=req.temperature,
        text={"format": _format_echo(req.text)},
        tool_choice=req.tool_choice or "auto",
        tools=echoed_tools(req.tools),
        top_logprobs=req.top_logprobs,
        top_p=req.top_p,
        truncation=req.truncation or "disabled",
        user=req.user,
        metadata=req.metadata or {},
    )


def _format_echo(text: r.TextConfig | None) -> dict[str, Any]:
    if text is None or text.format is None:
        return {"type": "text"}
    return {k: v for k, v in msgspec.to_builtins(text.format).items() if v is not None}


def _prompt_ids(
    tokenizer: Any, messages: list[dict[str, str]], tools: ToolPlan | None, limit: int, truncate: bool
) -> list[int]:
    """The rendered prompt; with `truncation: auto`, the oldest turns (after any leading system
    turn; never the last) are dropped until it leaves room for `max_output_tokens` (or one token)."""
    ids = chat_prompt_ids(tokenizer, messages, tools)
    first = 1 if messages and messages[0]["role"] in ("system", "developer") else 0
    while truncate and limit > 0 and len(ids) > limit and len(messages) - first > 1:
        messages = messages[:first] + messages[first + 1 :]
        ids = chat_prompt_ids(tokenizer, messages, tools)
    return ids


class _Run:
    """One response in flight: where its output goes once finished."""

    def __init__(self, server: ServerState, store: ResponseStore | None, turns: list, builder: OutputBuilder):
        self.server, self.store, self.turns, self.builder = server, store, turns, builder

    def finish(self, out: RequestOutput) -> tuple[r.Response, list[bytes]]:
        self.server.metrics.observe(self.builder.response.model, out)
        final, events = self.builder.finish(out)
        if self.store is not None:
            self.store.put(final.id, StoredResponse(final, self.turns + output_as_input(final.output)))
        return final, events


async def _whole_response(request: Request, run: _Run, outputs: AsyncIterator[RequestOutput]) -> Response:
    try:
        with engine_errors():
            out = await until_disconnect(request, _fed(run.builder, outputs))
    except ClientDisconnected:
        return Response(b"", status_code=400)  # nobody is listening any more
    finally:
        await outputs.aclose()
    return Response(run.finish(out)[0])


async def _fed(builder: OutputBuilder, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """Feeds every delta as a stream would (so both build the same items); the last output."""
    last = None
    async for out in outputs:
        o = out.outputs[0]
        builder.feed(o.text, o.logprobs, finished=out.finished)
        last = out
    assert last is not None
    return last


async def _streamed_response(request: Request, run: _Run, outputs: AsyncIterator[RequestOutput]) -> Response:
    """The first output is awaited before the response starts, so a rejected request is a plain 400."""
    handed_over = False
    try:
        with engine_errors():
            first = await until_disconnect(request, anext(outputs))
            handed_over = True
    except ClientDisconnected:
        return Response(b"", status_code=400)
    finally:
        if not handed_over:
            await outputs.aclose()
    body = _events(run, first, outputs)
    return Stream(
        body,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
        background=BackgroundTask(body.aclose),
    )  # runs when the client disconnected too


async def _events(run: _Run, first: RequestOutput, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[bytes]:
    """The SSE body. Closing it closes the engine's stream, which aborts the request."""
    builder = run.builder
    try:
        for event in builder.opening():
            yield event
        out = first
        while True:
            o = out.outputs[0]
            for event in builder.feed(o.text, o.logprobs, finished=out.finished):
                yield event
            if out.finished:
                break
            out = await anext(outputs)
        for event in run.finish(out)[1]:
            yield event
    except RequestFailedError as exc:  # the engine's own account: this request failed, the others go on
        for event in builder.failed("server_error", str(exc)):
            yield event
    except Exception as exc:  # noqa: BLE001 - the status line is gone: report in the stream
        log.exception("internal error while streaming %s", builder.response.id)
        for event in builder.failed(
            "server_error",
            f"internal error while generating ({type(exc).__name__}); "
            f"the server log has the details under {builder.response.id}",
        ):
            yield event
    finally:
        await outputs.aclose()


@get("/responses/{response_id:str}", summary="A stored response (OpenAI Responses API)")
async def get_response(request: Request, response_id: FromPath[str]) -> r.Response:
    return _stored(store_of(request), response_id).response


@delete("/responses/{response_id:str}", status_code=200, summary="Delete a stored response (Responses API)")
async def delete_response(request: Request, response_id: FromPath[str]) -> r.DeletedResponse:
    if not store_of(request).delete(response_id):
        _stored(store_of(request), response_id)  # raises the 404
    return r.DeletedResponse(id=response_id)


def responses_router() -> Router:
    return Router(
        "/v1",
        route_handlers=[create_response, get_response, delete_response],
        guards=[require_api_key],
        tags=["OpenAI API"],
    )
