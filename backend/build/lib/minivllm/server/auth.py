"""The optional API key: a guard on the /v1, /api and /ws routers and on /tokenize and /detokenize
(/health, /metrics and /version stay open).

Clients send `Authorization: Bearer KEY` (what the openai client does) or `X-API-Key`; browsers
cannot set headers on a WebSocket, so there, and only there, `?api_key=KEY` is accepted too (a key
in a URL ends up in logs and histories).
"""

from __future__ import annotations

import hmac

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from minivllm.server.errors import APIError


def presented_key(connection: ASGIConnection) -> str | None:
    header = connection.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    if connection.scope["type"] == "websocket":  # browsers cannot set a WebSocket's headers: only there
        return connection.headers.get("x-api-key") or connection.query_params.get("api_key")
    return connection.headers.get("x-api-key")


def key_problem(connection: ASGIConnection) -> str | None:
    """Why this connection may not pass (None: it may)."""
    expected = connection.app.state.server.config.api_key
    if not expected:
        return None
    key = presented_key(connection)
    if key is None:
        return "missing API key: send 'Authorization: Bearer <key>' (WebSocket: ?api_key=<key>)"
    if not hmac.compare_digest(key.encode(), expected.encode()):
        return "incorrect API key"
    return None


def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    problem = key_problem(connection)
    if problem is not None:
        raise APIError(401, problem, code="invalid_api_key")
