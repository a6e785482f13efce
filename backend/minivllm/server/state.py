"""The server's state on `app.state.server`: the engine (once loaded), recordings and metrics.

With a prebuilt engine the server is ready as soon as the lifespan starts. Otherwise the model
loads in a background thread, so the server answers `/health` (503) while it loads.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time

from minivllm.engine.api import AsyncEngine, LLMEngine, ReplicaSet
from minivllm.server.config import ServerConfig
from minivllm.server.errors import APIError
from minivllm.server.metrics import ServerMetrics
from minivllm.server.openai_serving import TokenText
from minivllm.server.recordings import RecordingStore

log = logging.getLogger("minivllm.server")


class ServerState:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.async_engine: AsyncEngine | ReplicaSet | None = None
        self.load_error: str | None = None
        self.model_name: str | None = None
        self.max_model_len: int | None = None
        self.created = int(time.time())
        self.metrics = ServerMetrics()
        self.recordings = RecordingStore(config.recordings_dir, config.recording_limits, config.server_name)
        self.token_text: TokenText | None = None
        self.ws_clients = 0
        self._loader: threading.Thread | None = None

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if isinstance(self.config.engine, (LLMEngine, ReplicaSet)):  # built already (tests): ready at once
            self._attach(self.config.engine)
            return
        self._loader = threading.Thread(target=self._load, name="minivllm-loader", daemon=True)
        self._loader.start()

    def _load(self) -> None:
        try:
            engine = self.config.engine()  # type: ignore[operator]
        except BaseException as exc:  # noqa: BLE001 - reported by /health
            log.exception("loading the model failed")
            self.load_error = f"loading the model failed: {exc}"
            return
        self._attach(engine)
        log.info("model %s ready", self.model_name)

    def _attach(self, engine: LLMEngine | ReplicaSet) -> None:
        ae = engine if isinstance(engine, ReplicaSet) else AsyncEngine(engine)  # replicas: already running
        self.model_name, self.max_model_len = ae.model_name, ae.max_model_len
        self.token_text = TokenText(ae.tokenizer)
        _freeze_loaded_heap()
        self.async_engine = ae.start()

    async def stop(self) -> None:
        ae = self.async_engine
        if ae is None:
            return
        if self.recordings.active is not None and ae.is_alive:
            try:
                await self.recordings.stop(ae)
            except Exception:  # noqa: BLE001 - shutting down anyway
                log.exception("could not finish the active recording")
        await asyncio.to_thread(ae.shutdown)
        gc.unfreeze()  # what the server held goes back to the collector (a test process starts many servers)

    # ---- access -------------------------------------------------------------------------------

    @property
    def status(self) -> str:
        if self.load_error is not None:
            return "failed"
        if self.async_engine is None:
            return "loading"
        return "ready" if self.async_engine.is_alive else "dead"

    def engine(self) -> AsyncEngine:  # or a ReplicaSet, which answers the same calls
        """The running engine, or a 503 that says why there is none."""
        ae = self.async_engine
        if ae is not None and ae.is_alive:
            return ae
        if self.load_error is not None:
            raise APIError(503, self.load_error, code="model_load_failed")
        if ae is None:
            raise APIError(503, "the model is still loading; retry when GET /health answers 200", code="model_loading")
        raise APIError(503, ae.dead_reason or "the engine is not running", code="engine_dead")


def _freeze_loaded_heap() -> None:
    """Collects once, then hides what survives from the collector (`gc.freeze`): the loaded model, torch,
    transformers and the tokenizer stay alive for good, yet every full collection walked them all while holding
    the GIL, a pause in every stream (measured: 0.12 s for a tiny model's server, 250k objects; more with every
    module a process imports). Full collections then walk only what came after."""
    gc.collect()
    gc.freeze()


def server_of(request) -> ServerState:
    """The ServerState of the app handling this request."""
    return request.app.state.server
