"""One engine request's output as a Responses object and as its semantic SSE events.

`OutputBuilder` is fed the engine's text deltas. Text goes into a `message` item (one `output_text`
part); with tools in play, `tools.ToolCallStream` holds back what may start a call and each call
becomes a `function_call` item once its closing tag arrives. A non-streaming response is fed the
same deltas and keeps only the items, so both paths build the same output."""

from __future__ import annotations

import secrets
import time
from typing import Any

import msgspec

from minivllm.engine.api import RequestOutput
from minivllm.server import openai_protocol as p
from minivllm.server import responses_protocol as r
from minivllm.server.openai_serving import TokenText, chat_logprobs
from minivllm.server.tools import ToolCallStream

_encoder = msgspec.json.Encoder()


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def sse_event(payload: dict[str, Any]) -> bytes:
    """OpenAI's Responses framing: an `event:` line naming the type, then the JSON."""
    return b"event: " + payload["type"].encode() + b"\ndata: " + _encoder.encode(payload) + b"\n\n"


def response_usage(out: RequestOutput) -> r.ResponseUsage:
    prompt, generated = len(out.prompt_token_ids), out.num_generated_tokens
    return r.ResponseUsage(
        input_tokens=prompt,
        output_tokens=generated,
        total_tokens=prompt + generated,
        input_tokens_details=r.InputTokensDetails(cached_tokens=out.metrics.num_cached_tokens),
        output_tokens_details=r.OutputTokensDetails(),
    )


class OutputBuilder:
    """`response`: the in-progress Response (every field but output, status and usage set)."""

    def __init__(self, response: r.Response, tools: bool, top_logprobs: int | None, tokens: TokenText, stream: bool):
        self.response, self.tokens, self.top_logprobs, self.stream = response, tokens, top_logprobs, stream
        self.calls = ToolCallStream() if tools else None
        self.items: list[r.OutputItem] = []
        self.message: r.OutputMessage | None = None  # the message item being written
        self.pending_logprobs: list[p.TokenLogprob] = []  # of tokens whose text is held back
        self.sequence = 0

    # ---- events ---------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> list[bytes]:
        if not self.stream:
            return []
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return [sse_event(payload)]

    def opening(self) -> list[bytes]:
        return self._event("response.created", response=self.response) + self._event(
            "response.in_progress", response=self.response
        )

    def feed(self, text: str, logprobs: list[dict[int, float]] | None, finished: bool) -> list[bytes]:
        """One engine delta: the events it makes."""
        if self.top_logprobs is not None and logprobs:
            self.pending_logprobs += chat_logprobs(logprobs, self.top_logprobs, self.tokens).content or []
        content, calls = text, []
        if self.calls is not None:
            content, calls = self.calls.feed(text)
            if finished:
                content += self.calls.flush()
            self.calls.calls.extend(calls)
            content = self.calls.content_of(content)
        events = self._text(content) if content else []
        if calls:
            self.pending_logprobs = []  # the calls' own tokens: a call item has no log-probs
        for call in calls:
            events += self._close_message("completed") + self._function_call(call)
        return events

    def finish(self, out: RequestOutput) -> tuple[r.Response, list[bytes]]:
        """The final Response (`out`: the request's last output, for usage) and its closing events."""
        incomplete = out.outputs[0].finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        if not self.items and self.message is None:  # an empty answer is still one (empty) message
            events = self._open_message()
        else:
            events = []
        events += self._close_message(status)
        final = msgspec.structs.replace(
            self.response,
            status=status,
            output=self.items,
            usage=response_usage(out),
            completed_at=time.time(),
            incomplete_details=r.IncompleteDetails(reason="max_output_tokens") if incomplete else None,
        )
        return final, events + self._event(f"response.{status}", response=final)

    def failed(self, code: str, message: str) -> list[bytes]:
        failed = msgspec.structs.replace(
            self.response, status="failed", output=self.items, error=r.ResponseError(code=code, message=message)
        )
        return self._event("error", code=code, message=message, param=None) + self._event(
            "response.failed", response=failed
        )

    # ---- items ----------------------------------------------------------------------------------

    def _open_message(self) -> list[bytes]:
        self.message = r.OutputMessage(id=new_id("msg"), status="in_progress", content=[])
        index = len(self.items)
        self.items.append(self.message)
        part = r.OutputText(text="", logprobs=[] if self.top_logprobs is not None else None)
        events = self._event("response.output_item.added", output_index=index, item=self.message)
        self.message.content.append(part)
        return events + self._event(
            "response.content_part.added", item_id=self.message.id, output_index=index, content_index=0, part=part
        )

    def _text(self, text: str) -> list[bytes]:
        events = self._open_message() if self.message is None else []
        assert self.message is not None
        part, logprobs, self.pending_logprobs = self.message.content[0], self.pending_logprobs, []
        part.text += text
        if part.logprobs is not None:
            part.logprobs += logprobs
        return events + self._event(
            "response.output_text.delta",
            item_id=self.message.id,
            output_index=len(self.items) - 1,
            content_index=0,
            delta=text,
            logprobs=logprobs,
        )

    def _close_message(self, status: str) -> list[bytes]:
        if self.message is None:
            return []
        message, self.message = self.message, None
        message.status = status  # type: ignore[assignment]
        index, part = self.items.index(message), message.content[0]
        return (
            self._event(
                "response.output_text.done",
                item_id=message.id,
                output_index=index,
                content_index=0,
                text=part.text,
                logprobs=part.logprobs or [],
            )
            + self._event(
                "response.content_part.done", item_id=message.id, output_index=index, content_index=0, part=part
            )
            + self._event("response.output_item.done", output_index=index, item=message)
        )

    def _function_call(self, call: p.ToolCall) -> list[bytes]:
        """A call arrives whole (the parser emits it at its closing tag): its arguments in one delta."""
        index, arguments = len(self.items), call.function.arguments
        item = r.FunctionCall(
            id=new_id("fc"), call_id=call.id, name=call.function.name, arguments="", status="in_progress"
        )
        self.items.append(item)
        events = self._event("response.output_item.added", output_index=index, item=item)
        events += self._event(
            "response.function_call_arguments.delta", item_id=item.id, output_index=index, delta=arguments
        )
        item.arguments, item.status = arguments, "completed"
        return (
            events
            + self._event(
                "response.function_call_arguments.done", item_id=item.id, output_index=index, arguments=arguments
            )
            + self._event("response.output_item.done", output_index=index, item=item)
        )
