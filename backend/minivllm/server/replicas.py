"""GET /v1/replicas: the engine replicas (`--data-parallel-size`), their load and the router's
latest decisions; with one engine, an empty list (the dashboard hides its replica views)."""

from __future__ import annotations

from litestar import Request, Router, get

from minivllm.engine.api import ReplicaSet
from minivllm.events import types as ev
from minivllm.server.auth import require_api_key
from minivllm.server.state import server_of


@get("/replicas", summary="Engine replicas and the router's latest decisions")
async def list_replicas(request: Request) -> ev.ReplicasState:
    ae = server_of(request).async_engine
    if not isinstance(ae, ReplicaSet):
        return ev.ReplicasState()
    rows = [
        ev.ReplicaState(
            id=r.index,
            node=r.node,
            alive=r.alive,
            running=r.running,
            waiting=r.waiting,
            routed=r.routed,
            prefix_hit_rate=round(r.prefix_hit_rate, 4),
            dead_reason=r.dead_reason,
        )
        for r in await ae.status()
    ]
    decisions = [
        ev.RoutingDecision(
            request_id=d.request_id,
            replica=d.replica,
            matched_blocks=d.matched_blocks,
            prompt_blocks=d.prompt_blocks,
            reason=d.reason,  # type: ignore[arg-type]
        )
        for d in ae.router.decisions
    ]
    return ev.ReplicasState(policy=ae.router.policy, replicas=rows, decisions=decisions)


def replicas_router() -> Router:
    return Router("/v1", route_handlers=[list_replicas], guards=[require_api_key], tags=["Replicas"])
