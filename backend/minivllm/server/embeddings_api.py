"""`POST /v1/embeddings` (OpenAI-compatible, with vLLM's extra fields and its chat form).

Each input becomes one pooling request in the engine (`AsyncEngine.embed`): all the inputs of a
request are queued at once and run through the model like prefills, chunked under the step's token
budget beside running generations. The vector is the final-normed hidden state of the last token or
the mean over all tokens (`--embedding-pooling`), L2-normalised unless `normalize` is false.
Texts are tokenized (chats rendered) on the engine's tokenizer pool, never on the event loop.
"""

from __future__ import annotations

import base64
import sys
import time
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from litestar import Request, Response, Router, post

from minivllm.engine.api import AsyncEngine, PoolingParams, PoolingRequestOutput
from minivllm.server import embeddings_protocol as e
from minivllm.server import openai_protocol as p
from minivllm.server.auth import require_api_key
from minivllm.server.chat_prompt import check_template_options, request_prompt_ids
from minivllm.server.errors import APIError, bad_request, decode_either
from minivllm.server.middleware import request_id_of, unique_request_id
from minivllm.server.openai_api import (
    ClientDisconnected,
    check_model,
    check_prompt_size,
    engine_errors,
    until_disconnect,
)
from minivllm.server.openai_inputs import chat_messages
from minivllm.server.state import ServerState, server_of
from minivllm.server.vllm_fields import adopt_body_request_id, truncated

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
EmbeddingRequest = e.EmbeddingCompletionRequest | e.EmbeddingChatRequest


def decode_embedding_request(body: bytes) -> EmbeddingRequest:
    return decode_either(body, ("input", "text or token ids", e.EmbeddingCompletionRequest), e.EmbeddingChatRequest)


def embedding_inputs(value: str | list) -> list[str | list[int]]:
    """OpenAI's `input`: a text, token ids, or a list of either; none of them empty."""
    if isinstance(value, str) or (value and all(isinstance(x, int) for x in value)):
        inputs: list[str | list[int]] = [value]  # type: ignore[list-item]
    elif not all(isinstance(x, (str, list)) for x in value):
        raise bad_request(
            "input must be a string, a list of token ids, or a list of strings or of token-id lists", "input"
        )
    else:
        inputs = list(value)
    if not inputs:
        raise bad_request("input must not be empty", "input")
    if len(inputs) > MAX_INPUTS:
        raise bad_request(f"input holds {len(inputs)} inputs; at most {MAX_INPUTS} are allowed per request", "input")
    empty = next((i for i, x in enumerate(inputs) if not x), None)
    if empty is not None:
        what = "an empty string" if isinstance(inputs[empty], str) else "an empty list of token ids"
        raise bad_request(f"input {empty} is {what}" if len(inputs) > 1 else f"input is {what}", "input")
    return inputs


def pooling_params(server: ServerState, req: EmbeddingRequest, hidden_size: int) -> PoolingParams:
    if req.dimensions is not None and req.dimensions != hidden_size:
        raise bad_request(
            f"this model has no matryoshka dimensions: its embeddings have {hidden_size} dimensions "
            f"(its hidden size); leave `dimensions` out or set it to {hidden_size}",
            "dimensions",
        )
    return PoolingParams(server.config.embedding_pooling, normalize=req.normalize is not False)


async def prompt_ids(server: ServerState, ae: AsyncEngine, req: EmbeddingRequest) -> list[list[int]]:
    """Each input's token ids, truncated as `truncate_prompt_tokens` asks."""
    keep, limit = req.truncate_prompt_tokens, server.max_model_len or 0
    truncated([], keep, limit)  # a bad value is a 400 before any tokenizing
    if isinstance(req, e.EmbeddingCompletionRequest):
        inputs = embedding_inputs(req.input)
        texts = [x for x in inputs if isinstance(x, str)]
        for text in texts:
            check_prompt_size(server, len(text), "input")
        encoded = iter(await ae.tokenize(lambda tok: _encode(tok, texts, req.add_special_tokens)) if texts else [])
        prompts = [next(encoded) if isinstance(x, str) else x for x in inputs]
    else:
        check_template_options(req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs)
        messages = chat_messages(p.ChatCompletionRequest(messages=req.messages))
        check_prompt_size(server, sum(len(m["content"]) for m in messages), "messages")
        prompts = [await ae.tokenize(lambda tok: request_prompt_ids(tok, req, messages, None))]
    return [truncated(ids, keep, limit) for ids in prompts]


def _encode(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """Runs on the tokenizer pool: every text in one batched call."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: send token ids as `input`")
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """`base64`: the float32 values' little-endian bytes, as OpenAI's client decodes them."""
    if encoding_format == "float":
        return vector
    values = array("f", vector)
    if sys.byteorder != "little":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


def embedding_response(
    rid: str, model: str, outs: list[PoolingRequestOutput], encoding_format: str
) -> e.EmbeddingResponse:
    tokens = sum(len(out.prompt_token_ids) for out in outs)
    return e.EmbeddingResponse(
        id=f"embd-{rid}",
        created=int(time.time()),
        model=model,
        data=[
            e.EmbeddingData(index=i, embedding=encoded(out.embedding, encoding_format)) for i, out in enumerate(outs)
        ],
        usage=e.EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )


@contextmanager
def _errors_naming(field: str) -> Iterator[None]:
    """The engine's errors as API errors; a prompt the engine rejects is the request's `field`."""
    try:
        with engine_errors():
            yield
    except APIError as exc:
        if exc.param == "prompt":
            exc.param = field
        raise


@post("/embeddings", status_code=200, summary="Embeddings of texts, token ids or a chat (OpenAI-compatible)")
async def embeddings(request: Request) -> Response:
    server = server_of(request)
    req = decode_embedding_request(await request.body())
    ae = server.engine()
    model = check_model(server, req.model)
    adopt_body_request_id(request.scope, req)  # type: ignore[arg-type]
    pooling = pooling_params(server, req, ae.hidden_size)
    field = "input" if isinstance(req, e.EmbeddingCompletionRequest) else "messages"
    with _errors_naming(field):
        prompts = await prompt_ids(server, ae, req)
        rid = unique_request_id(
            request.scope, lambda r: ae.has_stream(r) or any(ae.has_stream(f"{r}-{i}") for i in range(len(prompts)))
        )
        try:
            outs = await until_disconnect(request, ae.embed(prompts, pooling, rid, req.priority))
        except ClientDisconnected:
            return Response(b"", status_code=400)  # nobody is listening any more
    return Response(embedding_response(request_id_of(request.scope), model, outs, req.encoding_format))


def embeddings_router() -> Router:
    return Router("/v1", route_handlers=[embeddings], guards=[require_api_key], tags=["OpenAI API"])
