"""Operations: GET /health (200 ready, 503 loading / failed / dead) and GET /metrics (Prometheus)."""

from __future__ import annotations

from litestar import Request, Response, get

from minivllm.engine.api import EngineDeadError, ReplicaSet
from minivllm.server.api_types import HealthStatus
from minivllm.server.metrics import CONTENT_TYPE, EngineGauges
from minivllm.server.state import ServerState


@get("/health", summary="200 when ready; 503 while loading or when the engine died", tags=["Operations"])
async def health(request: Request) -> Response:
    server: ServerState = request.app.state.server
    status = server.status
    reason = None
    if status == "failed":
        reason = server.load_error
    elif status == "dead" and server.async_engine is not None:
        reason = server.async_engine.dead_reason
    body = HealthStatus(status=status, model=server.model_name, reason=reason)  # type: ignore[arg-type]
    return Response(body, status_code=200 if status == "ready" else 503)


@get("/metrics", summary="Prometheus metrics", tags=["Operations"])
async def metrics(request: Request) -> Response:
    server: ServerState = request.app.state.server
    gauges: list[EngineGauges] = []
    ae = server.async_engine
    if isinstance(ae, ReplicaSet) and ae.is_alive:  # one series per live replica, labelled with it
        gauges = [EngineGauges(ae.model_name, stats, str(i)) for i, stats in await ae.replica_stats()]
    elif ae is not None and ae.is_alive:
        try:
            gauges = [EngineGauges(ae.model_name, await ae.stats())]
        except EngineDeadError:
            gauges = []
    return Response(server.metrics.render(gauges), media_type=CONTENT_TYPE)
