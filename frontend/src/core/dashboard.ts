// The dashboard's one reducer: the engine fold (fold.ts) plus what the panels need — timeline
// segments per request, prefill chunk ticks and speculative verify marks, scheduler step rows, an
// event log, metrics history, latency samples, eviction times, the generated tokens (each with the
// verification that produced it) and each request's speculative verifications. Live view and
// replay both call `reduce(state, events)`; it is pure (the input state is never changed), so replay
// checkpoints can be kept and folded forward again.
import { EngineDraft, stateFromSnapshot, type EngineState, type RequestView } from "./fold";
import { ring, ringPush, type Ring } from "./ring";
import type {
  AnyEvent,
  FinishReason,
  MetricsSample,
  RequestStateName,
  Snapshot,
  SpecVerified,
  StepFinished,
  StepScheduled,
} from "./wire";

/** A timeline segment's kind: an engine state, ABORTED (finished by an abort), or UNKNOWN (history
 * from before this dashboard saw the request: it joined through a snapshot). */
export type SegmentState = RequestStateName | "ABORTED" | "UNKNOWN";

export interface Segment {
  readonly state: SegmentState;
  readonly start: number;
  /** null while open; equal to start for the terminal FINISHED / ABORTED mark. */
  readonly end: number | null;
  readonly reason: string;
}

export interface ChunkTick {
  readonly ts: number;
  readonly seq_id: number;
  readonly start: number;
  readonly num_tokens: number;
}

/** A verify step of speculative decoding: a scheduled chunk with drafted tokens (num_draft > 0). */
export interface VerifyMark {
  readonly ts: number;
  readonly step: number;
  readonly seq_id: number;
  readonly num_draft: number;
  /** Drafts kept, once the step's SpecVerified arrived; null until then. */
  readonly accepted: number | null;
}

export interface RequestTimeline {
  readonly request_id: string;
  readonly arrival_ts: number;
  readonly segments: readonly Segment[];
  readonly ticks: readonly ChunkTick[];
  /** Verify steps, oldest first (at most limits.maxTokensPerRequest). */
  readonly verifies: readonly VerifyMark[];
}

export interface TokenEntry {
  readonly seq_id: number;
  readonly token_id: number;
  readonly text: string;
  readonly logprob: number | null;
  readonly ts: number;
  /** An accepted draft (speculative decoding). */
  readonly drafted: boolean;
  /** Structured outputs: the share of the vocabulary the grammar allowed at this token; null when
   * the token was not constrained. */
  readonly allowed_fraction: number | null;
  /** The verification of the step that produced this token (its sequence's SpecVerified), if any:
   * set on the accepted drafts and on the target's own token after them. */
  readonly verify: SpecVerified | null;
}

/** A request's speculative verifications (every sequence's, oldest first) and their totals. */
export interface RequestSpec {
  readonly verifies: Ring<SpecVerified>;
  readonly drafts: number;
  readonly draftTokens: number;
  readonly accepted: number;
}

export interface LatencySample {
  readonly request_id: string;
  readonly ts: number;
  /** First token minus arrival, seconds. */
  readonly ttft: number | null;
  /** Mean time per output token after the first (per sequence), seconds. */
  readonly tpot: number | null;
  readonly e2e: number;
  readonly finish_reason: FinishReason | null;
}

export interface DashboardLimits {
  /** Finished requests kept (oldest dropped first), as the engine keeps a history for snapshots. */
  readonly maxFinished: number;
  readonly maxTokensPerRequest: number;
  readonly logSize: number;
  readonly stepRows: number;
  readonly metricsSamples: number;
  readonly latencySamples: number;
}

export const DEFAULT_LIMITS: DashboardLimits = {
  maxFinished: 256,
  maxTokensPerRequest: 8192,
  logSize: 2000,
  stepRows: 2000,
  metricsSamples: 3600,
  latencySamples: 4000,
};

export interface DashboardState {
  readonly engine: EngineState;
  readonly timelines: ReadonlyMap<string, RequestTimeline>;
  readonly tokens: ReadonlyMap<string, Ring<TokenEntry>>;
  /** Speculative verifications per request (only requests that had one). */
  readonly spec: ReadonlyMap<string, RequestSpec>;
  readonly steps: Ring<StepScheduled>;
  readonly stepTimes: Ring<StepFinished>;
  readonly log: Ring<AnyEvent>;
  readonly metrics: Ring<MetricsSample>;
  readonly latencies: Ring<LatencySample>;
  /** Engine time of each block's last eviction (NaN: never). Never written after creation. */
  readonly evictedAt: Float64Array;
  /** Engine time each block was last read back from the disk tier (NaN: never). As `evictedAt`. */
  readonly restoredAt: Float64Array;
  /** Engine time each block last left a sliding KV window (--kv-window; NaN: never). As `evictedAt`. */
  readonly droppedAt: Float64Array;
  /** Time of the first snapshot this state grew from: the left edge of the timeline. */
  readonly originTs: number;
  /** Bumped whenever the engine was rebuilt (ConfigChanged) or a snapshot replaced the state. */
  readonly epoch: number;
  readonly limits: DashboardLimits;
}

// ---- from a snapshot ----------------------------------------------------------------------------------

function snapshotTimeline(r: RequestView, at: number, previous?: RequestTimeline): RequestTimeline {
  const terminal = (): Segment => ({
    state: r.finish_reason === "abort" ? "ABORTED" : "FINISHED",
    start: r.finish_ts ?? at,
    end: r.finish_ts ?? at,
    reason: r.finish_reason ? `finished: ${r.finish_reason}` : "finished",
  });
  if (previous !== undefined) {
    const segments = previous.segments.slice();
    const last = segments[segments.length - 1];
    const lastState = last?.state === "ABORTED" ? "FINISHED" : last?.state;
    if (last !== undefined && lastState === r.state) return previous;
    if (last !== undefined && last.end === null) segments[segments.length - 1] = { ...last, end: at };
    segments.push(r.state === "FINISHED" ? terminal() : { state: r.state, start: at, end: null, reason: "resynced" });
    return { ...previous, segments };
  }
  if (r.state === "WAITING" && r.num_preemptions === 0) {
    return { request_id: r.request_id, arrival_ts: r.arrival_ts, ticks: [], verifies: [], segments: [
      { state: "WAITING", start: r.arrival_ts, end: null, reason: "arrived" },
    ] };
  }
  const knownUntil = r.state === "FINISHED" ? (r.finish_ts ?? at) : at;
  const segments: Segment[] = [
    { state: "UNKNOWN", start: r.arrival_ts, end: knownUntil, reason: "before the dashboard joined" },
    r.state === "FINISHED" ? terminal() : { state: r.state, start: at, end: null, reason: "from snapshot" },
  ];
  return { request_id: r.request_id, arrival_ts: r.arrival_ts, segments, ticks: [], verifies: [] };
}

/**
 * State from a snapshot. With `previous` (a reconnect or resync), the history that a snapshot
 * cannot carry — timelines, step rows, the log, metrics — is kept and joined to the new state.
 */
export function fromSnapshot(
  snapshot: Snapshot,
  previous?: DashboardState,
  limits: DashboardLimits = previous?.limits ?? DEFAULT_LIMITS,
): DashboardState {
  const engine = stateFromSnapshot(snapshot);
  const sameEngine =
    previous !== undefined && previous.engine.config.num_blocks === engine.config.num_blocks &&
    previous.engine.config.block_size === engine.config.block_size;
  const timelines = new Map<string, RequestTimeline>();
  const tokens = new Map<string, Ring<TokenEntry>>();
  const spec = new Map<string, RequestSpec>();
  for (const r of engine.requests.values()) {
    timelines.set(r.request_id, snapshotTimeline(r, snapshot.ts, sameEngine ? previous.timelines.get(r.request_id) : undefined));
    const known = sameEngine ? previous.tokens.get(r.request_id) : undefined;
    if (known !== undefined) tokens.set(r.request_id, known);
    const verified = sameEngine ? previous.spec.get(r.request_id) : undefined;
    if (verified !== undefined) spec.set(r.request_id, verified);
  }
  const blockTimes = () => new Float64Array(engine.config.num_blocks).fill(NaN);
  const evictedAt = sameEngine ? previous.evictedAt : blockTimes();
  const restoredAt = sameEngine ? previous.restoredAt : blockTimes();
  const droppedAt = sameEngine ? previous.droppedAt : blockTimes();
  return {
    engine,
    timelines,
    tokens,
    spec,
    steps: previous?.steps ?? ring(limits.stepRows),
    stepTimes: previous?.stepTimes ?? ring(limits.stepRows),
    log: previous?.log ?? ring(limits.logSize),
    metrics: previous?.metrics ?? ring(limits.metricsSamples),
    latencies: previous?.latencies ?? ring(limits.latencySamples),
    evictedAt,
    restoredAt,
    droppedAt,
    originTs: previous?.originTs ?? snapshot.ts,
    epoch: (previous?.epoch ?? 0) + 1,
    limits,
  };
}

// ---- the reducer --------------------------------------------------------------------------------------

function latencyOf(r: RequestView): LatencySample {
  const finish = r.finish_ts ?? r.arrival_ts;
  const perSeq = r.output_tokens / Math.max(1, r.n);
  const ttft = r.first_token_ts === null ? null : r.first_token_ts - r.arrival_ts;
  const tpot = r.first_token_ts !== null && perSeq > 1 ? (finish - r.first_token_ts) / (perSeq - 1) : null;
  return { request_id: r.request_id, ts: finish, ttft, tpot, e2e: finish - r.arrival_ts, finish_reason: r.finish_reason };
}

type MTimeline = { -readonly [K in keyof RequestTimeline]: RequestTimeline[K] } & { segments: Segment[]; ticks: ChunkTick[]; verifies: VerifyMark[] };

class DashboardDraft {
  readonly engine: EngineDraft;
  private timelines: Map<string, RequestTimeline>;
  private tokens: Map<string, Ring<TokenEntry>>;
  private spec: Map<string, RequestSpec>;
  private evictedAt: Float64Array;
  private restoredAt: Float64Array;
  private droppedAt: Float64Array;
  private epoch: number;
  private readonly fresh = new WeakSet<object>();
  private readonly logged: AnyEvent[] = [];
  private readonly steps: StepScheduled[] = [];
  private readonly stepTimes: StepFinished[] = [];
  private readonly metrics: MetricsSample[] = [];
  private readonly latencies: LatencySample[] = [];
  private finishedSeen = 0;

  constructor(private readonly base: DashboardState) {
    this.engine = new EngineDraft(base.engine);
    this.timelines = base.timelines as Map<string, RequestTimeline>;
    this.tokens = base.tokens as Map<string, Ring<TokenEntry>>;
    this.spec = base.spec as Map<string, RequestSpec>;
    this.evictedAt = base.evictedAt;
    this.restoredAt = base.restoredAt;
    this.droppedAt = base.droppedAt;
    this.epoch = base.epoch;
  }

  /** `times` with `ids` set to `ts`: copied once per draft (the base state is never written). */
  private stamped(times: Float64Array, ids: readonly number[], ts: number): Float64Array {
    const own = this.fresh.has(times) ? times : times.slice();
    this.fresh.add(own);
    for (const b of ids) if (b >= 0 && b < own.length) own[b] = ts;
    return own;
  }

  private ownTimelines(): Map<string, RequestTimeline> {
    if (!this.fresh.has(this.timelines)) {
      this.timelines = new Map(this.timelines);
      this.fresh.add(this.timelines);
    }
    return this.timelines;
  }

  private ownTokens(): Map<string, Ring<TokenEntry>> {
    if (!this.fresh.has(this.tokens)) {
      this.tokens = new Map(this.tokens);
      this.fresh.add(this.tokens);
    }
    return this.tokens;
  }

  private ownSpec(): Map<string, RequestSpec> {
    if (!this.fresh.has(this.spec)) {
      this.spec = new Map(this.spec);
      this.fresh.add(this.spec);
    }
    return this.spec;
  }

  private mutTimeline(id: string): MTimeline | undefined {
    const current = this.timelines.get(id);
    if (current === undefined) return undefined;
    if (this.fresh.has(current)) return current as MTimeline;
    const copy = { ...current, segments: current.segments.slice(), ticks: current.ticks.slice() };
    this.fresh.add(copy);
    this.ownTimelines().set(id, copy);
    return copy as MTimeline;
  }

  /** The timeline's verify marks, writable (copied at most once per batch, and only when touched). */
  private mutVerifies(id: string): VerifyMark[] | undefined {
    const timeline = this.mutTimeline(id);
    if (timeline === undefined) return undefined;
    if (!this.fresh.has(timeline.verifies)) {
      timeline.verifies = timeline.verifies.slice();
      this.fresh.add(timeline.verifies);
    }
    return timeline.verifies;
  }

  private addVerifyMark(id: string, mark: VerifyMark): void {
    const marks = this.mutVerifies(id);
    if (marks === undefined) return;
    marks.push(mark);
    const extra = marks.length - this.base.limits.maxTokensPerRequest;
    if (extra > 0) marks.splice(0, extra);
  }

  /** The verification (this step's) that a token of `seqId` came out of, if any. */
  private verifyOf(requestId: string, seqId: number): SpecVerified | null {
    const verifies = this.spec.get(requestId)?.verifies;
    if (verifies === undefined) return null;
    const step = this.engine.step;
    for (let j = verifies.end - 1; j >= verifies.start; j--) {
      const v = verifies.buf[j]!;
      if (v.step !== step) break; // older steps: this step's verification would have come after them
      if (v.seq_id === seqId) return v;
    }
    return null;
  }

  private onSpecVerified(e: SpecVerified, ts: number): void {
    const current = this.spec.get(e.request_id);
    const verifies = ringPush(current?.verifies ?? ring<SpecVerified>(this.base.limits.maxTokensPerRequest), [e]);
    this.ownSpec().set(e.request_id, {
      verifies,
      drafts: (current?.drafts ?? 0) + 1,
      draftTokens: (current?.draftTokens ?? 0) + e.proposed.length,
      accepted: (current?.accepted ?? 0) + e.accepted,
    });
    // complete the step's verify mark (the StepScheduled chunk), or add one if that came before we joined
    const timeline = this.timelines.get(e.request_id);
    if (timeline === undefined) return;
    const marks = timeline.verifies;
    for (let j = marks.length - 1; j >= 0 && marks[j]!.step >= e.step; j--) {
      if (marks[j]!.step === e.step && marks[j]!.seq_id === e.seq_id) {
        this.mutVerifies(e.request_id)![j] = { ...marks[j]!, accepted: e.accepted };
        return;
      }
    }
    this.addVerifyMark(e.request_id, { ts, step: e.step, seq_id: e.seq_id, num_draft: e.proposed.length, accepted: e.accepted });
  }

  apply(e: AnyEvent): void {
    if (!this.engine.apply(e)) return;
    const ts = e.ts ?? 0;
    this.logged.push(e);
    switch (e.type) {
      case "request_arrived": {
        const timeline: MTimeline = { request_id: e.request_id, arrival_ts: ts, segments: [], ticks: [], verifies: [] };
        this.fresh.add(timeline);
        this.fresh.add(timeline.verifies);
        this.ownTimelines().set(e.request_id, timeline);
        if (this.tokens.has(e.request_id)) this.ownTokens().delete(e.request_id);
        if (this.spec.has(e.request_id)) this.ownSpec().delete(e.request_id);
        break;
      }
      case "request_state": {
        const timeline = this.mutTimeline(e.request_id);
        if (timeline === undefined) break;
        const last = timeline.segments[timeline.segments.length - 1];
        if (last !== undefined && last.end === null) timeline.segments[timeline.segments.length - 1] = { ...last, end: ts };
        if (e.state === "FINISHED") {
          const state = e.finish_reason === "abort" ? "ABORTED" : "FINISHED";
          timeline.segments.push({ state, start: ts, end: ts, reason: e.reason });
          const request = this.engine.request(e.request_id);
          if (request !== undefined) this.latencies.push(latencyOf(request));
          this.finishedSeen++;
        } else {
          timeline.segments.push({ state: e.state, start: ts, end: null, reason: e.reason });
        }
        break;
      }
      case "token": {
        const current = this.tokens.get(e.request_id) ?? ring<TokenEntry>(this.base.limits.maxTokensPerRequest);
        const entry: TokenEntry = {
          seq_id: e.seq_id, token_id: e.token_id, text: e.text, logprob: e.logprob, ts,
          drafted: e.drafted ?? false, allowed_fraction: e.allowed_fraction ?? null, verify: this.verifyOf(e.request_id, e.seq_id),
        };
        this.ownTokens().set(e.request_id, ringPush(current, [entry]));
        break;
      }
      case "step_scheduled":
        this.steps.push(e);
        for (const chunk of e.prefill) {
          const timeline = this.mutTimeline(chunk.request_id);
          timeline?.ticks.push({ ts, seq_id: chunk.seq_id, start: chunk.start, num_tokens: chunk.num_tokens });
        }
        for (const chunk of [...e.prefill, ...e.decode]) {
          const numDraft = chunk.num_draft ?? 0;
          if (numDraft > 0) this.addVerifyMark(chunk.request_id, { ts, step: e.step, seq_id: chunk.seq_id, num_draft: numDraft, accepted: null });
        }
        break;
      case "spec_verified":
        this.onSpecVerified(e, ts);
        break;
      case "step_finished":
        this.stepTimes.push(e);
        break;
      case "metrics":
        this.metrics.push(e);
        break;
      case "blocks_evicted":
        this.evictedAt = this.stamped(this.evictedAt, e.block_ids, ts);
        break;
      case "blocks_freed":
        if (e.dropped === true) this.droppedAt = this.stamped(this.droppedAt, e.block_ids, ts);
        break;
      case "blocks_cached":
        if (e.from_disk === true) this.restoredAt = this.stamped(this.restoredAt, e.block_ids, ts);
        break;
      case "config_changed":
        this.timelines = new Map();
        this.fresh.add(this.timelines);
        this.tokens = new Map();
        this.fresh.add(this.tokens);
        this.spec = new Map();
        this.fresh.add(this.spec);
        this.evictedAt = new Float64Array(e.config.num_blocks).fill(NaN);
        this.fresh.add(this.evictedAt);
        this.restoredAt = new Float64Array(e.config.num_blocks).fill(NaN);
        this.fresh.add(this.restoredAt);
        this.droppedAt = new Float64Array(e.config.num_blocks).fill(NaN);
        this.fresh.add(this.droppedAt);
        this.epoch++;
        break;
      default:
        break;
    }
  }

  /** Drops the oldest finished requests beyond the limit (with some slack, so not every batch copies). */
  private prune(): void {
    if (this.finishedSeen === 0) return;
    const requests = this.engine.requestMap();
    let finished = 0;
    for (const r of requests.values()) if (r.state === "FINISHED") finished++;
    const limit = this.base.limits.maxFinished;
    if (finished <= limit + Math.max(8, limit >> 3)) return;
    let drop = finished - limit;
    const victims: string[] = [];
    for (const r of requests.values()) {
      if (drop === 0) break;
      if (r.state === "FINISHED") {
        victims.push(r.request_id);
        drop--;
      }
    }
    for (const id of victims) {
      this.engine.deleteRequest(id);
      if (this.timelines.has(id)) this.ownTimelines().delete(id);
      if (this.tokens.has(id)) this.ownTokens().delete(id);
      if (this.spec.has(id)) this.ownSpec().delete(id);
    }
  }

  result(): DashboardState {
    if (this.logged.length === 0) return this.base;
    this.prune();
    const b = this.base;
    return {
      engine: this.engine.result(),
      timelines: this.timelines,
      tokens: this.tokens,
      spec: this.spec,
      steps: ringPush(b.steps, this.steps),
      stepTimes: ringPush(b.stepTimes, this.stepTimes),
      log: ringPush(b.log, this.logged),
      metrics: ringPush(b.metrics, this.metrics),
      latencies: ringPush(b.latencies, this.latencies),
      evictedAt: this.evictedAt,
      restoredAt: this.restoredAt,
      droppedAt: this.droppedAt,
      originTs: b.originTs,
      epoch: this.epoch,
      limits: b.limits,
    };
  }
}

/** Folds `events` into `state`. Events at or below the state's sequence number are ignored. */
export function reduce(state: DashboardState, events: Iterable<AnyEvent>): DashboardState {
  const draft = new DashboardDraft(state);
  for (const e of events) draft.apply(e);
  return draft.result();
}

/** An empty dashboard for before the first snapshot. */
export function emptySnapshot(): Snapshot {
  return {
    type: "snapshot",
    seq: 0,
    ts: 0,
    step: 0,
    config: {
      model: "",
      max_model_len: 0,
      num_blocks: 0,
      block_size: 16,
      max_num_batched_tokens: 0,
      max_num_seqs: 0,
      enable_prefix_caching: false,
      dtype: "",
      device: "",
    },
    requests: [],
    blocks: [],
  };
}
