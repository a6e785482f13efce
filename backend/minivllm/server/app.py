"""The app factory: `create_app(config)` wires the routers, the engine lifespan and the error shape.

Routers per concern: the OpenAI API (/v1), the dashboard API (/api), the live event stream
(/ws/events), operations (/health, /metrics) and the built dashboard (/). The engine lives on
`app.state.server` and is started and stopped in the lifespan.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from litestar import Litestar
from litestar.config.cors import CORSConfig
from litestar.datastructures import State
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import SwaggerRenderPlugin

from minivllm.engine.api import LLMEngine
from minivllm.server.ablation_api import AblationRunner, ablation_router
from minivllm.server.config import ServerConfig
from minivllm.server.dashboard_api import dashboard_router
from minivllm.server.embeddings_api import embeddings_router
from minivllm.server.errors import handle_exception
from minivllm.server.events_ws import events_router
from minivllm.server.exposure import exposure_guard
from minivllm.server.middleware import request_id_middleware
from minivllm.server.openai_api import openai_router
from minivllm.server.openapi_doc import DocumentedJsonRenderPlugin
from minivllm.server.ops import health, metrics
from minivllm.server.replicas import replicas_router
from minivllm.server.response_store import ResponseStore
from minivllm.server.responses_api import responses_router
from minivllm.server.state import ServerState
from minivllm.server.static import frontend, frontend_index
from minivllm.server.tokenize_api import tokenize_router, version


@asynccontextmanager
async def _lifespan(app: Litestar) -> AsyncIterator[None]:
    server: ServerState = app.state.server
    server.start()
    try:
        yield
    finally:
        await app.state.ablation.stop()
        await server.stop()


def create_app(config: ServerConfig | LLMEngine) -> Litestar:
    if isinstance(config, LLMEngine):
        config = ServerConfig(engine=config)
    openapi = OpenAPIConfig(
        title="mini-vllm",
        version="0.1.0",
        path="/docs",
        description="OpenAI-compatible API, dashboard API and live engine events.",
        render_plugins=[SwaggerRenderPlugin(path="/"), DocumentedJsonRenderPlugin(path="/openapi.json")],
    )
    return Litestar(
        route_handlers=[
            openai_router(),
            responses_router(),
            replicas_router(),
            embeddings_router(),
            tokenize_router(),
            dashboard_router(),
            ablation_router(),
            events_router(),
            health,
            metrics,
            version,
            frontend_index,
            frontend,
        ],
        lifespan=[_lifespan],
        state=State(
            {
                "server": ServerState(config),
                "responses": ResponseStore(config.responses_max_stored, config.responses_ttl_s),
                "ablation": AblationRunner(config.model_spec, config.enable_ablation),
            }
        ),
        middleware=[request_id_middleware, exposure_guard(config.allowed_hosts, config.cors_origins)],
        exception_handlers={Exception: handle_exception},
        cors_config=CORSConfig(allow_origins=config.cors_origins, expose_headers=["X-Request-Id"])
        if config.cors_origins
        else None,
        openapi_config=openapi,
        request_max_body_size=config.max_body_size,
    )
