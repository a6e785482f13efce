"""What `create_app` needs: the engine (or how to build it) and the server's own settings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from minivllm.engine.api import POOLING_TYPES, LLMEngine, ReplicaSet
from minivllm.server.recordings import RecordingLimits

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_FRONTEND_DIST = REPO_ROOT / "frontend" / "dist"
MiB = 1 << 20
MAX_UPLOAD_SIZE = 512 * MiB  # POST /api/recordings (other routes: ServerConfig.max_body_size)


@dataclass
class ServerConfig:
    # A built engine (tests: ready at once) or a function that builds one; the function runs in a
    # background thread at startup so /health can answer 503 while the model loads.
    # (or, with --data-parallel-size, one that launches the replicas)
    engine: LLMEngine | ReplicaSet | Callable[[], LLMEngine | ReplicaSet]
    api_key: str | None = None  # guards /v1, /api, /ws, /tokenize and /detokenize when set
    cors_origins: list[str] = field(default_factory=list)
    # Host names served when bound to loopback (None: no Host check; see server/exposure.py)
    allowed_hosts: list[str] | None = None
    recordings_dir: Path = Path("recordings")
    server_name: str = ""  # host:port, named in the recordings this server makes
    recording_limits: RecordingLimits = field(default_factory=RecordingLimits)
    frontend_dist: Path | None = None  # None: frontend/dist in the repo
    ws_queue_limit: int = 20_000  # events buffered per WebSocket client before it is resynced
    ws_flush_interval_s: float = 0.05  # flush events that arrive outside engine steps this often
    max_ws_clients: int = 32  # each takes a snapshot on the engine thread and a feed of events
    max_body_size: int = 4 * MiB  # larger request bodies get a 413
    # /v1/responses: finished responses kept for previous_response_id (least recently used dropped first)
    responses_max_stored: int = 1000
    responses_ttl_s: float = 3600.0
    # A request's own `chat_template` runs Jinja on the tokenizer pool; as in vLLM, only when trusted
    trust_request_chat_template: bool = False
    # /v1/embeddings: the last token's final hidden state or the mean over all tokens (vLLM's poolers)
    embedding_pooling: str = "last"
    # The dashboard's ablation button loads the served model again per configuration: only a server
    # started by `minivllm serve` knows what it loaded (model_spec: --model; None for the embedded one)
    enable_ablation: bool = False
    model_spec: str | None = None

    def __post_init__(self) -> None:
        if self.embedding_pooling not in POOLING_TYPES:
            raise ValueError(
                f"embedding_pooling must be one of {', '.join(POOLING_TYPES)}, got {self.embedding_pooling!r}"
            )

    @property
    def dist_dir(self) -> Path:
        return Path(self.frontend_dist) if self.frontend_dist else DEFAULT_FRONTEND_DIST
