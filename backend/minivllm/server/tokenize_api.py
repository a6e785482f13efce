"""vLLM's utility routes at the root: POST /tokenize, POST /detokenize and GET /version.

`/tokenize` takes vLLM's two shapes: a completion form (`prompt`) or a chat form (`messages`,
rendered with the model's chat template exactly as /v1/chat/completions renders them). Either way
the tokenizer runs on the engine's tokenizer pool, never on the event loop. Like vLLM, tokenizing
does not refuse a prompt longer than the context (counting it is the point); only a text too long
to fit whatever its tokens is refused, before it ties up the pool.
"""

from __future__ import annotations

import functools
import importlib.metadata
import sys
from typing import Any

import msgspec
from litestar import Request, Router, get, post

from minivllm.engine.api import RequestRejectedError
from minivllm.server import openai_protocol as p
from minivllm.server.auth import require_api_key
from minivllm.server.chat_prompt import check_template_options, request_prompt_ids
from minivllm.server.errors import decode_body, decode_either
from minivllm.server.openai_api import check_chat_template, check_model, check_prompt_size, engine_errors
from minivllm.server.openai_inputs import chat_messages
from minivllm.server.prompt_size import largest, template_chars
from minivllm.server.state import server_of
from minivllm.server.tools import tool_plan
from minivllm.server.unsupported import refuse_unsupported_chat

Strict = dict(kw_only=True, forbid_unknown_fields=True)


class TokenizeCompletionRequest(msgspec.Struct, **Strict):
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(msgspec.Struct, **Strict):
    messages: list[p.ChatMessage]
    model: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the chat template writes its own BOS / role tokens
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template
    tools: list[p.ChatTool] | None = None  # offered as /v1/chat/completions offers them
    chat_template: str | None = None  # as /v1/chat/completions: only with --trust-request-chat-template
    mm_processor_kwargs: Any = None  # refused when set: text-only model


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, **Strict):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class VersionResponse(msgspec.Struct, kw_only=True):
    version: str


def _tokenizer_of(tok: Any, model: str) -> Any:
    if tok is None:
        raise ValueError(f"model {model} has no tokenizer")
    return tok


def _decode_tokenize(body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    return decode_either(body, ("prompt", "text", TokenizeCompletionRequest), TokenizeChatRequest)


@post("/tokenize", status_code=200, summary="Text or a chat to token ids (vLLM-compatible)")
async def tokenize(request: Request) -> TokenizeResponse:
    server = server_of(request)
    req = _decode_tokenize(await request.body())
    ae = server.engine()
    model = check_model(server, req.model)
    if isinstance(req, TokenizeCompletionRequest):
        check_prompt_size(server, len(req.prompt), "prompt")

        def encode(tok: Any) -> list[int]:
            return list(_tokenizer_of(tok, model).encode(req.prompt, add_special_tokens=req.add_special_tokens))
    else:
        check_template_options(req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs)
        chat = p.ChatCompletionRequest(
            messages=req.messages, tools=req.tools, mm_processor_kwargs=req.mm_processor_kwargs
        )
        refuse_unsupported_chat(chat)
        check_chat_template(server, req.chat_template)
        messages, tools = chat_messages(chat), tool_plan(chat)
        sizes = template_chars(messages, tools, req.chat_template, req.chat_template_kwargs)
        check_prompt_size(server, sum(sizes.values()), largest(sizes))

        def encode(tok: Any) -> list[int]:
            return request_prompt_ids(tok, req, messages, tools)

    def run(tok: Any) -> tuple[list[int], list[str] | None]:
        ids = encode(tok)
        return ids, (list(tok.convert_ids_to_tokens(ids)) if req.return_token_strs else None)

    with engine_errors():
        ids, strs = await ae.tokenize(run)
    return TokenizeResponse(count=len(ids), max_model_len=server.max_model_len or 0, tokens=ids, token_strs=strs)


@post("/detokenize", status_code=200, summary="Token ids to text (vLLM-compatible)")
async def detokenize(request: Request) -> DetokenizeResponse:
    server = server_of(request)
    req = decode_body(await request.body(), DetokenizeRequest)
    ae = server.engine()
    model = check_model(server, req.model)

    def decode(tok: Any) -> str:
        tok = _tokenizer_of(tok, model)
        vocab = len(tok)
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejectedError(f"token id {bad} is out of range for the vocabulary of size {vocab}", "tokens")
        return tok.decode(req.tokens)

    with engine_errors():
        return DetokenizeResponse(prompt=await ae.tokenize(decode))


@functools.cache
def package_version() -> str:
    try:
        return importlib.metadata.version("minivllm")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        # the package is loaded already (this module is in it); importing it here would tie the
        # server to everything its __init__ imports
        return getattr(sys.modules.get("minivllm"), "__version__", "0.1.0")


@get("/version", summary="The server's version (vLLM-compatible)", tags=["Operations"])
async def version() -> VersionResponse:
    return VersionResponse(version=package_version())


def tokenize_router() -> Router:
    """/tokenize and /detokenize behind the API key, at the root as vLLM serves them."""
    return Router("/", route_handlers=[tokenize, detokenize], guards=[require_api_key], tags=["Tokenizer"])
