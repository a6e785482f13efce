"""OpenAI request fields this server accepts but cannot honour: a 400 naming the field when one is
set, never a silent drop. (The harmless bookkeeping fields - user, metadata, store, service_tier,
safety_identifier, prompt_cache_key - and the reasoning hints are accepted as no-ops; docs/API.md.)"""

from __future__ import annotations

from typing import Any

from minivllm.server import openai_protocol as p
from minivllm.server.errors import bad_request

_CHAT = {
    "audio": "audio output is not supported: this model produces text only",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not available on this server",
    "functions": "the deprecated `functions` field is not supported; send `tools` instead",
    "function_call": "the deprecated `function_call` field is not supported; send `tool_choice` instead",
}
_COMPLETION = {"suffix": "suffix (fill-in-the-middle) is not supported by this server"}
_MESSAGE = {"audio": "assistant audio in messages is not supported",
            "function_call": "the deprecated `function_call` in messages is not supported; use `tool_calls`"}


def refuse_unsupported_chat(req: p.ChatCompletionRequest) -> None:
    _refuse(req, _CHAT)
    if req.modalities is not None and req.modalities != ["text"]:
        raise bad_request(f"modalities {req.modalities!r} are not supported: this model produces text only",
                          "modalities")
    for message in req.messages:
        _refuse(message, _MESSAGE, prefix="messages")


def refuse_unsupported_completion(req: p.CompletionRequest) -> None:
    _refuse(req, _COMPLETION)
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of is not supported (it would need to differ from n={req.n}); use n", "best_of")


def _refuse(obj: Any, table: dict[str, str], prefix: str | None = None) -> None:
    for name, why in table.items():
        if getattr(obj, name) not in (None, False):
            raise bad_request(why, prefix or name)
