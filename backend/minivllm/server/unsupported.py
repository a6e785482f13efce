"""Request fields OpenAI or vLLM defines that this server accepts but cannot honour: a 400 saying
why when one is set, never a silent drop. (The harmless bookkeeping fields - user, metadata, store,
service_tier, safety_identifier, prompt_cache_key - and the reasoning hints are accepted as no-ops;
docs/API.md has the whole table.)"""

from __future__ import annotations

from typing import Any

from minivllm.server import openai_protocol as p
from minivllm.server.errors import bad_request

_TEXT_ONLY = "multi-modal input is not supported: this server serves a text-only model"
_SHARED = {
    "logits_processors": "custom logits processors are not supported: this server loads no plug-in code (use "
    "logit_bias, allowed_token_ids or bad_words)",
    "kv_transfer_params": "KV transfer (disaggregated prefill) is not available: this server runs one engine",
    "vllm_xargs": "vllm_xargs carries arguments for custom vLLM extensions; this server has none",
    "repetition_detection": "repetition_detection is not supported; use repetition_penalty, frequency_penalty or stop",
}
_CHAT = {
    **_SHARED,
    "audio": "audio output is not supported: this model produces text only",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not available on this server",
    "functions": "the deprecated `functions` field is not supported; send `tools` instead",
    "function_call": "the deprecated `function_call` field is not supported; send `tool_choice` instead",
    "structural_tag": "structural_tag is not supported; use response_format, structured_outputs or tools",
    "mm_processor_kwargs": _TEXT_ONLY,
    "media_io_kwargs": _TEXT_ONLY,
}
_COMPLETION = {
    **_SHARED,
    "suffix": "suffix (fill-in-the-middle) is not supported by this server",
    "prompt_embeds": "prompt_embeds are not supported: send the prompt as text or token ids",
}
_MESSAGE = {
    "audio": "assistant audio in messages is not supported",
    "function_call": "the deprecated `function_call` in messages is not supported; use `tool_calls`",
}


def refuse_unsupported_chat(req: p.ChatCompletionRequest) -> None:
    _refuse(req, _CHAT)
    if req.modalities is not None and req.modalities != ["text"]:
        raise bad_request(
            f"modalities {req.modalities!r} are not supported: this model produces text only", "modalities"
        )
    for message in req.messages:
        _refuse(message, _MESSAGE, prefix="messages")


def refuse_unsupported_completion(req: p.CompletionRequest) -> None:
    _refuse(req, _COMPLETION)


def _is_set(name: str, value: Any) -> bool:
    """null and false say "nothing"; so does an empty object or list for vLLM's plug-in fields
    (clients send them as defaults), unlike OpenAI's `web_search_options: {}`, which asks for search."""
    if value in (None, False):
        return False
    return name not in _SHARED and name not in ("mm_processor_kwargs", "media_io_kwargs") or value not in ({}, [])


def _refuse(obj: Any, table: dict[str, str], prefix: str | None = None) -> None:
    for name, why in table.items():
        if _is_set(name, getattr(obj, name)):
            raise bad_request(why, prefix or name)
