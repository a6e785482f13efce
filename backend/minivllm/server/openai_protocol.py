"""OpenAI API shapes as msgspec Structs (requests decoded strictly: an unknown field is a 400).

Request fields follow OpenAI's reference plus vLLM's extra sampling fields. Responses are
encoded with `omit_defaults=False`, so every field OpenAI documents is present (as null when
unset). The extra `timings` field carries per-request timings for the dashboard.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from minivllm.server.api_types import RequestTimings

# ---- requests --------------------------------------------------------------------------------
# Every struct forbids unknown fields: a misspelt or unsupported field is a 400 naming it, never
# silently dropped. `unsupported.py` refuses the fields OpenAI defines that this server cannot honour.

Strict = dict(kw_only=True, forbid_unknown_fields=True)


class StreamOptions(msgspec.Struct, **Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage (so far) on every chunk
    include_obfuscation: bool | None = None  # no-op: there is no side channel to pad against here


class JsonSchemaFormat(msgspec.Struct, **Strict):
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None  # OpenAI's name ("schema"); absent: any JSON
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, **Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(msgspec.Struct, **Strict):
    """vLLM's `structured_outputs` object."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None  # JSON: the whitespace allowed between tokens
    disable_any_whitespace: bool | None = None  # JSON: false allows any whitespace (default: none)
    disable_fallback: bool | None = None  # no-op: there is one backend and no fallback
    structural_tag: str | None = None  # refused: not supported
    disable_additional_properties: bool | None = None  # refused: not supported


class SamplingFields(msgspec.Struct, **Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's bookkeeping fields: accepted, no effect here (documented in docs/API.md)
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    priority: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # vLLM's other sampling and request fields (docs/API.md: what each does here)
    best_of: int | None = None  # samples drawn; the n with the highest cumulative log-prob are returned
    spaces_between_special_tokens: bool = True  # what fast tokenizers do either way
    truncate_prompt_tokens: int | None = None  # keep the prompt's last N tokens (-1: as many as fit)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    request_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    cache_salt: str | None = None
    # vLLM's fields for plug-ins and other deployments: refused with a 400 saying why when set
    logits_processors: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    repetition_detection: Any = None


class CompletionRequest(SamplingFields, **Strict):
    prompt: str | list[int | str | list[int]]  # text, token ids, or a batch of either
    logprobs: int | None = None  # top-N alternatives per token (0: the chosen token only)
    echo: bool = False  # return the prompt before the completion
    suffix: str | None = None  # refused: no fill-in-the-middle
    add_special_tokens: bool = True  # the tokenizer's BOS before a text prompt
    prompt_embeds: Any = None  # refused: prompts are text or token ids here


class ChatContentPart(msgspec.Struct, **Strict):
    type: str
    text: str | None = None
    image_url: Any = None  # refused: this model reads text only
    input_audio: Any = None  # refused
    file: Any = None  # refused
    refusal: str | None = None


class ToolCallFunction(msgspec.Struct, **Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct, **Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(msgspec.Struct, **Strict):
    role: str
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call this answers
    refusal: str | None = None
    audio: Any = None  # refused
    function_call: Any = None  # refused: the deprecated form of tool_calls


class FunctionDefinition(msgspec.Struct, **Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ChatTool(msgspec.Struct, **Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, **Strict):
    name: str


class NamedToolChoice(msgspec.Struct, **Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields, **Strict):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's bookkeeping and hints: accepted, no effect here (documented in docs/API.md)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    # OpenAI's fields this server cannot honour: refused with a 400 when set
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    # vLLM's extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # a Jinja template for this request instead of the model's
    documents: list[dict[str, str]] | None = None  # the template's `documents` (RAG templates read them)
    add_special_tokens: bool = False  # the tokenizer's BOS on top of what the template writes
    echo: bool = False  # the reply starts with the last message when that is the assistant's
    include_reasoning: bool = True  # no-op: no reasoning parser runs for these models
    structural_tag: Any = None  # refused
    mm_processor_kwargs: Any = None  # refused when set: text-only model
    media_io_kwargs: Any = None  # refused when set: text-only model


# ---- responses -------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "minivllm"
    root: str
    max_model_len: int


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ResponseEnvelope(msgspec.Struct, kw_only=True):
    """Fields every completion response and chunk carries."""

    id: str
    created: int
    model: str
    usage: Usage | None = None
    timings: RequestTimings | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # vLLM's: per prompt token, null for the first, else {token_id: {"logprob", "rank", "decoded_token"}}
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids (streaming: the first chunk)
    token_ids: list[int] | None = None  # vLLM's return_token_ids (streaming: this chunk's)


class CompletionResponse(ResponseEnvelope, kw_only=True):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[TokenLogprob] | None


class ChatResponseMessage(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = []  # OpenAI sends [] when no tool was called


class DeltaFunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A streamed tool call: the first delta of a call carries its id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatCompletionResponse(ResponseEnvelope, kw_only=True):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's, for the whole prompt
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids


class DeltaMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids: this chunk's


class ChatCompletionChunk(ResponseEnvelope, kw_only=True):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids: the first chunk


CompletionChunk = CompletionResponse  # streamed /v1/completions chunks have the full response's shape
