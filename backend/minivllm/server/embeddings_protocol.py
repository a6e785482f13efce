"""The shapes of `POST /v1/embeddings` (OpenAI's, with vLLM's extra fields), as msgspec Structs.

Requests are decoded strictly (an unknown field is a 400 naming it). vLLM takes two request
shapes: OpenAI's `input`, and a chat (`messages`, rendered by the model's chat template).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from minivllm.server.openai_protocol import ChatMessage

Strict = dict(kw_only=True, forbid_unknown_fields=True)


class EmbeddingFields(msgspec.Struct, **Strict):
    """Fields both shapes share."""

    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32 bytes
    dimensions: int | None = None  # no matryoshka dimensions here: only the hidden size itself
    user: str | None = None  # OpenAI's bookkeeping: accepted, no effect
    # vLLM's extras
    truncate_prompt_tokens: int | None = None  # keep the last N tokens of each input (-1: max_model_len)
    priority: int = 0
    request_id: str | None = None
    normalize: bool | None = None  # L2-normalise the vector (None: yes)


class EmbeddingCompletionRequest(EmbeddingFields, **Strict):
    input: str | list[int | str | list[int]]  # a text, token ids, or a list of either
    add_special_tokens: bool = True  # the tokenizer's BOS (if it has one) before a text


class EmbeddingChatRequest(EmbeddingFields, **Strict):
    messages: list[ChatMessage]
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the chat template writes its own
    chat_template_kwargs: dict[str, Any] | None = None


class EmbeddingData(msgspec.Struct, kw_only=True):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a base64 string with encoding_format "base64"


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    id: str  # vLLM's: `embd-<request id>`
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
