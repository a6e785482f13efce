"""Every text a chat request hands the chat template, counted before anything is tokenized: the
messages (tool calls included), the offered tools' JSON, the request's own template and its
variables. The prompt-size bound (characters per token times the context) applies to the sum, so a
multi-MB tool description is refused in microseconds, not after seconds on the tokenizer's worker."""

from __future__ import annotations

import json
from typing import Any

from minivllm.server.tools import ToolPlan


def template_chars(
    messages: list[dict[str, Any]],
    tools: ToolPlan | None,
    chat_template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> dict[str, int]:
    """Characters per request field that reaches the template (the field names are the params of the 400)."""
    return {
        "messages": sum(len(str(m.get("content") or "")) for m in messages),
        "tools": len(json.dumps(tools.tools)) if tools is not None else 0,
        "chat_template": len(chat_template or ""),
        "chat_template_kwargs": len(json.dumps(template_kwargs, default=str)) if template_kwargs else 0,
    }


def largest(parts: dict[str, int]) -> str:
    """The field most of the prompt comes from: the one a 400 names."""
    return max(parts, key=lambda name: parts[name])
