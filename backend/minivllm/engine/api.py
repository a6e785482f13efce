"""The engine's surface for the server: everything server/ may import from the engine.

The server drives the engine only through `AsyncEngine` (requests, snapshots, stats, event
subscriptions, reconfiguration); it never reads the engine's internals. A test checks that no
module under server/ imports another engine module or anything from core/.
"""

from minivllm.core.pooling import POOLING_TYPES, PoolingParams
from minivllm.engine.async_engine import AsyncEngine
from minivllm.engine.config import EngineConfig, parse_memory
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.outputs import CompletionOutput, OutputAccumulator, PoolingRequestOutput, RequestOutput
from minivllm.engine.replica_set import ReplicaSet, ReplicaStatus, connect_ray
from minivllm.engine.telemetry import EngineStats
from minivllm.errors import EngineBusyError, EngineDeadError, RequestFailedError, RequestRejectedError
from minivllm.quant.policy import QuantConfig
from minivllm.structured.params import StructuredOutputsParams, check_schema_depth

__all__ = [
    "AsyncEngine",
    "CompletionOutput",
    "EngineBusyError",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "LLMEngine",
    "OutputAccumulator",
    "POOLING_TYPES",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestFailedError",
    "RequestOutput",
    "RequestRejectedError",
    "StructuredOutputsParams",
    "check_schema_depth",
    "parse_memory",
    "QuantConfig",
    "ReplicaSet",
    "ReplicaStatus",
    "connect_ray",
]
