"""A Responses request as the chat request it amounts to: `instructions` and the input items become
chat messages, function tools and `tool_choice` the chat ones, `text.format` the `response_format`.
/v1/responses then runs the chat-completions path (tools.py, structured_request.py, chat_prompt.py)
on it. What this server cannot honour is a 400 that says why (docs/API.md has the table)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import msgspec

from minivllm.server import openai_protocol as p
from minivllm.server import responses_protocol as r
from minivllm.server.errors import APIError, bad_request, decode_error
from minivllm.server.structured_request import closed_objects

LOGPROBS_INCLUDE = "message.output_text.logprobs"
NO_OP_INCLUDES = ("reasoning.encrypted_content",)  # no reasoning items are ever produced here

_REFUSED = {
    "background": "background responses are not supported: this server answers within the request "
    "(use stream: true for incremental output)",
    "background_options": "background responses are not supported on this server",
    "prompt": "prompt templates live on OpenAI's platform; send input and instructions instead",
    "conversation": "the Conversations API is not available on this server; continue with previous_response_id",
    "context_management": "server-side context compaction is not available; use truncation: auto",
    "max_tool_calls": "max_tool_calls is not supported by this server",
    "moderation": "moderation is not available on this server",
}
_NOT_TEXT = {
    "input_image": "image inputs are not supported: this model reads text only",
    "input_file": "file inputs are not supported: this model reads text only",
    "input_audio": "audio inputs are not supported: this model reads text only",
}
# chat-request field -> the Responses field a 400 from the shared chat path should name
_PARAMS = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
}


def refuse_unsupported(req: r.ResponsesRequest) -> None:
    for name, why in _REFUSED.items():
        if getattr(req, name) not in (None, False):
            raise bad_request(why, name)
    for value in req.include or []:
        if value != LOGPROBS_INCLUDE and value not in NO_OP_INCLUDES:
            raise bad_request(
                f"include {value!r} is not available: it needs built-in tools or image inputs, which "
                f"this server does not have (it accepts {LOGPROBS_INCLUDE!r})",
                "include",
            )


@contextmanager
def responses_params():
    """A 400 raised by the shared chat path names the Responses field, not the chat one."""
    try:
        yield
    except APIError as exc:
        exc.param = _PARAMS.get(exc.param or "", exc.param)
        raise


def chat_request(req: r.ResponsesRequest, history: list[p.ChatMessage]) -> p.ChatCompletionRequest:
    """The chat request this Responses request amounts to (`history`: a previous response's turns)."""
    messages = [p.ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    messages += history + input_messages(req.input)
    if not messages:
        raise bad_request(
            "input must hold at least one item (or send instructions, or continue with previous_response_id)", "input"
        )
    logprobs = req.top_logprobs is not None or LOGPROBS_INCLUDE in (req.include or [])
    return p.ChatCompletionRequest(
        messages=messages,
        model=req.model,
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        logprobs=logprobs,
        top_logprobs=(req.top_logprobs or 0) if logprobs else None,
        tools=chat_tools(req.tools) or None,
        tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=response_format(req.text),
        user=req.user,
        request_id=req.request_id,
        priority=req.priority,
        cache_salt=req.cache_salt,
        seed=req.seed,
        stop=req.stop,
        repetition_penalty=req.repetition_penalty,
        ignore_eos=req.ignore_eos,
        structured_outputs=req.structured_outputs,
        mm_processor_kwargs=req.mm_processor_kwargs,
        media_io_kwargs=req.media_io_kwargs,
        vllm_xargs=req.vllm_xargs,
        kv_transfer_params=req.kv_transfer_params,
    )


# ---- input items ------------------------------------------------------------------------------


def input_messages(items: str | list[dict[str, Any]] | None) -> list[p.ChatMessage]:
    """Input items as chat turns: consecutive function calls (and the assistant text before them)
    make one assistant turn with `tool_calls`, a function's output a `tool` turn."""
    if items is None:
        return []
    if isinstance(items, str):
        return [p.ChatMessage(role="user", content=items)]
    messages: list[p.ChatMessage] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            message = _convert(_text_parts_only(item, where), r.MessageItem, where)
            messages.append(p.ChatMessage(role=message.role, content=_text(message.content)))
        elif kind == "function_call":
            call = _convert(item, r.FunctionCallItem, where)
            _assistant_turn(messages).tool_calls.append(
                p.ToolCall(id=call.call_id, function=p.ToolCallFunction(name=call.name, arguments=call.arguments))
            )
        elif kind == "function_call_output":
            result = _convert(_text_parts_only(item, where, "output"), r.FunctionCallOutputItem, where)
            messages.append(p.ChatMessage(role="tool", content=_text(result.output), tool_call_id=result.call_id))
        elif kind == "item_reference":
            raise bad_request(
                f"{where}: item references are not supported; send the item itself, or continue "
                "with previous_response_id",
                "input",
            )
        else:
            raise bad_request(
                f"{where}: items of type {kind!r} are not supported: this server has no built-in "
                "tools or reasoning items; it takes messages, function_call and "
                "function_call_output items",
                "input",
            )
    return messages


def output_as_input(items: list[r.OutputItem]) -> list[p.ChatMessage]:
    """A response's output as the turns a follow-up request continues from."""
    return input_messages([msgspec.to_builtins(item) for item in items])


def _assistant_turn(messages: list[p.ChatMessage]) -> p.ChatMessage:
    if not messages or messages[-1].role != "assistant":
        messages.append(p.ChatMessage(role="assistant", content=None))
    if messages[-1].tool_calls is None:
        messages[-1].tool_calls = []
    return messages[-1]


def _text_parts_only(item: dict[str, Any], where: str, field: str = "content") -> dict[str, Any]:
    parts = item.get(field)
    for j, part in enumerate(parts if isinstance(parts, list) else []):
        why = _NOT_TEXT.get(part.get("type")) if isinstance(part, dict) else None
        if why:
            raise bad_request(f"{where}.{field}[{j}]: {why}", "input")
    return item


def _text(content: str | list[r.ContentPart]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.text or part.refusal or "" for part in content)


def _convert(value: Any, kind: type, where: str, param: str = "input"):
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        error = decode_error(exc, kind)
        if error.message.startswith("Unrecognized request argument"):
            raise bad_request(f"Unrecognized request argument supplied: {where}.{error.param}", param) from None
        raise bad_request(f"{where}: {str(exc)}", param) from None


# ---- tools and formats ------------------------------------------------------------------------


def chat_tools(tools: list[dict[str, Any]] | None) -> list[p.ChatTool]:
    """Function tools in the chat shape. A strict tool (the Responses default) gets its parameter
    objects closed, as `text.format` strict does, for the grammar that forces calls."""
    out = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(
                f"tools[{i}]: the built-in tool {kind!r} is not available on this server; it offers "
                "function tools only",
                "tools",
            )
        fn = _convert(tool, r.FunctionTool, f"tools[{i}]", "tools")
        strict = fn.strict is not False
        parameters = closed_objects(fn.parameters) if strict and fn.parameters is not None else fn.parameters
        out.append(
            p.ChatTool(
                type="function",
                function=p.FunctionDefinition(
                    name=fn.name, description=fn.description, parameters=parameters, strict=strict
                ),
            )
        )
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | p.NamedToolChoice | None:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return p.NamedToolChoice(type="function", function=p.NamedFunction(name=choice["name"]))
    raise bad_request(
        f"tool_choice {choice!r} is not supported: use none, auto, required or "
        '{"type": "function", "name": ...} (this server has no built-in tools)',
        "tool_choice",
    )


def response_format(text: r.TextConfig | None) -> p.ResponseFormat | None:
    fmt = text.format if text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return p.ResponseFormat(type="json_object")
    return p.ResponseFormat(
        type="json_schema",
        json_schema=p.JsonSchemaFormat(
            name=fmt.name or "response", description=fmt.description, schema=fmt.schema, strict=fmt.strict
        ),
    )


def echoed_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's (already checked) function tools as the Response object lists them."""
    return [
        {
            "type": "function",
            "name": t["name"],
            "description": t.get("description"),
            "parameters": t.get("parameters"),
            "strict": t.get("strict") is not False,
        }
        for t in tools or []
    ]
