"""The built dashboard (frontend/dist) at `/`, with index.html for client-side routes."""

from __future__ import annotations

from pathlib import Path

from litestar import Request, Response, get
from litestar.params import FromPath
from litestar.response import File

from minivllm.server.errors import APIError

_API_PREFIXES = ("v1/", "api/", "ws/", "docs/")
NOT_BUILT = """<!doctype html>
<html><head><meta charset="utf-8"><title>mini-vllm</title></head>
<body style="font-family: sans-serif; max-width: 40em; margin: 3em auto">
<h1>mini-vllm is running</h1>
<p>The dashboard has not been built ({dist} does not exist). Build it with
<code>cd frontend &amp;&amp; npm install &amp;&amp; npm run build</code>, then reload.</p>
<p>The OpenAI-compatible API is at <code>/v1</code>; the API docs are at <a href="/docs">/docs</a>.</p>
</body></html>
"""


@get("/", include_in_schema=False)
async def frontend_index(request: Request) -> Response | File:
    return _serve(request, "")


@get("/{file_path:path}", include_in_schema=False)
async def frontend(request: Request, file_path: FromPath[str]) -> Response | File:
    return _serve(request, file_path)


def _serve(request: Request, file_path: str) -> Response | File:
    dist: Path = request.app.state.server.config.dist_dir.resolve()
    relative = file_path.lstrip("/")
    if relative.startswith(_API_PREFIXES):
        raise APIError(404, f"no route for {request.method} /{relative}")
    index = dist / "index.html"
    if not index.is_file():
        return Response(NOT_BUILT.format(dist=dist), media_type="text/html")
    target = (dist / relative).resolve()
    if relative and target.is_file() and target.is_relative_to(dist):
        return File(target, filename=target.name, content_disposition_type="inline")
    if Path(relative).suffix and relative != "index.html":
        raise APIError(404, f"no file /{relative} in the dashboard build")
    return File(index, filename="index.html", content_disposition_type="inline")
