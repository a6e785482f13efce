"""The dashboard's REST API: state, engine configuration and recordings (everything under /api)."""

from __future__ import annotations

import msgspec
from litestar import Request, Response, Router, get, post, put
from litestar.params import FromPath
from litestar.response import File

from minivllm.engine.api import EngineBusyError
from minivllm.events import types as ev
from minivllm.server.api_types import ConfigUpdate, RecordingInfo, RecordingStatus
from minivllm.server.auth import require_api_key
from minivllm.server.chrome_trace import chrome_trace
from minivllm.server.config import MAX_UPLOAD_SIZE
from minivllm.server.errors import APIError, bad_request, decode_body
from minivllm.server.state import server_of


@get("/state", summary="A full snapshot of the engine (the WebSocket's first message)")
async def get_state(request: Request) -> ev.Snapshot:
    return await server_of(request).engine().snapshot()


@get("/config", summary="The engine configuration")
async def get_config(request: Request) -> ev.EngineInfo:
    return await server_of(request).engine().info()


@put("/config", summary="Rebuild the engine with new settings (409 while requests run)")
async def put_config(request: Request) -> ev.EngineInfo:
    update = _config_update(await request.body())
    changes = {k: v for k, v in ((f, getattr(update, f)) for f in ConfigUpdate.__struct_fields__) if v is not None}
    engine = server_of(request).engine()
    try:
        return await (engine.reconfigure(**changes) if changes else engine.info())
    except EngineBusyError as exc:
        raise APIError(409, str(exc), code="engine_busy") from None
    except ValueError as exc:
        raise bad_request(str(exc), getattr(exc, "param", None)) from None


def _config_update(body: bytes) -> ConfigUpdate:
    """The update, with every field named: one it cannot change is a 400 naming it, never dropped."""
    update = decode_body(body, ConfigUpdate)  # malformed JSON and wrong types first, as everywhere
    settable = ConfigUpdate.__struct_fields__
    given = msgspec.json.decode(body, type=dict[str, msgspec.Raw])  # the keys only: values stay undecoded
    refused = [name for name in given if name not in settable]
    if refused:
        kinds = [
            "read-only (set when the server starts)" if name in ev.EngineInfo.__struct_fields__ else "unknown"
            for name in refused
        ]
        named = ", ".join(f"{name} ({kind})" for name, kind in zip(refused, kinds))
        raise bad_request(f"PUT /api/config cannot change {named}; it takes {', '.join(settable)}", refused[0])
    return update


@post("/recordings/start", status_code=201, summary="Start recording the event stream")
async def start_recording(request: Request) -> RecordingInfo:
    server = server_of(request)
    return await server.recordings.start(server.engine())


@post("/recordings/stop", status_code=200, summary="Stop the running recording (writes its final snapshot)")
async def stop_recording(request: Request) -> RecordingInfo:
    server = server_of(request)
    return await server.recordings.stop(server.engine())


@get("/recordings/status", summary="The running recording, if any")
async def recording_status(request: Request) -> RecordingStatus:
    store = server_of(request).recordings
    return RecordingStatus(recording=store.info(store.active.id) if store.active else None)


@get("/recordings", summary="Recordings on disk, newest first")
async def list_recordings(request: Request) -> list[RecordingInfo]:
    return server_of(request).recordings.list()


@get("/recordings/{recording_id:str}", summary="Download a recording (JSONL)")
async def download_recording(request: Request, recording_id: FromPath[str]) -> File:
    path = server_of(request).recordings.path(recording_id)
    return File(path, filename=path.name, media_type="application/x-ndjson")


@post(
    "/recordings",
    status_code=201,
    summary="Upload a recording (JSONL body or multipart file)",
    request_max_body_size=MAX_UPLOAD_SIZE,
)
async def upload_recording(request: Request) -> RecordingInfo:
    store = server_of(request).recordings
    if request.content_type[0] == "multipart/form-data":
        form = await request.form()
        uploads = [v for v in form.values() if hasattr(v, "read")]
        if not uploads:
            raise bad_request("the multipart body has no file", "file")
        body = await uploads[0].read()
    else:
        body = await request.body()
    return store.save_upload(body)


@get("/recordings/{recording_id:str}/trace", summary="A recording as a Chrome trace (opens in Perfetto)")
async def recording_trace(request: Request, recording_id: FromPath[str]) -> Response:
    recording = server_of(request).recordings.load(recording_id)
    return Response(
        chrome_trace(recording), headers={"Content-Disposition": f'attachment; filename="{recording_id}.trace.json"'}
    )


def dashboard_router() -> Router:
    return Router(
        "/api",
        route_handlers=[
            get_state,
            get_config,
            put_config,
            start_recording,
            stop_recording,
            recording_status,
            list_recordings,
            download_recording,
            upload_recording,
            recording_trace,
        ],
        guards=[require_api_key],
        tags=["Dashboard API"],
    )
