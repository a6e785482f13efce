// Wire types used across the app: the generated ones re-exported, plus names for their inline unions.
export type {
  AnyEvent,
  BlockState,
  BlocksAllocated,
  BlocksCached,
  BlocksCopied,
  BlocksEvicted,
  BlocksFreed,
  BlocksShared,
  ConfigChanged,
  ConfigUpdate,
  DiskTierStats,
  EngineInfo,
  ErrorBody,
  EventBatch,
  MemorySplit,
  MetricsSample,
  RecordingFooter,
  RecordingHeader,
  RecordingInfo,
  RecordingStatus,
  ReplicaState,
  ReplicasState,
  RequestArrived,
  RequestState,
  RequestStateChanged,
  RequestTimings,
  Resync,
  RoutingDecision,
  ScheduledChunk,
  SeqAdded,
  SeqRemoved,
  SeqState,
  Snapshot,
  SpecVerified,
  StepFinished,
  StepScheduled,
  TokenGenerated,
  WsMessage,
} from "../generated/wire";
import type { AnyEvent, RequestState } from "../generated/wire";

export type RequestStateName = RequestState["state"];
export type FinishReason = NonNullable<RequestState["finish_reason"]>;
export type EventType = AnyEvent["type"];
/** One event of the given `type` tag. */
export type EventOf<T extends EventType> = Extract<AnyEvent, { type: T }>;

export const EVENT_TYPES: readonly EventType[] = [
  "request_arrived",
  "request_state",
  "seq_added",
  "seq_removed",
  "token",
  "step_scheduled",
  "spec_verified",
  "step_finished",
  "metrics",
  "blocks_allocated",
  "blocks_shared",
  "blocks_freed",
  "blocks_cached",
  "blocks_evicted",
  "blocks_copied",
  "config_changed",
];

