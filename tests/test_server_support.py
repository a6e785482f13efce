"""Helpers shared by the server tests (no tests here): one tiny model per session, app builders,
SSE parsing and polling with a deadline."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.server.app import create_app
from minivllm.server.config import ServerConfig


@functools.cache
def tiny_model():
    """random:tiny with the embedded tokenizer (and its chat template): fast, serves real text."""
    from minivllm.loader import load_model

    return load_model("random:tiny", device="cpu")


def tiny_engine(**config) -> LLMEngine:
    config.setdefault("num_blocks", 64)
    config.setdefault("max_num_seqs", 8)
    config.setdefault("max_model_len", 512)
    return LLMEngine(tiny_model(), EngineConfig(**config))


def tiny_app(tmp_path: Path, engine: LLMEngine | None = None, **server_config):
    server_config.setdefault("recordings_dir", tmp_path / "recordings")
    server_config.setdefault("frontend_dist", tmp_path / "no-dist")
    return create_app(ServerConfig(engine=engine or tiny_engine(), **server_config))


def wait_for(condition: Callable[[], Any], timeout: float = 10.0, interval: float = 0.01, what: str = "condition"):
    """Poll until `condition()` is truthy; return its value or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def sse_events(text: str) -> list[Any]:
    """`data: {json}\\n\\n` frames -> decoded JSON objects, with "[DONE]" kept as the string."""
    assert text.endswith("\n\n"), "an SSE body ends with a blank line"
    frames = text.split("\n\n")[:-1]
    out = []
    for frame in frames:
        assert frame.startswith("data: "), f"not an SSE data frame: {frame!r}"
        payload = frame[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def server_of(app):
    return app.state.server
