"""`minivllm serve`: uvicorn running `create_app`, the model loading in the background."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from pathlib import Path

import uvicorn

from minivllm.engine.api import LLMEngine, parse_memory
from minivllm.server.app import create_app
from minivllm.server.config import ServerConfig
from minivllm.server.exposure import allowed_hosts_for, redact_api_keys
from minivllm.server.recordings import RecordingLimits


def serve(args: argparse.Namespace, build_engine: Callable[[], LLMEngine]) -> int:
    """Serve until interrupted; `build_engine` loads the model in the background."""
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("uvicorn.access").addFilter(redact_api_keys)
    config = ServerConfig(
        engine=build_engine,
        api_key=args.api_key or os.environ.get("MINIVLLM_API_KEY") or None,
        cors_origins=list(args.cors_origin),
        allowed_hosts=allowed_hosts_for(args.host, args.allowed_host),
        recordings_dir=Path(args.recordings_dir),
        server_name=f"{args.host}:{args.port}",
        recording_limits=RecordingLimits(max_total_bytes=parse_memory(args.recordings_quota)),
        frontend_dist=Path(args.frontend_dist) if args.frontend_dist else None,
        ws_queue_limit=args.ws_queue_limit,
        trust_request_chat_template=args.trust_request_chat_template,
        embedding_pooling=args.embedding_pooling,
        enable_ablation=True,
        model_spec=args.model,
    )
    print(
        f"[minivllm] serving on http://{args.host}:{args.port} (dashboard at /, API docs at /docs); "
        "the model loads in the background: GET /health answers 200 when it is ready",
        flush=True,
    )
    uvicorn.run(
        create_app(config), host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    return 0
