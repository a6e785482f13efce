"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for every route."""

from __future__ import annotations

import functools
import logging
import re
import typing

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException

from minivllm.engine.api import RequestFailedError
from minivllm.server.api_types import ErrorBody, ErrorDetail
from minivllm.server.middleware import SCOPE_KEY

log = logging.getLogger("minivllm.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised by handlers; becomes an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> ErrorBody:
    return ErrorBody(
        error=ErrorDetail(message=message, type=_TYPES.get(status, "invalid_request_error"), param=param, code=code)
    )


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> Response:
    return Response(error_body(status, message, param, code), status_code=status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


_PATH = re.compile(r"at `\$\.([A-Za-z_][\w]*)")
_UNKNOWN = re.compile(r"^Object contains unknown field `([^`]*)`(?: - at `\$\.?([^`]*)`)?")


def decode_error(exc: msgspec.DecodeError | msgspec.ValidationError, kind: type | None = None) -> APIError:
    """msgspec's message names the offending field as `$.field`: report it as the param. A value
    outside a field's fixed choices gets the choices listed (msgspec names only the bad value)."""
    text = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        unknown = _UNKNOWN.match(text)
        if unknown:  # OpenAI's wording; nested fields are named by their path
            name = ".".join(filter(None, (unknown.group(2), unknown.group(1))))
            return bad_request(f"Unrecognized request argument supplied: {name}", name)
        m = _PATH.search(text)
        choices = _literal_choices(kind, m.group(1)) if m and kind and "Invalid enum value" in text else None
        if choices:
            text += "; expected one of " + ", ".join(repr(c) for c in choices)
        return bad_request(f"invalid request body: {text}", m.group(1) if m else None)
    return bad_request(f"malformed JSON body: {text}")


def _literal_choices(kind: type, field: str) -> tuple | None:
    """The values a `Literal[...]` (or `Literal[...] | None`) field of `kind` allows, else None."""
    try:
        hint = typing.get_type_hints(kind).get(field)
    except Exception:  # noqa: BLE001 - an unresolvable annotation: no list, the plain message stays
        return None
    for candidate in (hint, *typing.get_args(hint)):
        if typing.get_origin(candidate) is typing.Literal:
            return typing.get_args(candidate)
    return None


@functools.cache
def _decoder(kind: type) -> msgspec.json.Decoder:
    return msgspec.json.Decoder(kind)


def decode_body(body: bytes, kind: type):
    if not body.strip():
        raise bad_request("the request body is empty; expected a JSON object")
    try:
        return _decoder(kind).decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise decode_error(exc, kind) from None
    except RecursionError:  # msgspec decodes nested values recursively: a body thousands of levels deep
        raise bad_request("the request body nests arrays and objects too deeply to decode") from None


def decode_either(body: bytes, plain: tuple[str, str, type], chat: type):
    """vLLM's two request shapes on one route: `plain` (its field, what the field holds, its type) or a
    chat (`messages`, type `chat`), chosen by which field the body has; both or neither is a 400."""
    field, holds, plain_kind = plain
    raw = decode_body(body, dict[str, typing.Any])
    has_plain, has_messages = field in raw, "messages" in raw
    if has_plain and has_messages:
        raise bad_request(f"send either `{field}` ({holds}) or `messages` (a chat), not both", "messages")
    if not (has_plain or has_messages):
        raise bad_request(f"the body needs `{field}` ({holds}) or `messages` (a chat)", field)
    kind = plain_kind if has_plain else chat
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        raise decode_error(exc, kind) from None


_PARAM = re.compile(r"\{[^}]+\}")
_CATCH_ALL = "/{file_path:path}"


def _has_route(request: Request) -> bool:
    """Whether a route other than the dashboard's catch-all declares this path (any method)."""
    path = request.url.path.rstrip("/") or "/"
    for route in request.app.routes:
        if route.path != _CATCH_ALL and re.fullmatch(_PARAM.sub("[^/]+", route.path.rstrip("/") or "/"), path):
            return True
    return False


def handle_exception(request: Request, exc: Exception) -> Response:
    """The app's one exception handler: known errors keep their status, the rest are 500s."""
    if isinstance(exc, APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code)
    if isinstance(exc, HTTPException):
        detail = exc.detail
        if exc.status_code == 413:
            detail = "the request body is too large"
        elif exc.status_code == 404 or (exc.status_code == 405 and not _has_route(request)):
            # a 405 on a path no route declares comes from the dashboard's GET catch-all: a 404
            return error_response(404, f"no route for {request.method} {request.url.path}")
        return Response(error_body(exc.status_code, detail), status_code=exc.status_code, headers=exc.headers or None)
    if isinstance(exc, RequestFailedError):  # the engine's own account of what failed in the request
        if exc.param is not None:  # the request's own input could not be followed
            return error_response(400, str(exc), exc.param)
        return error_response(500, str(exc), code="request_failed")
    log.exception("internal error while handling %s %s", request.method, request.url.path)
    # the exception text can hold paths and internals: it goes to the log, not to the client
    return error_response(
        500,
        f"internal server error ({type(exc).__name__}); the server log has the details "
        f"under request id {request.scope.get(SCOPE_KEY, '?')}",
        code="internal_error",
    )
