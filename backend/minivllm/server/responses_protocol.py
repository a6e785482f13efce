"""OpenAI's Responses API shapes (`POST /v1/responses`) as msgspec Structs.

Requests are decoded strictly, as the chat ones are: an unknown field is a 400 naming it. `input`
items and `tools` arrive as plain objects and are checked one by one (`responses_input.py`), so a
built-in tool or an image part gets a 400 that says why rather than a union-decoding message.
Responses are encoded with every field present (null when unset), as OpenAI sends them."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from minivllm.server import openai_protocol as p
from minivllm.server.openai_protocol import TokenLogprob

Strict = dict(kw_only=True, forbid_unknown_fields=True)

# ---- requests --------------------------------------------------------------------------------


class TextFormat(msgspec.Struct, **Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, **Strict):
    format: TextFormat | None = None
    verbosity: str | None = None  # no-op: a hint for reasoning models


class ReasoningConfig(msgspec.Struct, **Strict):
    """No-op: SmolLM2 and Llama chat models have no reasoning mode."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class StreamOptions(msgspec.Struct, **Strict):
    include_obfuscation: bool | None = None  # no-op: there is no side channel to pad against here


class ResponsesRequest(msgspec.Struct, **Strict):
    input: str | list[dict[str, Any]] | None = None
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # bookkeeping and hints: accepted, no effect here (docs/API.md)
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    reasoning: ReasoningConfig | None = None
    # OpenAI's fields this server cannot honour: a 400 that says why when set
    background: bool | None = None
    prompt: Any = None
    conversation: Any = None
    context_management: Any = None
    max_tool_calls: int | None = None
    moderation: Any = None
    prompt_cache_options: Any = None
    background_options: Any = None
    access_programs: Any = None
    image: Any = None
    # vLLM's extras for this route (docs/API.md)
    request_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    structured_outputs: p.StructuredOutputsRequest | None = None
    mm_processor_kwargs: Any = None  # refused when set: text-only model
    media_io_kwargs: Any = None  # refused when set: text-only model
    vllm_xargs: Any = None  # refused when set
    kv_transfer_params: Any = None  # refused when set


# ---- input items (checked one by one) ---------------------------------------------------------


class ContentPart(msgspec.Struct, **Strict):
    """A text part of an input message: `input_text` (user/system/developer) or `output_text` /
    `refusal` (an assistant turn sent back, as the SDK serializes its own output items)."""

    type: Literal["input_text", "output_text", "refusal"]
    text: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    prompt_cache_breakpoint: Any = None  # no-op


class MessageItem(msgspec.Struct, **Strict):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(msgspec.Struct, **Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    namespace: str | None = None
    caller: Any = None


class FunctionCallOutputItem(msgspec.Struct, **Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None
    name: str | None = None
    namespace: str | None = None
    caller: Any = None


class FunctionTool(msgspec.Struct, **Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None  # no-op: every tool is offered at once


# ---- responses --------------------------------------------------------------------------------


class OutputText(msgspec.Struct, kw_only=True):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[TokenLogprob] | None = None


class OutputMessage(msgspec.Struct, kw_only=True, tag="message", tag_field="type"):
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCall(msgspec.Struct, kw_only=True, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | FunctionCall


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0  # no reasoning model here


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: Literal["max_output_tokens"]


class ResponseError(msgspec.Struct, kw_only=True):
    code: str
    message: str


class Response(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["response"] = "response"
    created_at: float
    completed_at: float | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = []
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = msgspec.field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = []
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = {}
    background: bool = False


class DeletedResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
