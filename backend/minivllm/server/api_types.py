"""Dashboard API wire types (the OpenAI API shapes live in `openai_protocol.py`)."""

from __future__ import annotations

from typing import Literal

import msgspec

from minivllm.events.types import EngineInfo, ReplicasState


class ConfigUpdate(msgspec.Struct, kw_only=True):
    """PUT /api/config: any subset; applied by rebuilding the engine while it is idle."""

    num_blocks: int | None = None
    block_size: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enable_prefix_caching: bool | None = None
    kv_cache_dtype: Literal["auto", "float32", "float16", "bfloat16", "int8", "fp8_e4m3"] | None = None


class RecordingInfo(msgspec.Struct, kw_only=True):
    id: str
    created: str  # ISO 8601
    num_events: int
    duration_s: float
    size_bytes: int
    active: bool  # still being written
    server: str = ""  # the server that recorded it (host-port), "upload", or "" when unknown
    mine: bool = False  # recorded by this server (servers run from one checkout share ./recordings)


class RecordingStatus(msgspec.Struct, kw_only=True):
    recording: RecordingInfo | None  # the active recording, if any


class RequestTimings(msgspec.Struct, kw_only=True):
    """Extra field `timings` on OpenAI responses (and the usage chunk when streaming)."""

    ttft_s: float | None
    queue_s: float | None
    e2e_s: float | None
    tokens_per_s: float | None  # generated tokens / decode time
    prompt_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    num_preemptions: int


class HealthStatus(msgspec.Struct, kw_only=True):
    """GET /health: 200 when `ready`; 503 while `loading`, or when loading `failed` or the engine is `dead`."""

    status: Literal["loading", "ready", "failed", "dead"]
    model: str | None  # the served model's id, once known
    reason: str | None = None  # why it failed / died


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


WIRE_TYPES: list[type] = [
    EngineInfo,
    ConfigUpdate,
    RecordingInfo,
    RecordingStatus,
    RequestTimings,
    HealthStatus,
    ErrorBody,
    ReplicasState,
]
