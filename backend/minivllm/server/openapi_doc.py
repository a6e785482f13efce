"""The OpenAPI document with request bodies: the routes decode their bodies themselves (to name the
offending field in OpenAI's error shape), so Litestar cannot see their types; this adds each body's
JSON Schema (generated from the msgspec Struct) and the engine's limits on its fields, so clients,
fuzzers and the dashboard share one contract."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request
from litestar.openapi.plugins import JsonRenderPlugin

from minivllm.engine.api import EngineConfig
from minivllm.sampling.params import MAX_LENGTH_PENALTY, MAX_LOGPROBS, MAX_SEED
from minivllm.server import openai_protocol as p
from minivllm.server.api_types import ConfigUpdate
from minivllm.server.embeddings_protocol import EmbeddingChatRequest, EmbeddingCompletionRequest
from minivllm.server.openai_inputs import CHAT_ROLES
from minivllm.server.responses_protocol import ResponsesRequest
from minivllm.server.tokenize_api import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

REQUEST_BODIES: dict[tuple[str, str], type | tuple[type, ...]] = {  # a tuple: one of these shapes
    ("/v1/completions", "post"): p.CompletionRequest,
    ("/v1/chat/completions", "post"): p.ChatCompletionRequest,
    ("/api/config", "put"): ConfigUpdate,
    ("/tokenize", "post"): (TokenizeCompletionRequest, TokenizeChatRequest),
    ("/detokenize", "post"): DetokenizeRequest,
    ("/v1/embeddings", "post"): (EmbeddingCompletionRequest, EmbeddingChatRequest),
    ("/v1/responses", "post"): ResponsesRequest,
}

# What `SamplingParams.validate` and `validate_request` enforce, as JSON Schema keywords on the
# number (or array) branch of each field. The vocabulary and context limits depend on the model.
FIELD_LIMITS: dict[str, dict[str, Any]] = {
    "temperature": {"minimum": 0},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1},
    "min_p": {"minimum": 0, "maximum": 1},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"exclusiveMinimum": 0},
    "length_penalty": {"minimum": -MAX_LENGTH_PENALTY, "maximum": MAX_LENGTH_PENALTY},
    "seed": {"minimum": 0, "maximum": MAX_SEED},
    "n": {"minimum": 1},
    "max_tokens": {"minimum": 1},
    "max_completion_tokens": {"minimum": 1},
    "max_output_tokens": {"minimum": 1},
    "min_tokens": {"minimum": 0},
    "logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
    "top_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
    "prompt_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
    "stop": {"maxItems": EngineConfig.max_stop_strings},  # the default; the served engine's in the document
    "messages": {"minItems": 1},
    "role": {"enum": list(CHAT_ROLES)},
    "num_blocks": {"minimum": 1},
    "block_size": {"minimum": 1},
    "max_num_batched_tokens": {"minimum": 1},
    "max_num_seqs": {"minimum": 1},
}
_KEYWORD_TYPES = {"maxItems": ("array",), "minItems": ("array",), "enum": ("string",)}


def with_request_bodies(
    document: dict[str, Any], model_name: str | None = None, config: EngineConfig | None = None
) -> dict[str, Any]:
    shapes = [kinds if isinstance(kinds, tuple) else (kinds,) for kinds in REQUEST_BODIES.values()]
    flat_refs, components = msgspec.json.schema_components(
        [k for kinds in shapes for k in kinds], ref_template="#/components/schemas/{name}"
    )
    refs, taken = [], iter(flat_refs)
    for kinds in shapes:  # msgspec cannot describe an untagged union of Structs: anyOf of their refs
        mine = [next(taken) for _ in kinds]
        refs.append(mine[0] if len(mine) == 1 else {"anyOf": mine})
    limits = FIELD_LIMITS | ({"model": {"enum": [model_name]}} if model_name else {})  # the one served
    if config is not None:
        limits["stop"] = {"maxItems": config.max_stop_strings}
    for component in components.values():
        for name, schema in component.get("properties", {}).items():
            _limit(schema, limits.get(name, {}))
    document.setdefault("components", {}).setdefault("schemas", {}).update(components)
    for ((path, method), _), ref in zip(REQUEST_BODIES.items(), refs):
        operation = document.get("paths", {}).get(path, {}).get(method)
        if operation is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
    return document


def _limit(schema: dict[str, Any], limits: dict[str, Any]) -> None:
    """Put each keyword on the branches of `schema` whose type it constrains (not on null)."""
    for branch in schema.get("anyOf", [schema]):
        for keyword, value in limits.items():
            if branch.get("type") in _KEYWORD_TYPES.get(keyword, ("number", "integer")):
                branch[keyword] = value


class DocumentedJsonRenderPlugin(JsonRenderPlugin):
    def render(self, request: Request, openapi_schema: dict[str, Any]) -> bytes:
        server = request.app.state.server
        config = server.async_engine.config if server.async_engine is not None else None
        return super().render(request, with_request_bodies(openapi_schema, server.model_name, config))
