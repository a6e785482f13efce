"""What a browser on another site may do to a local server: nothing.

Three checks in one ASGI middleware, before any route runs:
- **Host** (when the server is bound to loopback): a page on evil.example whose DNS now points at
  127.0.0.1 (DNS rebinding) sends `Host: evil.example`; only the loopback names and
  `--allowed-host` pass.
- **Origin** on WebSockets and on state-changing methods: browsers send it on every cross-site
  request, so anything but the server's own origin or a `--cors-origin` is refused. Non-browser
  clients send no Origin and are unaffected.
- **Content-Type** on request bodies: JSON routes take `application/json` only (as FastAPI does
  since 0.65.2), so a cross-site "simple" `text/plain` form POST cannot reach a handler; recording
  uploads also take `application/x-ndjson` and `multipart/form-data` (`curl -F`), which the Origin
  check covers.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import urlsplit

import msgspec
from litestar.types import ASGIApp, Receive, Scope, Send

from minivllm.server.errors import error_body

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
JSON_TYPES = ("application/json",)
_API_KEY = re.compile(r"(api_key=)[^&\s]*")
UPLOAD_TYPES = {"/api/recordings": ("application/json", "application/x-ndjson", "multipart/form-data")}


def allowed_hosts_for(bind_host: str, extra: list[str]) -> list[str] | None:
    """Bound to loopback: the loopback names plus `extra`. Bound elsewhere (a container, a LAN):
    no Host check unless names were given."""
    return list(extra) if bind_host in LOOPBACK_HOSTS or extra else None


def redact_api_keys(record: logging.LogRecord) -> bool:
    """A logging filter: `?api_key=...` (the WebSocket's key) never reaches the access log."""
    if isinstance(record.args, tuple):
        record.args = tuple(_API_KEY.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args)
    return True


def exposure_guard(allowed_hosts: list[str] | None, cors_origins: list[str]):
    """The middleware factory; `allowed_hosts` None or holding "*" skips the Host check."""
    hosts = (
        None
        if allowed_hosts is None or "*" in allowed_hosts
        else {h.lower() for h in (*LOOPBACK_HOSTS, *allowed_hosts)}
    )
    origins = {o.rstrip("/").lower() for o in cors_origins}

    def middleware(app: ASGIApp) -> ASGIApp:
        async def guard(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] in ("http", "websocket"):
                problem = _problem(scope, hosts, origins)
                if problem is not None:
                    await _refuse(scope, send, *problem)
                    return
            await app(scope, receive, send)

        return guard

    return middleware


def _problem(scope: Scope, hosts: set[str] | None, origins: set[str]) -> tuple[int, str, str] | None:
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    host_header = headers.get("host", "")
    if hosts is not None and _hostname(host_header) not in hosts:
        return (
            400,
            (
                f"Host {host_header!r} is not allowed: this server answers to its loopback names only; "
                "start it with --allowed-host NAME to serve another name"
            ),
            "host_not_allowed",
        )
    method = scope.get("method", "GET")
    origin = headers.get("origin")
    if origin is not None and (scope["type"] == "websocket" or method in UNSAFE_METHODS):
        if not _same_origin(origin, host_header) and origin.rstrip("/").lower() not in origins and "*" not in origins:
            return (
                403,
                (f"cross-origin request from {origin} refused; allow that origin with --cors-origin {origin}"),
                "origin_not_allowed",
            )
    if scope["type"] == "http" and method in ("POST", "PUT", "PATCH") and _has_body(headers):
        accepted = UPLOAD_TYPES.get(scope["path"].rstrip("/"), JSON_TYPES)
        given = headers.get("content-type", "").split(";")[0].strip().lower()
        if given not in accepted:
            return (
                415,
                (
                    f"send the request body as {' or '.join(accepted)}"
                    f"{f' (got {given})' if given else ' (no Content-Type was sent)'}"
                ),
                "unsupported_media_type",
            )
    return None


def _hostname(host_header: str) -> str:
    host = host_header.strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[: host.find("]") + 1]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _same_origin(origin: str, host_header: str) -> bool:
    return urlsplit(origin).netloc.lower() == host_header.strip().lower()


def _has_body(headers: dict[str, str]) -> bool:
    return headers.get("content-length", "0") not in ("", "0") or "transfer-encoding" in headers


async def _refuse(scope: Scope, send: Send, status: int, message: str, code: str) -> None:
    if scope["type"] == "websocket":  # closing before accepting answers the handshake with a 403
        await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
        return
    body = msgspec.json.encode(error_body(status, message, code=code))
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
