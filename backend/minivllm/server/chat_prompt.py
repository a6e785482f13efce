"""A chat request's prompt ids, rendered the one way both /v1/chat/completions and /tokenize use:
tools offered (through the template or as a system message), the template's options checked,
and a template that breaks on what the request put into it reported as a 400."""

from __future__ import annotations

from typing import Any

from minivllm.server.errors import bad_request
from minivllm.server.tools import ToolPlan, offer_tools
from minivllm.text.tokenizer_utils import load_chat_template_prompt

# apply_chat_template's own parameters and the names the renderer binds itself: not template variables
RESERVED_TEMPLATE_KWARGS = frozenset(
    (
        "conversation",
        "conversations",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    )
)


def check_template_options(
    add_generation_prompt: bool, continue_final_message: bool, template_kwargs: dict[str, Any] | None
) -> None:
    if add_generation_prompt and continue_final_message:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true", "continue_final_message"
        )
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(template_kwargs or {}))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")


def request_prompt_ids(tokenizer: Any, req: Any, messages: list[dict[str, str]], tools: ToolPlan | None) -> list[int]:
    """`chat_prompt_ids` with the template options a chat-shaped request carries (vLLM's field names:
    chat completions, /tokenize and /v1/embeddings read them the same way)."""
    return chat_prompt_ids(
        tokenizer,
        messages,
        tools,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        template_kwargs=req.chat_template_kwargs,
        add_special_tokens=req.add_special_tokens,
        chat_template=getattr(req, "chat_template", None),
        documents=getattr(req, "documents", None),
    )


def chat_prompt_ids(
    tokenizer: Any,
    messages: list[dict[str, str]],
    tools: ToolPlan | None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
    chat_template: str | None = None,
    documents: list[dict[str, str]] | None = None,
) -> list[int]:
    """Runs on the tokenizer pool. `add_special_tokens`: also the tokenizer's own BOS (chat templates
    write their own); `chat_template`: the request's own Jinja template instead of the model's;
    `documents`: the template's RAG variable (a template without one ignores them)."""
    from jinja2 import TemplateError

    if tokenizer is None:
        raise ValueError("this model has no tokenizer: send token ids to /v1/completions instead")
    messages, template_tools = offer_tools(messages, tools, tokenizer)
    options = dict(template_kwargs or {})
    if continue_final_message:
        options["continue_final_message"] = True
    if documents is not None:
        options["documents"] = documents
    try:
        if not add_special_tokens and chat_template is None:
            return load_chat_template_prompt(
                tokenizer, messages, add_generation_prompt, tools=template_tools, **options
            )
        if chat_template is not None:
            options["chat_template"] = chat_template
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=template_tools, tokenize=False, **options
        )
    except (TemplateError, TypeError) as exc:  # what the request put in the template broke it
        raise ValueError(f"the chat template could not render this request: {exc}") from None
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
