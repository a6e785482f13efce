"""Request ids: every HTTP response echoes `X-Request-Id` (the client's, when it sent a usable one)."""

from __future__ import annotations

import re
import uuid

from litestar.types import ASGIApp, Message, Receive, Scope, Send

_VALID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
SCOPE_KEY = "minivllm.request_id"


def request_id_of(scope: Scope) -> str:
    return scope[SCOPE_KEY]  # type: ignore[literal-required]


def request_id_middleware(app: ASGIApp) -> ASGIApp:
    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), "")
        rid = given if _VALID.fullmatch(given) else uuid.uuid4().hex
        scope[SCOPE_KEY] = rid  # type: ignore[literal-required]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message["headers"] = [*headers, (b"x-request-id", rid.encode())]
            await send(message)

        await app(scope, receive, send_with_id)

    return middleware
