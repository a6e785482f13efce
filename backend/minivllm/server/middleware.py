"""Request ids: every HTTP response echoes `X-Request-Id` (the client's, when it sent a usable one)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable

from litestar.types import ASGIApp, Message, Receive, Scope, Send

_VALID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
SCOPE_KEY = "minivllm.request_id"


def request_id_of(scope: Scope) -> str:
    return scope[SCOPE_KEY]  # type: ignore[literal-required]


def adopt_request_id(scope: Scope, rid: str) -> None:
    """vLLM's `request_id` body field: the request runs (and answers) under the client's id."""
    if not _VALID.fullmatch(rid):
        raise ValueError("request_id must be 1-128 characters of letters, digits and . _ : -")
    scope[SCOPE_KEY] = rid  # type: ignore[literal-required]


def unique_request_id(scope: Scope, in_use: Callable[[str], bool]) -> str:
    """The request's id, made unique when a running request already has it (a client retrying with
    the same X-Request-Id): a suffix is added, and the response header carries the id it ran under."""
    rid = request_id_of(scope)
    if in_use(rid):
        rid = f"{rid[:119]}-{uuid.uuid4().hex[:8]}"
        scope[SCOPE_KEY] = rid  # type: ignore[literal-required]
    return rid


def request_id_middleware(app: ASGIApp) -> ASGIApp:
    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), "")
        rid = given if _VALID.fullmatch(given) else uuid.uuid4().hex
        scope[SCOPE_KEY] = rid  # type: ignore[literal-required]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":  # the id the request ran under (see unique_request_id)
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message["headers"] = [*headers, (b"x-request-id", scope[SCOPE_KEY].encode())]  # type: ignore[literal-required]
            await send(message)

        await app(scope, receive, send_with_id)

    return middleware
