"""Tool calling: the tools offered to the model, how they reach the prompt, the grammar that
forces a call (`tool_choice` required or named), and the Hermes-style parser that turns
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the output into OpenAI tool calls.

SmolLM2 (and Qwen, Hermes, ...) emit that format. A chat template that knows tools gets them
through its `tools` variable; one that does not (SmolLM2-135M's) gets them as a system message in
the same format, so any chat model can be offered tools."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from minivllm.engine.api import StructuredOutputsParams, check_schema_depth
from minivllm.server import openai_protocol as p
from minivllm.server.errors import bad_request

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

SYSTEM_PROMPT = (
    "You may call one or more functions to help with the user's request. The functions are described "
    "as JSON schemas within <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with a JSON object holding its name and arguments inside "
    '<tool_call></tool_call> tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]]  # the OpenAI tool objects, as the chat template receives them
    choice: str  # "auto" | "required" | a function's name
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def grammar(self) -> StructuredOutputsParams:
        """A grammar for the calls: required/named, one call (or several when parallel)."""
        names = [t["function"]["name"] for t in self.tools]
        chosen = names if self.choice in ("auto", "required") else [self.choice]
        rules = [f"tool_{i}: %json {json.dumps(_call_schema(self._tool(name)))}" for i, name in enumerate(chosen)]
        start = 'start: call ("\\n" call)*' if self.parallel else "start: call"
        alternatives = " | ".join(f"tool_{i}" for i in range(len(chosen)))
        lark = "\n".join(
            [start, f"call: {json.dumps(OPEN + chr(10))} ({alternatives}) {json.dumps(chr(10) + CLOSE)}", *rules]
        )
        return StructuredOutputsParams(grammar=lark, source="tools")

    def system_prompt(self) -> str:
        return SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t) for t in self.tools))

    def _tool(self, name: str) -> dict[str, Any]:
        return next(t for t in self.tools if t["function"]["name"] == name)


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool["function"]
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": fn.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": _JSON_LAYOUT,
    }


def tool_plan(req: p.ChatCompletionRequest) -> ToolPlan | None:
    """What the request offers and requires (None: no tools in play); malformed tools are a 400."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs `tools` to choose from", "tool_choice")
        return None
    tools = [msgspec_to_dict(t) for t in req.tools]
    for i, tool in enumerate(tools):
        try:  # before anything walks it (the prompt's JSON, the chat template, the call grammar)
            check_schema_depth(tool["function"]["parameters"], f"tools[{i}].function.parameters")
        except ValueError as exc:
            raise bad_request(str(exc), "tools") from None
    names = [t["function"]["name"] for t in tools]
    for i, name in enumerate(names):
        if not _NAME.match(name):
            raise bad_request(
                f"tools[{i}].function.name must be 1-64 letters, digits, underscores or dashes, got {name!r}", "tools"
            )
    if len(set(names)) != len(names):
        raise bad_request(f"tools has two functions with the same name: {names}", "tools")
    if choice == "none":
        return None
    if isinstance(choice, p.NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(
                f"tool_choice names the function {choice.function.name!r}, which is not among the "
                f"tools: {', '.join(names)}",
                "tool_choice",
            )
        return ToolPlan(tools, choice.function.name, parallel=False)
    # a forced call is one call unless parallel calls are asked for by name: after a closed call a
    # small model tends to open another rather than stop (SmolLM2 loops until max_tokens)
    return ToolPlan(tools, choice or "auto", parallel=req.parallel_tool_calls is True)


def msgspec_to_dict(tool: p.ChatTool) -> dict[str, Any]:
    fn = tool.function
    function: dict[str, Any] = {"name": fn.name}
    if fn.description is not None:
        function["description"] = fn.description
    function["parameters"] = fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def template_knows_tools(tokenizer: Any) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def offer_tools(
    messages: list[dict[str, str]], plan: ToolPlan | None, tokenizer: Any
) -> tuple[list[dict[str, str]], list[dict[str, Any]] | None]:
    """(the messages, the `tools` for the chat template): a template without tools support gets
    them as the system message instead (after the request's own system text, if any)."""
    if plan is None:
        return messages, None
    if template_knows_tools(tokenizer):
        return messages, plan.tools
    if messages and messages[0]["role"] in ("system", "developer"):
        first = {**messages[0], "content": messages[0]["content"] + "\n\n" + plan.system_prompt()}
        return [first, *messages[1:]], None
    return [{"role": "system", "content": plan.system_prompt()}, *messages], None


def render_tool_calls(content: str, calls: list[p.ToolCall]) -> str:
    """An assistant turn that called tools, as the model would have written it."""
    rendered = [f"{OPEN}\n{json.dumps({'name': c.function.name, 'arguments': _arguments(c)})}\n{CLOSE}" for c in calls]
    return "\n".join(([content] if content else []) + rendered)


def _arguments(call: p.ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return call.function.arguments


# ---- parsing the output ----------------------------------------------------------------------


def new_call(name: str, arguments: Any) -> p.ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return p.ToolCall(id=f"call_{secrets.token_hex(12)}", function=p.ToolCallFunction(name=name, arguments=text))


def _as_call(body: str) -> p.ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return new_call(obj["name"], obj.get("arguments", obj.get("parameters", {})))


def parse_tool_calls(text: str) -> tuple[str | None, list[p.ToolCall]]:
    """(the content left around the calls or None, the calls); malformed blocks stay in the content."""
    calls: list[p.ToolCall] = []

    def take(match: re.Match) -> str:
        call = _as_call(match.group(1))
        if call is None:
            return match.group(0)
        calls.append(call)
        return ""

    content = _CALL.sub(take, text).strip()
    return (content or None), calls


@dataclass
class ToolCallStream:
    """One streamed choice: content passes through, except what may be the start of a call, which
    is held until it is one (then it is emitted whole when its closing tag arrives) or is not."""

    pending: str = ""
    calls: list[p.ToolCall] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[p.ToolCall]]:
        self.pending += text
        content, new = "", []
        while True:
            start = self.pending.find(OPEN)
            if start < 0:
                keep = _partial_tag_len(self.pending)
                content += self.pending[: len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep :]
                return content, new
            end = self.pending.find(CLOSE, start)
            if end < 0:
                content += self.pending[:start]
                self.pending = self.pending[start:]
                return content, new
            block = self.pending[start : end + len(CLOSE)]
            call = _as_call(_CALL.match(block).group(1)) if _CALL.match(block) else None
            if call is None:
                content += block
            else:
                new.append(call)
            self.pending = self.pending[end + len(CLOSE) :]

    def flush(self) -> str:
        rest, self.pending = self.pending, ""
        return rest

    def content_of(self, content: str) -> str:
        """Whitespace between or after calls is layout, not content (as `parse_tool_calls` strips it)."""
        return "" if self.calls and not content.strip() else content


def _partial_tag_len(text: str) -> int:
    """How many trailing characters could begin `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
